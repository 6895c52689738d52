"""Configuration: the model's shape (:class:`ModelConfig`) and how an engine runs it
(:class:`EngineConfig`, :class:`KVOffloadConfig`), each frozen (hashable: a static argument of the jitted
steps) and validated once, on creation.

A model's config is parsed from a Hugging Face ``config.json`` by its family (``ftjax.families``), or
named by a preset (:data:`PRESETS`). The run configuration's choices come from the code's registries
(cache policies, miss policies, kernels), so a flag lists what exists. This module sits at the bottom:
it reads registries, and nothing it imports reads it back.
"""

from __future__ import annotations

import dataclasses

import jax

from ftjax import memory
from ftjax.experts.cpu_experts import CALLBACK_IMPLS
from ftjax.experts.cpu_experts import IMPLS as CPU_EXPERT_IMPLS
from ftjax.experts.miss_policy import POLICIES as MISS_POLICIES
from ftjax.experts.miss_split import SplitModel
from ftjax.experts.slot_table import POLICIES as CACHE_POLICIES
from ftjax.kernels.registry import KernelConfig


class ConfigError(ValueError):
    """A config.json that ftjax cannot run: missing field, wrong type, or unsupported feature."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and math of one MoE decoder-only model.

    Attributes:
      model_type: a registered family (``ftjax.families``).
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
      layer_types: hybrid families only: each layer's token mixer as transformers names it
        ("full_attention" | "linear_attention"); () for the families whose every layer is full attention.
      partial_rotary_factor: fraction of head_dim that RoPE rotates (the leading dims).
      attn_output_gate: the query projection also gives a per-head gate; the attention output is
        multiplied by its sigmoid before ``wo``.
      norm_offset: RMSNorm weights are zero-centred (scale ``1 + w``, in float32).
      shared_expert_ffn: width of the always-on shared expert (0: none); its output is scaled by
        a sigmoid gate.
      linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim,
      linear_conv_kernel: the Gated DeltaNet layers' shape (0 without such layers).

    Raises:
      ValueError: ``layer_types`` given with a length other than ``num_layers``.
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

    def __post_init__(self):
        # a cut that forgets layer_types would scan the wrong blocks and fail deep inside a trace
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"ModelConfig: layer_types has {len(self.layer_types)} entries, num_layers is "
                             f"{self.num_layers} (cut both: experiments.common.preset_cut)")

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
#: Where the routed experts live (``ftjax.experts.offload``): all on the device; a global LRU cache of
#: S slots on the device with the misses copied from host memory; or every routed expert copied at
#: every layer (the no-cache baseline).
EXPERT_MODES = ("resident", "cached", "on_demand")
#: Prefill expert loading: stream whole layers, only the routed experts, or pick per chunk.
PREFILL_MODES = ("auto", "stream", "on_demand")
#: How a prefill call runs its layers: one ``lax.scan`` program over the layer pattern (``model.forward``),
#: or one program per layer driven from Python with the next layer's host copies issued while the current
#: layer computes (``ftjax.runtime.pipelined``); auto: pipelined on a GPU for the calls that stream whole
#: layers of experts or load a reused prefix from host memory, scan otherwise and for a float32 compute dtype
#: (``EngineConfig.for_compute_dtype``; docs/OVERLAP.md).
PREFILL_DRIVERS = ("auto", "scan", "pipelined")
#: Matmul precision of the step's dots: "auto" = full float32 ("highest") when the compute dtype
#: is float32, the backend's fast default otherwise (on GPUs, TF32 for float32 dots).
MATMUL_PRECISIONS = ("auto", "default", "high", "highest")
#: How the layer-pipelined driver copies a reused prefix's rows to the device while earlier layers
#: compute (docs/OVERLAP.md, "The layerwise KV load"): "put" (default), a ``jax.device_put`` from Python
#: of the rows of ``EngineConfig.prefix_copy_layers`` layers of each stored chunk, one group ahead;
#: "in_program", layer l's program copies layer l+1's slices itself (measured slower: XLA schedules
#: those copies before the program's compute).
PREFIX_COPIES = ("put", "in_program")
#: How the routed experts are split over ``EngineConfig.devices`` > 1 devices (docs/MULTI_GPU.md): "expert",
#: whole experts, E / N owned by each device, each with its own slot pool and table
#: (``ftjax.experts.parallel``); "tensor", every expert's FFN width F split over the devices, one slot table
#: replicated on all of them (``ftjax.experts.tensor_parallel``).
EXPERT_SPLITS = ("expert", "tensor")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(choices)}")


def _boolean(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _at_least(name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


#: How a decode step reaches the CPU's share of its misses (``MissPolicyConfig.cpu_driver``).
CPU_DRIVERS = ("callback", "host")


@dataclasses.dataclass(frozen=True)
class MissPolicyConfig:
    """What an expert-cache miss does (FreeToken's CPU misses and bandwidth-adaptive split; DESIGN.md 1.2;
    ``ftjax.experts.miss_policy``). The engine builds its runtime from this.

    Attributes:
      policy: one of ``ftjax.experts.miss_policy.POLICIES``: "fetch" (copy every miss to the device),
        "cpu" (compute every miss on the host CPU), "adaptive" (split each layer's misses by a cost model).
      cpu_impl: how misses are computed on the CPU (``ftjax.experts.cpu_experts.IMPLS``).
      cpu_threads: host-kernel threads of the callback mechanisms; 0 = the calibration profile's, or half
        the cores (``callback``, ``callback_async``) or every core (``numpy_rows_async``, ``native_async``).
      fixed_fetch: adaptive only: fetch ``min(fixed_fetch, M)`` of a layer's M misses instead of the
        calibrated split (sweeps, tests).
      split_model: adaptive only: the cost model to split by (``miss_split.SplitModel``), instead of the
        calibration profile's.
      calibration_profile: adaptive only: the calibration profile JSON (``ftjax.calibrate``) to read the
        cost model from (None: ``~/.cache/ftjax/calibration.json``; calibrated quickly and added when missing).
      cpu_driver: one of :data:`CPU_DRIVERS`: how a decode step reaches the CPU's share of its misses.
        "callback": the step is one program and calls the host kernel through ``io_callback`` in every layer;
        "host": the step runs layer by layer from Python and calls the host kernel between a layer's programs
        (``ftjax.runtime.host_split``; needs a mechanism with a host kernel, ``cpu_experts.CALLBACK_IMPLS``).
    Raises:
      ValueError: an unknown policy, mechanism or driver, a negative count, split options without "adaptive",
        or the "host" driver with a mechanism that has no host kernel (the message names the field).
    """

    policy: str = "fetch"
    cpu_impl: str = "callback_async"
    cpu_threads: int = 0
    fixed_fetch: int | None = None
    split_model: SplitModel | None = None
    calibration_profile: str | None = None
    cpu_driver: str = "callback"

    def __post_init__(self):
        _choice("miss policy", self.policy, MISS_POLICIES)
        _choice("cpu expert impl", self.cpu_impl, CPU_EXPERT_IMPLS)
        _choice("cpu driver", self.cpu_driver, CPU_DRIVERS)
        if self.cpu_driver == "host" and self.cpu_impl not in CALLBACK_IMPLS:
            raise ValueError(f"cpu_driver 'host' calls a host kernel from Python; cpu_impl {self.cpu_impl!r} has "
                             f"none (use one of {CALLBACK_IMPLS})")
        _at_least("cpu_threads", self.cpu_threads, 0)
        if self.fixed_fetch is not None:
            _at_least("fixed_fetch", self.fixed_fetch, 0)
        if (self.fixed_fetch is not None or self.split_model is not None) and self.policy != "adaptive":
            raise ValueError(f"fixed_fetch / split_model need miss policy 'adaptive', got {self.policy!r}")
        if self.fixed_fetch is not None and self.split_model is not None:
            raise ValueError("give the adaptive policy fixed_fetch or split_model, not both")

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["split_model"] = self.split_model.as_dict() if self.split_model is not None else None
        return d


def check_devices(devices: int, num_experts: int, available: int | None = None, split: str = "expert",
                  num_ffn: int | None = None) -> None:
    """Checks a device count for splitting the experts (``EngineConfig.devices``, ``EngineConfig.expert_split``).

    Args:
      devices: N, devices to split the experts over (1: no split).
      num_experts: E, routed experts per layer.
      available: devices present (default ``jax.device_count()``).
      split: one of :data:`EXPERT_SPLITS`.
      num_ffn: F, the expert FFN width (checked for the "tensor" split).
    Raises:
      ValueError: N < 1, N above the devices present, or N not dividing E ("expert": each device owns E / N
        experts of every layer) or F ("tensor": each device holds F / N columns of every expert).
    """
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    available = jax.device_count() if available is None else available
    if devices > available:
        raise ValueError(f"devices={devices} exceeds the {available} device(s) present "
                         f"(jax.device_count(); a CPU run can force more with "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count=N before jax starts)")
    if split == "tensor":
        if num_ffn is not None:
            check_ffn_split(devices, num_ffn)
        return
    if num_experts % devices:
        raise ValueError(f"devices={devices} must divide the number of experts E={num_experts} "
                         f"(each device owns E / devices experts of every layer)")


def check_ffn_split(devices: int, num_ffn: int) -> None:
    """Raises ValueError unless ``devices`` divides the expert FFN width F (``expert_split`` "tensor": each device
    holds F / devices columns of every expert; ``ftjax.experts.tensor_parallel``)."""
    if num_ffn % devices:
        raise ValueError(f"devices={devices} must divide the expert FFN width F={num_ffn} (expert_split "
                         f"'tensor': each device holds F / devices columns of every expert)")


def check_slots(num_slots: int, num_layers: int, num_experts: int, devices: int) -> int:
    """Slots per device, S / N, for a pool of S slots split over N devices (``ftjax.experts.parallel``).
    Raises:
      ValueError: N not dividing S, or S / N outside [E / N, L * E / N] (each device's table must hold every
        expert of its share of one layer, and no more than its share of the whole pool)."""
    el = num_experts // devices
    if num_slots % devices:
        raise ValueError(f"num_slots={num_slots} must be divisible by devices={devices} (each device its own pool)")
    per = num_slots // devices
    if not el <= per <= num_layers * el:
        raise ValueError(f"num_slots / devices = {per} must be in [E/devices, L*E/devices] = [{el}, {num_layers * el}]")
    return per


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How an ``ftjax.Engine`` runs a model. Frozen and validated on creation; :meth:`for_model`
    checks it against a model and resolves what depends on it.

    Attributes:
      experts: one of :data:`EXPERT_MODES`.
      num_slots: S, device expert slots (cached / on_demand: E <= S <= L*E); resident: L*E.
      max_seq_len: KV cache length in tokens (prompt + generated).
      batch: sequences decoded together (batch rows of the engine).
      prefill: one of :data:`PREFILL_MODES`. stream: whole layers through two E-slot buffers
        (S >= 2E on the scan driver); on_demand: the routed experts through the slot cache; auto: stream
        when it fits and a chunk has at least E (token, expert) pairs (DESIGN.md 1.3).
      prefill_chunk: prompts longer than this many tokens are prefilled in chunks.
      prefill_overlap: copy layer l+1's experts while layer l computes (False: the ablation).
      prefill_driver: one of :data:`PREFILL_DRIVERS`.
      stream_d2d_hits: a streamed call on the pipelined driver copies the experts of a layer that
        sit in the slot cache device to device into the layer's buffer, and only the others over
        PCIe (same bytes, same logits; docs/OVERLAP.md). False: every expert over PCIe.
      prefix_copy: one of :data:`PREFIX_COPIES`: how a prefill call on the pipelined driver copies a
        reused prefix's rows from host memory while earlier layers compute (with ``prefill_overlap``).
      prefix_copy_layers: with ``prefix_copy`` "put": one ``device_put`` copies the rows of this many
        consecutive layers of every chunk, a group ahead (the largest divisor of the layer count not
        above it is used; 1: a put per layer).
      cache_policy: slot eviction policy (``ftjax.experts.slot_table.POLICIES``).
      matmul_precision: one of :data:`MATMUL_PRECISIONS`.
      kernels: the kernel and program choices (``ftjax.kernels.registry.KernelConfig``: which Pallas
        kernels run, their tiles, the decode programs' GEMMs and CUDA graphs); part of every program's key.
      miss: what a miss does (:class:`MissPolicyConfig`).
      decode_block: decode steps per program in :meth:`ftjax.Engine.generate` (the token fed back and the
        stop check on the device, ``ftjax.runtime.step.decode_block``), and the default of the serving
        scheduler's blocks (``ftjax.serve.scheduler.Scheduler``); 1: one program per step and the sampler's
        own program.
      devices: N, devices of this host the routed experts are split over (``expert_split``; docs/MULTI_GPU.md);
        the rest is replicated. 1: one device. N > 1 runs on the layer scan with the fetch miss policy.
      expert_split: one of :data:`EXPERT_SPLITS`, how N > 1 devices split the experts. "expert": each device owns
        E / N experts of every layer (``ftjax.experts.parallel``); N must divide E and, cached / on_demand, S
        (each device a pool of S / N slots and its own slot table). "tensor": each device holds a 1/N piece of
        every expert's FFN width (``ftjax.experts.tensor_parallel``); N must divide F, the banks must be dense,
        and S is the one replicated table's (each device a pool of S pieces).
      prefetch_guesses: G > 0: each layer of a cached decode call (at most ``ftjax.experts.prefetch.MAX_TOKENS``
        tokens) guesses its experts from its input before its token mixer (its router, top G per token) and starts
        copying the guesses not cached, on a GPU on the slot-copy kernel's own stream beside the mixer; its lookup
        then finds them cached (``ftjax.experts.prefetch``; the same logits on the CPU; measured 0.938x the plain
        cached step's tokens/s on an H100 at qwen3.5's 16-layer shape, 2026-12-07: experimental). 0: off. Needs experts
        "cached", the fetch miss policy, one device and the lru cache policy (a guess's lookup is a reference and a
        clock tick: LRU's order is what it should be, other policies' counts and decay would be skewed).
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
    kernels: KernelConfig = KernelConfig()
    miss: MissPolicyConfig = MissPolicyConfig()
    decode_block: int = 16
    devices: int = 1
    expert_split: str = "expert"
    prefetch_guesses: int = 0

    def __post_init__(self):
        _choice("experts mode", self.experts, EXPERT_MODES)
        _choice("prefill mode", self.prefill, PREFILL_MODES)
        _choice("prefill driver", self.prefill_driver, PREFILL_DRIVERS)
        _choice("cache policy", self.cache_policy, CACHE_POLICIES)
        _choice("matmul precision", self.matmul_precision, MATMUL_PRECISIONS)
        _choice("prefix_copy", self.prefix_copy, PREFIX_COPIES)
        _choice("expert split", self.expert_split, EXPERT_SPLITS)
        for name in ("max_seq_len", "batch", "prefill_chunk", "prefix_copy_layers", "decode_block", "devices"):
            _at_least(name, getattr(self, name), 1)
        _boolean("stream_d2d_hits", self.stream_d2d_hits)
        _boolean("prefill_overlap", self.prefill_overlap)
        if not isinstance(self.kernels, KernelConfig):
            raise ValueError(f"kernels must be a KernelConfig, got {type(self.kernels).__name__}")
        if not isinstance(self.miss, MissPolicyConfig):
            raise ValueError(f"miss must be a MissPolicyConfig, got {type(self.miss).__name__}")
        if self.num_slots is not None:
            _at_least("num_slots", self.num_slots, 1)
        _at_least("prefetch_guesses", self.prefetch_guesses, 0)
        if self.prefetch_guesses:
            wrong = [f"{what}, got {got}" for what, got, ok in (
                ("experts 'cached'", repr(self.experts), self.experts == "cached"),
                ("the fetch miss policy", repr(self.miss.policy), self.miss.policy == "fetch"),
                ("one device", f"devices={self.devices}", self.devices == 1),
                ("the lru cache policy", repr(self.cache_policy), self.cache_policy == "lru")) if not ok]
            if wrong:
                raise ValueError(f"prefetch_guesses={self.prefetch_guesses} needs " + "; ".join(wrong))
        if self.experts != "resident" and self.num_slots is None:
            raise ValueError(f"experts mode {self.experts!r} needs num_slots")
        if self.prefill == "stream" and self.experts == "resident":
            raise ValueError("prefill=stream needs an offloading experts mode (cached or on_demand)")
        if self.miss.policy != "fetch" and self.experts == "resident":
            raise ValueError(f"miss policy {self.miss.policy!r} needs experts mode cached or on_demand")
        if self.devices > 1:
            if self.miss.policy != "fetch":
                raise ValueError(f"devices={self.devices}: miss policy {self.miss.policy!r} runs on one device; use "
                                 f"the fetch miss policy or devices=1")
            if self.prefill_driver == "pipelined":
                raise ValueError(f"devices={self.devices} runs on the layer scan; prefill_driver 'pipelined' is "
                                 f"one device's")

    def for_model(self, cfg: ModelConfig) -> "EngineConfig":
        """This config checked against ``cfg``, with resident's slots resolved to L*E.

        Raises:
          ValueError: max_seq_len beyond the model's positions; prefetch_guesses above E; slots outside [E, L*E];
            stream
            without the slots its driver needs; ``devices`` above ``jax.device_count()`` or not dividing E (or S).
        """
        if self.devices > 1:
            check_devices(self.devices, cfg.num_experts, split=self.expert_split, num_ffn=cfg.expert_ffn)
            if self.experts != "resident" and self.expert_split == "expert":
                check_slots(self.num_slots, cfg.num_layers, cfg.num_experts, self.devices)
        if self.max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len {self.max_seq_len} exceeds the model's max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        if self.prefetch_guesses > cfg.num_experts:
            raise ValueError(f"prefetch_guesses={self.prefetch_guesses} exceeds the model's experts per layer "
                             f"E={cfg.num_experts} (top-k is {cfg.top_k})")
        all_slots = cfg.num_layers * cfg.num_experts
        if self.experts == "resident":
            return dataclasses.replace(self, num_slots=all_slots)
        if not cfg.num_experts <= self.num_slots <= all_slots:
            raise ValueError(f"num_slots must be in [E, L*E] = [{cfg.num_experts}, {all_slots}], got {self.num_slots}")
        if self.prefill == "stream" and self.num_slots < 2 * cfg.num_experts and not self.pipelines_streams():
            raise ValueError(f"prefill=stream on the layer scan needs at least 2E={2 * cfg.num_experts} slots (have "
                             f"{self.num_slots}, mode {self.experts}); the pipelined driver needs E "
                             f"(prefill_driver='pipelined'; 'auto' runs float32 on the scan on a GPU: "
                             f"docs/OVERLAP.md)")
        return self

    def for_compute_dtype(self, dtype: str) -> "EngineConfig":
        """This config with ``prefill_driver`` "auto" resolved to "scan" for a float32 compute ``dtype`` on a
        GPU (else unchanged).

        Why: the pipelined driver's per-layer programs are other programs than the layer scan's, and XLA:GPU
        compiles some of their float32 math otherwise: the fp32 hybrid fixture's first logits 2.4e-6 to 6.7e-6 off
        the resident ones on H100s (the same on one machine from process to process, moving with XLA's options
        and from machine to machine; not a race), the scan's bit-identical in every run; 16-bit dtypes
        bit-identical on both (docs/OVERLAP.md, "Float32 on the pipelined driver"). float32 is the oracle's
        dtype, where exactness matters more than prefill speed; ``prefill_driver="pipelined"`` still asks for
        the driver (and streams with E <= S < 2E slots, which the scan cannot).
        """
        if self.prefill_driver != "auto" or dtype != "float32" or memory.backend() != "gpu":
            return self
        return dataclasses.replace(self, prefill_driver="scan")

    def pipelines_streams(self) -> bool:
        """Whether streamed prefill calls run on the layer-pipelined driver (its own two full-layer
        buffers, no borrowed slots): ``prefill_driver`` "pipelined", or "auto" on a GPU (which a float32 engine
        has resolved to "scan" before: :meth:`for_compute_dtype`); never over several devices (``devices`` > 1
        runs on the scan)."""
        if self.devices > 1:
            return False
        return self.prefill_driver == "pipelined" or (self.prefill_driver == "auto" and memory.backend() == "gpu")

    def precision(self, dtype: str) -> str:
        """The matmul precision a step runs with for compute dtype ``dtype``."""
        if self.matmul_precision != "auto":
            return self.matmul_precision
        return "highest" if dtype == "float32" else "default"

    def as_dict(self) -> dict:
        """JSON-ready: every field, the kernel and miss sections as dicts."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["kernels"], d["miss"] = self.kernels.as_dict(), self.miss.as_dict()
        return d


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
