"""Model configuration: parsed from a Hugging Face ``config.json``, or a named preset.

The config is a frozen (hashable) dataclass so that it can be a static argument of ``jax.jit``.
Supported families: ``qwen3_moe``, ``olmoe``, ``mixtral`` (every decoder layer a routed-expert MoE,
SwiGLU experts, softmax top-k router, RoPE, grouped-query attention). Anything else in a config
that would change the math (dense layers interleaved, sliding windows, rope scaling, biases, qkv
clipping, shared experts, other activations) is refused with a :class:`ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

FAMILIES = ("qwen3_moe", "olmoe", "mixtral")
# How each family normalises queries and keys before RoPE.
#   per_head: RMSNorm over head_dim, one weight [head_dim] (Qwen3).
#   full:     RMSNorm over the whole projection, weights [H*head_dim] (OLMoE).
QK_NORM = {"qwen3_moe": "per_head", "olmoe": "full", "mixtral": "none"}
# transformers' default rms_norm_eps per family, for configs that leave it out.
DEFAULT_RMS_EPS = {"qwen3_moe": 1e-6, "olmoe": 1e-5, "mixtral": 1e-5}


class ConfigError(ValueError):
    """A config.json that ftjax cannot run: missing field, wrong type, or unsupported feature."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and math of one MoE decoder-only model.

    Attributes:
      model_type: one of :data:`FAMILIES`.
      vocab_size: V, number of token ids.
      hidden_size: D, residual width.
      num_layers: L, decoder layers (each with a routed-expert MLP).
      num_heads, num_kv_heads, head_dim: attention shape (grouped-query when kv < heads).
      num_experts: E, routed experts per layer.
      top_k: experts per token.
      expert_ffn: F, intermediate width of one SwiGLU expert.
      norm_topk_prob: renormalise the top-k router probabilities to sum to one.
      qk_norm: "none" | "per_head" | "full" (see module docstring).
      rms_norm_eps: epsilon of every RMSNorm.
      rope_theta: RoPE base.
      tie_word_embeddings: lm head shares the embedding matrix.
      max_position_embeddings: longest sequence (prompt + generated) in tokens.
      dtype: dtype the checkpoint stores ("float32" | "bfloat16" | "float16").
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_ffn: int
    norm_topk_prob: bool
    qk_norm: str
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    dtype: str = "float32"

    # ---- derived sizes -------------------------------------------------------------------
    def expert_bytes(self, itemsize: int) -> int:
        """Bytes of one expert's weights (gate, up, down) at ``itemsize`` bytes per element."""
        return 3 * self.hidden_size * self.expert_ffn * itemsize

    def pool_bytes(self, itemsize: int) -> int:
        """Bytes of all L*E routed experts."""
        return self.num_layers * self.num_experts * self.expert_bytes(itemsize)

    def non_expert_param_count(self) -> int:
        """Number of parameters outside the routed experts (embeddings, attention, norms, router, head)."""
        import math

        from ftjax.model import param_shapes  # late import: model imports this module
        return sum(math.prod(s) for s in _leaves(param_shapes(self)))

    def kv_cache_bytes(self, batch: int, max_seq_len: int, itemsize: int) -> int:
        """Bytes of a K and V cache for ``batch`` sequences of ``max_seq_len`` tokens."""
        return 2 * self.num_layers * batch * max_seq_len * self.num_kv_heads * self.head_dim * itemsize

    def identity(self) -> dict:
        """Fields that define the model's math (used to key stored KV chunks)."""
        return dataclasses.asdict(self)


def _leaves(tree) -> list[tuple[int, ...]]:
    """Shape tuples of a nested dict of shapes."""
    if isinstance(tree, dict):
        return [s for v in tree.values() for s in _leaves(v)]
    return [tree]


def _get(d: Mapping[str, Any], keys: tuple[str, ...], source: str, kind: type | tuple = int,
         default: Any = dataclasses.MISSING) -> Any:
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


def _positive(d: Mapping[str, Any], keys: str | tuple[str, ...], source: str,
              default: Any = dataclasses.MISSING) -> int:
    """A required (or defaulted) integer field that must be >= 1."""
    keys = (keys,) if isinstance(keys, str) else keys
    v = _get(d, keys, source, int, default)
    if v < 1:
        raise ConfigError(f"{source}: field '{keys[0]}' must be a positive integer, got {v}")
    return v


def _refuse(cond: bool, source: str, field: str, why: str) -> None:
    if cond:
        raise ConfigError(f"{source}: unsupported '{field}': {why}")


def from_hf_dict(d: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """Parses a Hugging Face config dict into a :class:`ModelConfig`.

    Args:
      d: the parsed ``config.json``.
      source: a name for error messages (usually the file path).
    Raises:
      ConfigError: unknown model_type, missing or ill-typed required field, or a feature that
        ftjax does not implement (the message names the field).
    """
    mt = d.get("model_type")
    if mt not in FAMILIES:
        raise ConfigError(f"{source}: unsupported 'model_type' {mt!r}; supported: {', '.join(FAMILIES)}")
    hidden = _positive(d, "hidden_size", source)
    heads = _positive(d, "num_attention_heads", source)
    kv_heads = _positive(d, "num_key_value_heads", source, default=heads)
    head_dim = _positive(d, "head_dim", source, default=hidden // heads)
    if heads % kv_heads:
        raise ConfigError(f"{source}: 'num_attention_heads' ({heads}) must be a multiple of "
                          f"'num_key_value_heads' ({kv_heads})")
    act = d.get("hidden_act", "silu")
    _refuse(act != "silu", source, "hidden_act", f"{act!r} (only silu SwiGLU experts)")
    _refuse(bool(d.get("attention_bias", False)), source, "attention_bias", "biases are not implemented")
    _refuse(d.get("rope_scaling") not in (None, {}), source, "rope_scaling", f"{d.get('rope_scaling')!r}")
    rope_params = d.get("rope_parameters") or {}
    if not isinstance(rope_params, dict):
        raise ConfigError(f"{source}: field 'rope_parameters' should be an object, got {rope_params!r}")
    rope_type = rope_params.get("rope_type", "default")
    _refuse(rope_type != "default", source, "rope_parameters.rope_type", f"{rope_type!r} (only default RoPE)")
    rope_theta = float(rope_params.get("rope_theta", d.get("rope_theta", 10000.0)))
    _refuse(d.get("partial_rotary_factor") not in (None, 1, 1.0), source, "partial_rotary_factor", "partial RoPE")

    if mt == "qwen3_moe":
        experts = _positive(d, ("num_experts", "num_local_experts"), source)
        ffn = _positive(d, "moe_intermediate_size", source)
        _refuse(d.get("decoder_sparse_step", 1) != 1, source, "decoder_sparse_step",
                "dense MLP layers interleaved with MoE layers")
        _refuse(bool(d.get("mlp_only_layers")), source, "mlp_only_layers",
                "dense MLP layers interleaved with MoE layers")
        _refuse(bool(d.get("use_sliding_window", False)), source, "use_sliding_window", "sliding-window attention")
        _refuse(bool(d.get("shared_expert_intermediate_size")), source, "shared_expert_intermediate_size",
                "shared experts")
        norm_topk = bool(d.get("norm_topk_prob", False))
    elif mt == "olmoe":
        experts = _positive(d, "num_experts", source)
        ffn = _positive(d, "intermediate_size", source)
        _refuse(d.get("clip_qkv") is not None, source, "clip_qkv", "qkv clipping")
        norm_topk = bool(d.get("norm_topk_prob", False))
    else:  # mixtral
        experts = _positive(d, "num_local_experts", source)
        ffn = _positive(d, "intermediate_size", source)
        _refuse(d.get("sliding_window") is not None, source, "sliding_window", "sliding-window attention")
        norm_topk = True  # Mixtral always renormalises its top-k weights
    top_k = _get(d, ("num_experts_per_tok",), source)
    if not 0 < top_k <= experts:
        raise ConfigError(f"{source}: 'num_experts_per_tok' must be in [1, {experts}], got {top_k}")
    dtype = d.get("torch_dtype") or d.get("dtype") or "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"{source}: unsupported 'dtype' {dtype!r} (float32, bfloat16, float16)")
    return ModelConfig(
        model_type=mt, vocab_size=_positive(d, "vocab_size", source), hidden_size=hidden,
        num_layers=_positive(d, "num_hidden_layers", source), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, num_experts=experts, top_k=top_k, expert_ffn=ffn, norm_topk_prob=norm_topk,
        qk_norm=QK_NORM[mt], rms_norm_eps=_get(d, ("rms_norm_eps",), source, float, DEFAULT_RMS_EPS[mt]),
        rope_theta=rope_theta, tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=_get(d, ("max_position_embeddings",), source, default=4096), dtype=dtype)


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


# Real shapes for benchmarks with synthetic weights (DESIGN.md section 4), and the built-in demo.
PRESETS: dict[str, ModelConfig] = {
    "qwen3-30b-a3b": ModelConfig(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, num_experts=128, top_k=8, expert_ffn=768, norm_topk_prob=True,
        qk_norm="per_head", rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
        max_position_embeddings=40960, dtype="bfloat16"),
    "olmoe-1b-7b": ModelConfig(
        model_type="olmoe", vocab_size=50304, hidden_size=2048, num_layers=16, num_heads=16,
        num_kv_heads=16, head_dim=128, num_experts=64, top_k=8, expert_ffn=1024, norm_topk_prob=False,
        qk_norm="full", rms_norm_eps=1e-5, rope_theta=1e4, tie_word_embeddings=False,
        max_position_embeddings=4096, dtype="bfloat16"),
    "mixtral-8x7b": ModelConfig(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, num_experts=8, top_k=2, expert_ffn=14336, norm_topk_prob=True,
        qk_norm="none", rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False,
        max_position_embeddings=32768, dtype="bfloat16"),
    # Built-in demo: small enough for a CPU, with enough experts that a cache smaller than the
    # pool shows hits and misses.
    "tiny": ModelConfig(
        model_type="qwen3_moe", vocab_size=512, hidden_size=128, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=32, num_experts=16, top_k=4, expert_ffn=128, norm_topk_prob=True,
        qk_norm="per_head", rms_norm_eps=1e-6, rope_theta=1e4, tie_word_embeddings=False,
        max_position_embeddings=2048, dtype="float32"),
}


def preset(name: str) -> ModelConfig:
    """Returns a preset config by name; raises ConfigError listing the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None


# ---------------------------------------------------------------------------------------------
# Run configuration: how an engine runs a model (validated once, here)
# ---------------------------------------------------------------------------------------------
#: Prefill expert loading: stream whole layers, only the routed experts, or pick per chunk.
PREFILL_MODES = ("auto", "stream", "on_demand")
#: How a prefill call runs its layers: one ``lax.scan`` program (``model.forward``), or one program
#: per layer driven from Python with the next layer's host copies issued while the current layer
#: computes (``ftjax.layer_pipeline``); auto: pipelined on a GPU for the calls that stream whole
#: layers of experts, scan otherwise (issue 12; docs/OVERLAP.md).
PREFILL_DRIVERS = ("auto", "scan", "pipelined")
#: Matmul precision of the step's dots: "auto" = full float32 ("highest") when the compute dtype
#: is float32, the backend's fast default otherwise (on GPUs, TF32 for float32 dots).
MATMUL_PRECISIONS = ("auto", "default", "high", "highest")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(choices)}")


def _at_least(name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How an :class:`ftjax.engine.Engine` runs a model. Frozen and validated on creation;
    :meth:`for_model` checks it against a model and resolves what depends on it.

    Attributes:
      experts: "resident" | "cached" | "on_demand" (``ftjax.experts.offload.MODES``).
      num_slots: S, device expert slots (cached / on_demand: E <= S <= L*E); resident: L*E.
      max_seq_len: KV cache length in tokens (prompt + generated).
      batch: sequences decoded together.
      prefill: one of :data:`PREFILL_MODES`. stream: whole layers through two E-slot buffers
        (S >= 2E); on_demand: the routed experts through the slot cache; auto: stream when S >= 2E
        and a chunk has at least E (token, expert) pairs (DESIGN.md 1.3).
      prefill_chunk: prompts longer than this many tokens are prefilled in chunks.
      prefill_overlap: copy layer l+1's experts while layer l computes (False: the ablation).
      prefill_driver: one of :data:`PREFILL_DRIVERS`.
      cache_policy: slot eviction policy (``ftjax.experts.slot_table.POLICIES``).
      matmul_precision: one of :data:`MATMUL_PRECISIONS`.
    Raises:
      ValueError: a choice outside its registry or a size out of range (the message names the field).
    """

    experts: str = "resident"
    num_slots: int | None = None
    max_seq_len: int = 512
    batch: int = 1
    prefill: str = "auto"
    prefill_chunk: int = 8192
    prefill_overlap: bool = True
    prefill_driver: str = "auto"
    cache_policy: str = "lru"
    matmul_precision: str = "auto"

    def __post_init__(self):
        from ftjax.experts.offload import MODES  # late imports: these modules import this one
        from ftjax.experts.slot_table import POLICIES
        _choice("experts mode", self.experts, MODES)
        _choice("prefill mode", self.prefill, PREFILL_MODES)
        _choice("prefill driver", self.prefill_driver, PREFILL_DRIVERS)
        _choice("cache policy", self.cache_policy, POLICIES)
        _choice("matmul precision", self.matmul_precision, MATMUL_PRECISIONS)
        for name in ("max_seq_len", "batch", "prefill_chunk"):
            _at_least(name, getattr(self, name), 1)
        if self.num_slots is not None:
            _at_least("num_slots", self.num_slots, 1)
        if self.experts != "resident" and self.num_slots is None:
            raise ValueError(f"experts mode {self.experts!r} needs num_slots")
        if self.prefill == "stream" and self.experts == "resident":
            raise ValueError("prefill=stream needs an offloading experts mode (cached or on_demand)")

    def for_model(self, cfg: ModelConfig) -> "EngineConfig":
        """This config checked against ``cfg``, with resident's slots resolved to L*E.

        Raises:
          ValueError: max_seq_len beyond the model's positions; slots outside [E, L*E]; stream
            without 2E slots.
        """
        if self.max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len {self.max_seq_len} exceeds the model's max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        all_slots = cfg.num_layers * cfg.num_experts
        if self.experts == "resident":
            return dataclasses.replace(self, num_slots=all_slots)
        if not cfg.num_experts <= self.num_slots <= all_slots:
            raise ValueError(f"num_slots must be in [E, L*E] = [{cfg.num_experts}, {all_slots}], got {self.num_slots}")
        if self.prefill == "stream" and self.num_slots < 2 * cfg.num_experts and not self.pipelines_streams():
            raise ValueError(f"prefill=stream on the layer scan needs at least 2E={2 * cfg.num_experts} slots (have "
                             f"{self.num_slots}, mode {self.experts}); the pipelined driver needs E")
        return self

    def pipelines_streams(self) -> bool:
        """Whether streamed prefill calls run on the layer-pipelined driver (its own two full-layer
        buffers, no borrowed slots): ``prefill_driver`` "pipelined", or "auto" on a GPU."""
        from ftjax import memory
        return self.prefill_driver == "pipelined" or (self.prefill_driver == "auto" and memory.backend() == "gpu")

    def precision(self, dtype: str) -> str:
        """The matmul precision a step runs with for compute dtype ``dtype``."""
        if self.matmul_precision != "auto":
            return self.matmul_precision
        return "highest" if dtype == "float32" else "default"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


#: How a reused prefix reaches the device: in the prefill scan with the next layer prefetched, in
#: the scan as scan ``xs``, or all layers before the step (the ablation).
KV_LOADS = ("prefetch", "xs", "all_first")
#: Where new chunks go to host memory: inside the scan body ("scan") or after the step ("after").
KV_STORE_ROUTES = ("scan", "after")


@dataclasses.dataclass(frozen=True)
class KVOffloadConfig:
    """Layerwise KV offload with prefix reuse (after LMCache; DESIGN.md 1.4).

    Attributes:
      chunk_tokens: C, tokens per stored chunk (LMCache's default 256).
      load: one of :data:`KV_LOADS`.
      store_route: one of :data:`KV_STORE_ROUTES`.
      prefill_chunk: most tokens per prefill call (a positive multiple of C); longer suffixes
        take several calls at increasing start offsets.
      store_new: insert each request's new full chunks into the store (False: lookup only).
      bucket_prefix: pad the hit-chunk count to bound recompiles (``ftjax.kv.layerwise.bucket_chunks``).
    Raises:
      ValueError: bad load / route, chunk_tokens < 1, prefill_chunk not a positive multiple of C.
    """

    chunk_tokens: int = 256
    load: str = "prefetch"
    store_route: str = "scan"
    prefill_chunk: int = 8192
    store_new: bool = True
    bucket_prefix: bool = True

    def __post_init__(self):
        _choice("KV load", self.load, KV_LOADS)
        _choice("KV store route", self.store_route, KV_STORE_ROUTES)
        if isinstance(self.chunk_tokens, bool) or not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1:
            raise ValueError(f"kv chunk tokens must be >= 1, got {self.chunk_tokens}")
        if self.prefill_chunk < self.chunk_tokens or self.prefill_chunk % self.chunk_tokens:
            raise ValueError(f"prefill chunk {self.prefill_chunk} must be a positive multiple of the KV chunk "
                             f"({self.chunk_tokens} tokens)")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
