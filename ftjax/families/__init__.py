"""Model families: one small module per Hugging Face ``model_type``, and the registry that finds them.

A family says what its checkpoints mean to ftjax (:class:`Family`): how its ``config.json`` maps to a
:class:`ftjax.config.ModelConfig` (the fields only it has, and what it refuses), the kind of each of
its layers (``ftjax.layers``: a pattern the drivers scan over), and where each weight sits in its
safetensors (names and layout, read by ``ftjax.checkpoint``). Adding a family whose layers are of
registered kinds is one new module here. Modules whose names start with ``_`` hold shared pieces.

:func:`from_hf_dict` / :func:`load_hf_config` parse a config: the fields every family shares here,
the rest by the family.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import pkgutil
from typing import Any, Callable, Mapping

import numpy as np

from ftjax.config import ConfigError, ModelConfig

#: get(name, shape) -> the tensor as stored (shape in the checkpoint's [out, in] layout), cast to the
#: compute dtype; what :meth:`Family.layer_tensors` reads through.
TensorReader = Callable[[str, tuple[int, ...]], np.ndarray]


class Family:
    """What one ``model_type`` means to ftjax. Subclass it in a module of this package and set:

    model_type: transformers' name; aliases: other ``model_type`` values read as this family (e.g.
    the text model of a multimodal config); qk_norm: how queries and keys are normalised before RoPE
    ("per_head": RMSNorm over head_dim, one weight [hd]; "full": over the whole projection; "none");
    default_rms_eps: transformers' default ``rms_norm_eps``.
    """

    model_type: str = ""
    aliases: tuple[str, ...] = ()
    qk_norm: str = "none"
    default_rms_eps: float = 1e-6

    def unwrap(self, d: Mapping[str, Any], source: str) -> Mapping[str, Any]:
        """The dict to parse (e.g. the ``text_config`` of a multimodal config); default: ``d``."""
        return d

    def parse(self, d: Mapping[str, Any], rope_params: Mapping[str, Any], head_dim: int,
              source: str) -> dict[str, Any]:
        """The family's own ``ModelConfig`` fields: at least num_experts, expert_ffn, norm_topk_prob;
        raises :class:`ConfigError` for what it does not run (naming the field)."""
        raise NotImplementedError

    def layer_kinds(self, cfg: ModelConfig) -> tuple[str, ...]:
        """The token-mixer kind of each of the L layers (``ftjax.layers``)."""
        return ("attention",) * cfg.num_layers

    def tensor_prefix(self, has: Callable[[str], bool]) -> str:
        """The prefix of the text model's tensors (``has(name)``: whether the checkpoint holds a tensor)."""
        return "model."

    def layer_tensors(self, cfg: ModelConfig, get: TensorReader, prefix: str, layer: int,
                      kind: str) -> dict[str, np.ndarray]:
        """Layer ``layer``'s non-expert weights in ftjax's layout (``ftjax.model.param_shapes``: matrices
        [in, out]), read through ``get``."""
        raise NotImplementedError

    def expert_tensors(self, cfg: ModelConfig, prefix: str, layer: int, expert: int) -> tuple[str, str, str]:
        """Names of (gate, up, down) of one expert, each stored [out, in]."""
        p = f"{prefix}layers.{layer}.mlp.experts.{expert}."
        return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"

    def fused_expert_tensors(self, cfg: ModelConfig, prefix: str, layer: int) -> tuple[str, str] | None:
        """Names of a layer's fused expert tensors (gate_up [E, 2F, D], down [E, D, F]) where the family
        may store them so, else None."""
        return None


@functools.cache
def families() -> dict[str, Family]:
    """Every registered family by ``model_type`` (imports this package's modules)."""
    found: dict[str, Family] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        fam = getattr(module, "FAMILY", None)
        if isinstance(fam, Family):
            if fam.model_type in found:
                raise ValueError(f"family {fam.model_type!r} is registered twice")
            found[fam.model_type] = fam
    return found


def names() -> tuple[str, ...]:
    """The supported ``model_type`` values, sorted."""
    return tuple(sorted(families()))


def get(model_type: str) -> Family:
    """The family of ``model_type`` (or of one of its aliases).
    Raises:
      ConfigError: unsupported model_type (the message lists the supported ones)."""
    known = families()
    if model_type in known:
        return known[model_type]
    for fam in known.values():
        if model_type in fam.aliases:
            return fam
    raise ConfigError(f"unsupported 'model_type' {model_type!r}; supported: {', '.join(known)}")


# ---- parsing helpers shared by the families ---------------------------------------------------------
def field(d: Mapping[str, Any], keys: str | tuple[str, ...], source: str, kind: type | tuple = int,
          default: Any = dataclasses.MISSING) -> Any:
    """The first of ``keys`` present (and not None) in ``d``, checked to be ``kind`` (an int is accepted
    for a float), else ``default``.
    Raises:
      ConfigError: ill-typed, or missing with no default (the message names the field)."""
    keys = (keys,) if isinstance(keys, str) else keys
    for k in keys:
        if k in d and d[k] is not None:
            v = d[k]
            if kind is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
                raise ConfigError(f"{source}: field '{k}' should be {getattr(kind, '__name__', kind)}, "
                                  f"got {type(v).__name__} {v!r}")
            return v
    if default is dataclasses.MISSING:
        raise ConfigError(f"{source}: required field '{keys[0]}' is missing")
    return default


def positive(d: Mapping[str, Any], keys: str | tuple[str, ...], source: str, default: Any = dataclasses.MISSING) -> int:
    """A required (or defaulted) integer field that must be >= 1 (:func:`field`).
    Raises:
      ConfigError: missing, ill-typed or < 1."""
    keys = (keys,) if isinstance(keys, str) else keys
    v = field(d, keys, source, int, default)
    if v < 1:
        raise ConfigError(f"{source}: field '{keys[0]}' must be a positive integer, got {v}")
    return v


def refuse(cond: bool, source: str, name: str, why: str) -> None:
    """Raises ConfigError ``source: unsupported 'name': why`` when ``cond``."""
    if cond:
        raise ConfigError(f"{source}: unsupported '{name}': {why}")


def from_hf_dict(d: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """Parses a Hugging Face config dict into a :class:`ModelConfig`.

    Args:
      d: the parsed ``config.json``.
      source: a name for error messages (usually the file path).
    Raises:
      ConfigError: unknown model_type, missing or ill-typed required field, or a feature that
        ftjax does not implement (the message names the field).
    """
    fam = get(d.get("model_type"))
    d = fam.unwrap(d, source)
    hidden = positive(d, "hidden_size", source)
    heads = positive(d, "num_attention_heads", source)
    kv_heads = positive(d, "num_key_value_heads", source, default=heads)
    head_dim = positive(d, "head_dim", source, default=hidden // heads)
    if heads % kv_heads:
        raise ConfigError(f"{source}: 'num_attention_heads' ({heads}) must be a multiple of "
                          f"'num_key_value_heads' ({kv_heads})")
    act = d.get("hidden_act", "silu")
    refuse(act != "silu", source, "hidden_act", f"{act!r} (only silu SwiGLU experts)")
    refuse(bool(d.get("attention_bias", False)), source, "attention_bias", "biases are not implemented")
    refuse(d.get("rope_scaling") not in (None, {}), source, "rope_scaling", f"{d.get('rope_scaling')!r}")
    rope_params = d.get("rope_parameters") or {}
    if not isinstance(rope_params, dict):
        raise ConfigError(f"{source}: field 'rope_parameters' should be an object, got {rope_params!r}")
    rope_type = rope_params.get("rope_type", "default")
    refuse(rope_type != "default", source, "rope_parameters.rope_type", f"{rope_type!r} (only default RoPE)")
    rope_theta = float(rope_params.get("rope_theta", d.get("rope_theta", 10000.0)))
    own = fam.parse(d, rope_params, head_dim, source)
    experts = own["num_experts"]
    top_k = field(d, "num_experts_per_tok", source)
    if not 0 < top_k <= experts:
        raise ConfigError(f"{source}: 'num_experts_per_tok' must be in [1, {experts}], got {top_k}")
    dtype = d.get("torch_dtype") or d.get("dtype") or "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"{source}: unsupported 'dtype' {dtype!r} (float32, bfloat16, float16)")
    return ModelConfig(
        model_type=fam.model_type, vocab_size=positive(d, "vocab_size", source), hidden_size=hidden,
        num_layers=positive(d, "num_hidden_layers", source), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, top_k=top_k, qk_norm=fam.qk_norm,
        rms_norm_eps=field(d, "rms_norm_eps", source, float, fam.default_rms_eps),
        rope_theta=rope_theta, tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=field(d, "max_position_embeddings", source, default=4096), dtype=dtype, **own)


def load_hf_config(path: str | os.PathLike) -> ModelConfig:
    """Reads ``config.json`` (a file, or a checkpoint directory holding one).

    Raises:
      ConfigError: the file is missing, is not JSON, or is not a supported config.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read config ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(d).__name__}")
    return from_hf_dict(d, source=path)
