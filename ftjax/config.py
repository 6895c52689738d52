"""Model configuration: parsed from a Hugging Face ``config.json``, or a named preset.

The config is a frozen (hashable) dataclass so that it can be a static argument of ``jax.jit``.
Supported families: ``qwen3_moe``, ``olmoe``, ``mixtral`` (every decoder layer a routed-expert MoE,
SwiGLU experts, softmax top-k router, RoPE, grouped-query attention), and the hybrid
``qwen3_5_moe`` (Qwen3.5 / Qwen3.6 MoE: Gated DeltaNet and gated full-attention layers in a
repeating pattern, partial RoPE, zero-centred RMSNorm weights, a shared expert beside the routed
ones; ``ftjax.hybrid``). Anything else in a config that would change the math (dense layers
interleaved, sliding windows, rope scaling, biases, qkv clipping, shared experts outside
qwen3_5_moe, other activations) is refused with a :class:`ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

FAMILIES = ("qwen3_moe", "olmoe", "mixtral", "qwen3_5_moe")
#: transformers' model_type of the text model of a family, accepted as that family.
FAMILY_ALIASES = {"qwen3_5_moe_text": "qwen3_5_moe"}
#: Token mixers of a hybrid family's layers (``ModelConfig.layer_types``).
LAYER_TYPES = ("full_attention", "linear_attention")
# How each family normalises queries and keys before RoPE.
#   per_head: RMSNorm over head_dim, one weight [head_dim] (Qwen3).
#   full:     RMSNorm over the whole projection, weights [H*head_dim] (OLMoE).
QK_NORM = {"qwen3_moe": "per_head", "olmoe": "full", "mixtral": "none", "qwen3_5_moe": "per_head"}
# transformers' default rms_norm_eps per family, for configs that leave it out.
DEFAULT_RMS_EPS = {"qwen3_moe": 1e-6, "olmoe": 1e-5, "mixtral": 1e-5, "qwen3_5_moe": 1e-6}


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
      layer_types: hybrid families only: each layer's token mixer (:data:`LAYER_TYPES`); () for
        the families whose every layer is full attention.
      partial_rotary_factor: fraction of head_dim that RoPE rotates (the leading dims).
      attn_output_gate: the query projection also gives a per-head gate; the attention output is
        multiplied by its sigmoid before ``wo``.
      norm_offset: RMSNorm weights are zero-centred (scale ``1 + w``, in float32).
      shared_expert_ffn: width of the always-on shared expert (0: none); its output is scaled by
        a sigmoid gate.
      linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim,
      linear_conv_kernel: the Gated DeltaNet layers' shape (0 without such layers).
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
    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False
    norm_offset: bool = False
    shared_expert_ffn: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0

    # ---- hybrid layer pattern --------------------------------------------------------------
    @property
    def is_hybrid(self) -> bool:
        """Has Gated DeltaNet (linear attention) layers beside full attention."""
        return "linear_attention" in self.layer_types

    @property
    def block_pattern(self) -> tuple[str, ...]:
        """The shortest repeating unit of ``layer_types`` (the block the hybrid decoder scans over);
        a one-layer full-attention block for the other families."""
        types = self.layer_types or ("full_attention",)
        n = len(types)
        for p in range(1, n + 1):
            if n % p == 0 and types == types[:p] * (n // p):
                return types[:p]
        return types

    @property
    def num_blocks(self) -> int:
        return self.num_layers // len(self.block_pattern)

    @property
    def num_attention_layers(self) -> int:
        """Layers with a KV cache (all of them outside the hybrid families)."""
        return sum(t == "full_attention" for t in self.layer_types) if self.layer_types else self.num_layers

    @property
    def num_linear_layers(self) -> int:
        """Gated DeltaNet layers (with a conv and a recurrent state instead of a KV cache)."""
        return sum(t == "linear_attention" for t in self.layer_types)

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the DeltaNet conv: q, k (key dim each) and v (value dim)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    def linear_state_bytes(self, batch: int, itemsize: int) -> int:
        """Bytes of the DeltaNet layers' per-sequence state: the conv state (last K-1 inputs, compute
        dtype) and the recurrent state [Hv, dk, dv] (float32)."""
        conv = (self.linear_conv_kernel - 1) * self.linear_conv_dim * itemsize
        rec = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4
        return self.num_linear_layers * batch * (conv + rec)

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
        """Bytes of the per-sequence state of ``batch`` sequences of ``max_seq_len`` tokens: the K and
        V cache of the full-attention layers, plus the DeltaNet layers' conv and recurrent state."""
        kv = 2 * self.num_attention_layers * batch * max_seq_len * self.num_kv_heads * self.head_dim * itemsize
        return kv + self.linear_state_bytes(batch, itemsize)

    def identity(self) -> dict:
        """Fields that define the model's math (used to key stored KV chunks). The hybrid fields are
        left out where they hold their defaults, so the other families keep their identities."""
        d = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if f.name in HYBRID_FIELDS and d[f.name] == f.default:
                del d[f.name]
        return d


#: ModelConfig fields that only the hybrid families set.
HYBRID_FIELDS = ("layer_types", "partial_rotary_factor", "attn_output_gate", "norm_offset", "shared_expert_ffn",
                 "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel")


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
    mt = FAMILY_ALIASES.get(mt, mt)
    if mt not in FAMILIES:
        raise ConfigError(f"{source}: unsupported 'model_type' {mt!r}; supported: {', '.join(FAMILIES)}")
    if mt == "qwen3_5_moe" and "text_config" in d:
        d = _text_config(d, source)
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
    hybrid: dict[str, Any] = {}
    if mt == "qwen3_5_moe":
        hybrid = _qwen3_5_fields(d, rope_params, head_dim, source)
    else:
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
    elif mt == "qwen3_5_moe":
        experts = _positive(d, "num_experts", source)
        ffn = _positive(d, "moe_intermediate_size", source)
        norm_topk = True  # its router always renormalises the top-k probabilities
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
        max_position_embeddings=_get(d, ("max_position_embeddings",), source, default=4096), dtype=dtype, **hybrid)


def _text_config(d: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The text model's fields of a ForConditionalGeneration config (``text_config``), with the
    outer dtype and tied-head flag where the text config leaves them out. The vision tower's
    config is not read: ftjax runs the text model only."""
    text = d["text_config"]
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: field 'text_config' should be an object, got {type(text).__name__}")
    outer = {k: d[k] for k in ("torch_dtype", "dtype", "tie_word_embeddings") if d.get(k) is not None}
    return {**outer, **{k: v for k, v in text.items() if v is not None}, "model_type": "qwen3_5_moe"}


def _qwen3_5_fields(d: Mapping[str, Any], rope_params: Mapping[str, Any], head_dim: int,
                    source: str) -> dict[str, Any]:
    """The hybrid fields of a qwen3_5_moe text config (transformers' Qwen3_5MoeTextConfig defaults
    where a field is absent). The multimodal rope sections (``mrope_section``) are accepted as
    they are: for text every section has the same position, which reduces them to plain RoPE."""
    n = _positive(d, "num_hidden_layers", source)
    types = d.get("layer_types")
    if types is None:
        every = _positive(d, "full_attention_interval", source, default=4)
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(f"{source}: field 'layer_types' must list one of {LAYER_TYPES} per layer "
                          f"({n} layers), got {types!r}")
    _refuse("full_attention" not in types, source, "layer_types", "no full_attention layer")
    _refuse(d.get("attn_output_gate", True) is not True, source, "attn_output_gate",
            "attention without its output gate")
    prf = rope_params.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
    if not isinstance(prf, (int, float)) or isinstance(prf, bool) or not 0 < prf <= 1 or int(head_dim * prf) % 2:
        raise ConfigError(f"{source}: field 'partial_rotary_factor' must be in (0, 1] and rotate an even number "
                          f"of head dims, got {prf!r}")
    kh = _positive(d, "linear_num_key_heads", source, default=16)
    vh = _positive(d, "linear_num_value_heads", source, default=32)
    if vh % kh:
        raise ConfigError(f"{source}: 'linear_num_value_heads' ({vh}) must be a multiple of "
                          f"'linear_num_key_heads' ({kh})")
    return dict(layer_types=tuple(types), partial_rotary_factor=float(prf), attn_output_gate=True, norm_offset=True,
                shared_expert_ffn=_positive(d, "shared_expert_intermediate_size", source),
                linear_num_key_heads=kh, linear_num_value_heads=vh,
                linear_key_head_dim=_positive(d, "linear_key_head_dim", source, default=128),
                linear_value_head_dim=_positive(d, "linear_value_head_dim", source, default=128),
                linear_conv_kernel=_positive(d, "linear_conv_kernel_dim", source, default=4))


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
    # Qwen3.5-35B-A3B (Qwen3.6-35B-A3B has the same shape): 3 Gated DeltaNet layers to 1 gated
    # attention layer, 256 routed experts + 1 shared expert per layer.
    "qwen3.5-35b-a3b": ModelConfig(
        model_type="qwen3_5_moe", vocab_size=248320, hidden_size=2048, num_layers=40, num_heads=16,
        num_kv_heads=2, head_dim=256, num_experts=256, top_k=8, expert_ffn=512, norm_topk_prob=True,
        qk_norm="per_head", rms_norm_eps=1e-6, rope_theta=1e7, tie_word_embeddings=False,
        max_position_embeddings=262144, dtype="bfloat16",
        layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 10, partial_rotary_factor=0.25,
        attn_output_gate=True, norm_offset=True, shared_expert_ffn=512, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel=4),
    # Built-in demo: small enough for a CPU, with enough experts that a cache smaller than the
    # pool shows hits and misses.
    "tiny": ModelConfig(
        model_type="qwen3_moe", vocab_size=512, hidden_size=128, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=32, num_experts=16, top_k=4, expert_ffn=128, norm_topk_prob=True,
        qk_norm="per_head", rms_norm_eps=1e-6, rope_theta=1e4, tie_word_embeddings=False,
        max_position_embeddings=2048, dtype="float32"),
    # The hybrid family at demo size: one block of 3 Gated DeltaNet layers + 1 gated attention
    # layer (CPU smoke runs of prefix reuse, whose chunks must be multiples of 64 tokens).
    "tiny-hybrid": ModelConfig(
        model_type="qwen3_5_moe", vocab_size=512, hidden_size=128, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=32, num_experts=16, top_k=4, expert_ffn=128, norm_topk_prob=True,
        qk_norm="per_head", rms_norm_eps=1e-6, rope_theta=1e4, tie_word_embeddings=False,
        max_position_embeddings=2048, dtype="float32",
        layer_types=("linear_attention",) * 3 + ("full_attention",), partial_rotary_factor=0.25,
        attn_output_gate=True, norm_offset=True, shared_expert_ffn=128, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel=4),
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
#: How the layer-pipelined driver copies a reused prefix's rows to the device while earlier layers
#: compute (docs/OVERLAP.md, "The layerwise KV load"):
#: "put" (default): ``jax.device_put`` from Python of the rows of ``EngineConfig.prefix_copy_layers``
#: layers of each of the n stored chunks, one group ahead (on the H200: 80% of a 16k prefix's load
#: hidden with 4 layers per put; a put per layer was Python-bound, ~3 ms for 62 slices).
#: "in_program": layer l's program takes layer l+1's slices (host memory) as arguments and copies them
#: itself; one dispatch per layer, but XLA schedules those copies before the program's compute, so on
#: the H200 they did not overlap (TTFT 137 ms against 97 ms for "put").
PREFIX_COPIES = ("put", "in_program")

#: How XLA compiles the dense GEMMs of a decode program (one token per sequence) on a GPU
#: (``EngineConfig.decode_gemm``; resolved by :func:`ftjax.engine.decode_compiler_options`).
#: "xla": XLA's defaults: Triton GEMM fusions, which on the H200 first copy each layer's weight
#: slice out of the stacked [L, ...] weights (``memcpy`` kernels, 1.38 ms of a 10.4 ms batch-1 step
#: of qwen3-30b-a3b), and the dot merger, which fuses the q/k/v products by concatenating their weight
#: slices (another copy per step). "cublas": decode programs compile with Triton GEMMs and the dot
#: merger off, so cuBLAS reads each slice in place (docs/PROFILE.md, session 9). "auto": "cublas" on a
#: GPU in a 16-bit compute dtype, "xla" elsewhere (float32 runs are oracle runs). Same products,
#: computed by another library (rounding may differ).
DECODE_GEMMS = ("auto", "xla", "cublas")

#: Whether decode programs on a GPU run as CUDA graphs whose loops stay on the device
#: (``EngineConfig.decode_graphs``; resolved by :func:`ftjax.engine.decode_graphs_on`). A decode step
#: of an offloading mode copies its misses in a loop whose trip count is data (``fetch_experts``):
#: XLA runs such a loop from the host, copying its predicate to the host and waiting on the stream
#: at every iteration (a ``MemcpyD2H`` and a drained GPU per layer). With XLA's command buffers for
#: WHILE and CONDITIONAL the loop runs as a CUDA graph conditional node instead. "on": every decode
#: program on a GPU; "off": XLA's defaults; "auto": on for the cached and on_demand modes when the step
#: fetches every miss (the fetch miss policy, or a cpu / adaptive split that uses no CPU at that batch;
#: the runs it was measured on; docs/PROFILE.md, session 10). Same kernels, same
#: logits.
DECODE_GRAPHS = ("auto", "on", "off")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(choices)}")


def _boolean(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


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
      stream_d2d_hits: a streamed call on the pipelined driver copies the experts of a layer that
        sit in the slot cache device to device into the layer's buffer, and only the others over
        PCIe (same bytes, same logits; docs/OVERLAP.md). False: every expert over PCIe.
      prefix_copy: one of :data:`PREFIX_COPIES`: how a prefill call on the pipelined driver copies
        a reused prefix's rows from host memory while earlier layers compute. "put": a
        ``device_put`` from Python per group of ``prefix_copy_layers`` layers, a group ahead;
        "in_program": layer l's program copies layer l+1's slices itself (measured slower on the
        H200: XLA schedules those copies before the program's compute; docs/OVERLAP.md). Used
        only by calls with a prefix and ``prefill_overlap`` (the serial ablation puts); the scan
        driver copies inside its scan either way. Same logits both ways.
      prefix_copy_layers: with ``prefix_copy`` "put": one ``device_put`` copies the rows of this
        many consecutive layers of every chunk (a chunk is layer-major, so they are one contiguous
        host span), issued a whole group ahead: the Python cost of the n copies is paid once per
        group instead of once per layer. The largest divisor of the model's layer count not above
        this value is used (:func:`ftjax.layer_pipeline.copy_group_layers`). 1: a put per layer.
        Default 4, the best of 1, 2, 3, 4, 8, 16 on the H200 (docs/OVERLAP.md: 80% of a 16k
        prefix's load hidden; 2 layers per put is still Python-bound, 16 hides less behind compute).
      cache_policy: slot eviction policy (``ftjax.experts.slot_table.POLICIES``).
      matmul_precision: one of :data:`MATMUL_PRECISIONS`.
      decode_gemm: one of :data:`DECODE_GEMMS`: which GEMMs XLA uses in decode programs on a GPU.
      decode_graphs: one of :data:`DECODE_GRAPHS`: whether decode programs on a GPU keep their loops
        on the device (CUDA graphs) instead of waiting on the host at every iteration.
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
    stream_d2d_hits: bool = True
    prefix_copy: str = "put"
    prefix_copy_layers: int = 4
    cache_policy: str = "lru"
    matmul_precision: str = "auto"
    decode_gemm: str = "auto"
    decode_graphs: str = "auto"

    def __post_init__(self):
        from ftjax.experts.offload import MODES  # late imports: these modules import this one
        from ftjax.experts.slot_table import POLICIES
        _choice("experts mode", self.experts, MODES)
        _choice("prefill mode", self.prefill, PREFILL_MODES)
        _choice("prefill driver", self.prefill_driver, PREFILL_DRIVERS)
        _choice("cache policy", self.cache_policy, POLICIES)
        _choice("matmul precision", self.matmul_precision, MATMUL_PRECISIONS)
        _choice("prefix_copy", self.prefix_copy, PREFIX_COPIES)
        _choice("decode_gemm", self.decode_gemm, DECODE_GEMMS)
        _choice("decode_graphs", self.decode_graphs, DECODE_GRAPHS)
        for name in ("max_seq_len", "batch", "prefill_chunk", "prefix_copy_layers"):
            _at_least(name, getattr(self, name), 1)
        _boolean("stream_d2d_hits", self.stream_d2d_hits)
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
        if cfg.is_hybrid and self.prefill_driver == "pipelined":
            raise ValueError(f"prefill_driver 'pipelined' runs families of one layer kind; {cfg.model_type} "
                             f"scans blocks of two kinds: use 'auto' or 'scan'")
        if self.prefill == "stream" and self.num_slots < 2 * cfg.num_experts and not self.pipelines_streams(cfg):
            raise ValueError(f"prefill=stream on the layer scan needs at least 2E={2 * cfg.num_experts} slots (have "
                             f"{self.num_slots}, mode {self.experts}); the pipelined driver needs E")
        return self

    def pipelines_streams(self, cfg: ModelConfig | None = None) -> bool:
        """Whether streamed prefill calls run on the layer-pipelined driver (its own two full-layer
        buffers, no borrowed slots): ``prefill_driver`` "pipelined", or "auto" on a GPU; never for a
        hybrid family (``cfg.is_hybrid``: its decoder scans blocks of layers of two kinds)."""
        from ftjax import memory
        if cfg is not None and cfg.is_hybrid:
            return False
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
