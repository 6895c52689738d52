"""The flags that load a model and build its :class:`~ftjax.Engine`, shared by the absl apps.

``ftjax.generate`` and ``ftjax.serve`` take the same model, expert-cache, quantization, kernel, miss-policy
and KV-offload flags. :func:`define_flags` defines them as flags of the calling app (so that its
``--helpshort`` and the ``flags`` it records list them); the functions below turn their parsed values into
the objects a run needs::

    engine_flags.define_flags()                          # at import, next to the app's own flags
    ...
    engine_flags.check_flags()                           # UserError on a bad value, before any loading
    model = engine_flags.load_model(DEFAULT_CHECKPOINT)
    engine, plan = engine_flags.build_engine(model, max_seq_len, probe_prompts, batch)
    manager = engine_flags.kv_manager()                  # PrefixCache with --kv_offload, else None

The app keeps its own flags (what to generate, where to listen) and ``--max_seq_len``, whose default
each app chooses.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from typing import Any, Callable

from absl import flags

# Flag choices come from the code's own registries (importing them does not start a JAX backend).
from ftjax.config import (CACHE_POLICIES, CPU_DRIVERS, CPU_EXPERT_IMPLS, EXPERT_MODES, EXPERT_SPLITS, KV_LOADS,
                          MATMUL_PRECISIONS, MISS_POLICIES, PREFILL_DRIVERS, PREFILL_MODES, PREFIX_COPIES, EngineConfig,
                          KVOffloadConfig, MissPolicyConfig)
from ftjax import compile_cache
from ftjax.experts import prefetch as prefetch_lib
from ftjax.experts.policies import describe as describe_cache_policies
from ftjax.experts.quant import FORMATS as EXPERT_FORMATS
from ftjax.kernels.registry import (DECODE_GEMMS, DECODE_GRAPHS, DECODE_LOOPS, FLASH_PREFILLS, GROUPED_MATMULS,
                                    MAX_PREFETCH_BLOCKS, MISS_COPIES, PREFETCH_BLOCKS, SLOT_ORDERS, USES,
                                    KernelConfig)

FLAGS = flags.FLAGS
#: ``--miss_copy``'s help (here and in the experiments' kernel flags, ``experiments/common.py``).
MISS_COPY_HELP = ("How a layer's cache misses reach their slots: kernel = one CUDA kernel reads every miss from the "
                  "pinned host bank straight into its slot (a GPU with nvcc; ftjax.experts.slot_copy), xla = XLA's "
                  "loop of host reads and slot writes (--fetch_group per iteration), auto = the kernel on one GPU "
                  "where it builds and the banks are whole, else xla (on a GPU with a warning that says why). The "
                  "same pools either way (KernelConfig.miss_copy; docs/PROFILE.md).")
#: ``--prefetch_blocks``' help (here and in the experiments' kernel flags).
PREFETCH_BLOCKS_HELP = (f"On a GPU with --prefetch_guesses > 0 (no effect otherwise): thread blocks per miss of the "
                        f"prefetch's copies on the slot-copy kernel's own stream; unset means {PREFETCH_BLOCKS} (few, "
                        f"so the token mixer's kernels keep their SMs while the copies run; more copy a lone miss "
                        f"faster). The same pools either way (KernelConfig.prefetch_blocks).")

# The default demo: the trained model (experiments/train_moe.py).
DEFAULT_CHECKPOINT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "stdlib_moe")


class UserError(Exception):
    """Bad input: printed as one line, exit status 1."""


class _Definer:
    """``flags.DEFINE_*`` with ``module_name`` and ``flag_values`` filled in. A flag already defined
    (another app of this process defined the shared flags first) is not defined again: it becomes a key
    flag of this module too."""

    def __init__(self, module_name: str, flag_values: flags.FlagValues):
        self.module_name, self.flag_values = module_name, flag_values

    def __getattr__(self, attr: str):
        define = getattr(flags, attr)

        def call(name, *args, **kwargs):
            if name in self.flag_values:
                self.flag_values.register_key_flag_for_module(self.module_name, self.flag_values[name])
                return None
            return define(name, *args, flag_values=self.flag_values, module_name=self.module_name, **kwargs)
        return call


def _caller_module(depth: int) -> str:
    """absl's name of the module ``depth`` frames up (a module run as ``__main__`` is keyed by argv[0])."""
    name = sys._getframe(depth + 1).f_globals.get("__name__", "")
    return sys.argv[0] if name == "__main__" else name


#: The flags :func:`define_flags` defines.
FLAG_NAMES = ("checkpoint", "preset", "seed", "dtype", "expert_dtype", "experts", "expert_slots", "cache_policy",
              "vram_budget_gb", "progress", "prefill", "prefill_chunk", "prefill_driver", "prefill_overlap",
              "stream_d2d_hits", "prefix_copy", "prefix_copy_layers", "kv_offload", "kv_host_gb", "kv_chunk_tokens",
              "kv_load", "miss_policy", "cpu_expert_impl", "cpu_threads", "cpu_miss_driver", "calibration_profile",
              "matmul_precision", "decode_gemm", "decode_graphs", "decode_loop", "kernels", "kernel_tiles",
              "grouped_matmul", "flash_prefill", "slot_order", "min_dot_rows", "fetch_group", "miss_copy",
              "prefetch_blocks", "fixed_fetch", "decode_block", "devices", "expert_split", "prefetch_guesses",
              "compilation_cache_dir")


def define_flags(flag_values: flags.FlagValues = FLAGS, module_name: str | None = None) -> None:
    """Defines the model, expert, cache, quantization, kernel, miss-policy and KV-offload flags
    (:data:`FLAG_NAMES`) in ``flag_values`` as flags of ``module_name`` (default: the calling module).
    Raises:
      absl.flags.Error: a flag of another definition with one of these names."""
    d = _Definer(module_name or _caller_module(1), flag_values)
    d.DEFINE_string("checkpoint", None, "HF checkpoint directory (config.json + safetensors). "
                    "Absent: the trained demo model ftjax/assets/stdlib_moe if present, else random "
                    "weights at preset 'tiny'.")
    d.DEFINE_string("preset", None, "Random weights at a preset's real shape instead of a checkpoint "
                    "(qwen3-30b-a3b, olmoe-1b-7b, mixtral-8x7b, qwen3.5-35b-a3b, tiny, tiny-hybrid).")
    d.DEFINE_integer("seed", 0, "Seed of random weights (--preset, or the tiny fallback); "
                     "ftjax.generate also samples with it.")
    d.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"], "Compute dtype; default the checkpoint's.")
    d.DEFINE_enum("expert_dtype", None, list(EXPERT_FORMATS),
                  "Storage format of the routed experts (host banks and slot pools), quantized after loading by "
                  "round to nearest: bfloat16, int8 (per output channel), int4 (groups of 64 inputs, packed), fp8 "
                  "(e4m3, 128x128 blocks); docs/QUANTIZATION.md. Default: the compute dtype, or fp8 for an fp8 "
                  "checkpoint (whose experts load as they are).")
    d.DEFINE_enum("experts", "auto", ["auto", *EXPERT_MODES],
                  "Where experts live: auto = resident if the pool fits the budget, else cached.")
    d.DEFINE_integer("expert_slots", None, "Device expert slots S (E <= S <= L*E).")
    d.DEFINE_enum("cache_policy", "lru", list(CACHE_POLICIES),
                  "Slot eviction policy (ftjax/experts/policies/, one module each): " + describe_cache_policies())
    d.DEFINE_float("vram_budget_gb", None, "Device memory budget in GB (1e9 bytes) to plan slots from: weights, KV "
                   "cache, the activation workspace (measured on the compiled steps before the run) and the prefill's "
                   "layer buffers come first. Under --prefill_driver=auto and --prefill=auto, a budget where the "
                   "pipelined driver's two full-layer buffers would leave fewer than E slots is run on the scan "
                   "driver (the printed plan says so); a budget too small for the scan's plan, or for "
                   "--prefill_driver=pipelined, is refused with the minimum budget.")
    d.DEFINE_boolean("progress", True, "Show a progress bar while loading.")
    d.DEFINE_enum("prefill", "auto", list(PREFILL_MODES),
                  "Prefill expert loading: stream whole layers through two full-layer buffers (on the scan "
                  "driver: 2E borrowed slots; on the pipelined driver: two buffers of its own), "
                  "only the routed experts through the cache, or auto (stream when it fits and pays).")
    d.DEFINE_integer("prefill_chunk", 8192, "Prompts longer than this many tokens are prefilled in chunks.")
    d.DEFINE_integer("decode_block", 16, "Decode steps per program (the token fed back and the stop check on the "
                     "device, so the host dispatches once per block): in ftjax.generate, and in ftjax.serve's "
                     "scheduler while no request prefills (tokens stream in bursts of up to this many; a new request "
                     "waits up to one block); 1: one program per step. The same tokens either way.")
    d.DEFINE_enum("prefill_driver", "auto", list(PREFILL_DRIVERS),
                  "How prefill calls run their layers: one scan program, or one program per layer with the next "
                  "layer's host copies issued from Python, so that they run while the current layer computes "
                  "(auto: pipelined on a GPU for streamed calls and for calls that reuse a prefix from host memory "
                  "with --kv_offload, the scan everywhere else and for a float32 compute dtype, where the pipelined "
                  "driver's logits were measured a few 1e-6 off the resident model's on a GPU; docs/OVERLAP.md).")
    d.DEFINE_boolean("prefill_overlap", True, "Copy layer l+1's experts while layer l computes; "
                     "--noprefill_overlap (alias --no_prefill_overlap) is the serial ablation.")
    d.DEFINE_boolean("stream_d2d_hits", True, "A streamed prefill layer on the pipelined driver copies its experts "
                     "that sit in the slot cache device to device and only the others over PCIe (same logits); "
                     "--nostream_d2d_hits copies every expert over PCIe.")
    d.DEFINE_enum("prefix_copy", "put", list(PREFIX_COPIES),
                  "How a prefill call on the pipelined driver copies a reused prefix's next layer to the device "
                  "(--kv_offload): put = one device_put from Python of the chunks' rows of --prefix_copy_layers "
                  "layers, a group ahead; in_program = each layer's program copies the next layer's slices itself "
                  "(slower on the H200) (EngineConfig.prefix_copy; docs/OVERLAP.md).")
    d.DEFINE_integer("prefix_copy_layers", 4, "With --prefix_copy=put: layers whose prefix rows one device_put moves, "
                     "a group ahead (the largest divisor of the layer count not above it; "
                     "EngineConfig.prefix_copy_layers).", lower_bound=1)
    d.DEFINE_boolean("kv_offload", False, "Keep full chunks of prompt KV in host memory and reuse a stored "
                     "prefix (layerwise load in the prefill scan).")
    d.DEFINE_float("kv_host_gb", 4.0, "Host memory for stored KV chunks, in GB (1e9 bytes).")
    d.DEFINE_integer("kv_chunk_tokens", 256, "Tokens per stored KV chunk.")
    d.DEFINE_enum("kv_load", "prefetch", list(KV_LOADS),
                  "How a reused prefix reaches the device: in the scan with the next layer prefetched, "
                  "in the scan as scan xs, or all layers before the prefill (ablation).")
    d.DEFINE_enum("miss_policy", "fetch", list(MISS_POLICIES),
                  "Expert-cache misses: copy them to the device (fetch), compute them on the host CPU (cpu), "
                  "or split each layer's misses by the calibrated cost model (adaptive: q* with fixed costs and the "
                  "measured overlap; docs/MISS_POLICY.md). DESIGN.md 1.2.")
    d.DEFINE_enum("cpu_expert_impl", "callback_async", list(CPU_EXPERT_IMPLS),
                  "How misses are computed on the CPU (ftjax.experts.cpu_experts; native_async: a C/OpenMP kernel "
                  "built on first use with cc or gcc, cached in ~/.cache/ftjax/native or $FTJAX_NATIVE_CACHE; "
                  "docs/MISS_POLICY.md).")
    d.DEFINE_enum("cpu_miss_driver", "callback", list(CPU_DRIVERS),
                  "How a decode step reaches the CPU's share of its misses: callback = one program per step, the host "
                  "kernel called through io_callback in every layer; host = the step runs layer by layer from "
                  "Python and calls the host kernel between a layer's programs, no callback (ftjax.runtime."
                  "host_split; a callback mechanism's kernel; docs/MISS_POLICY.md).")
    d.DEFINE_integer("cpu_threads", 0, "Host-kernel threads of the callback mechanisms; 0 = the profile's, or "
                     "half the cores (callback, callback_async) or every core (numpy_rows_async, native_async).")
    d.DEFINE_string("calibration_profile", None, "Calibration profile JSON (ftjax.calibrate); default "
                    "~/.cache/ftjax/calibration.json. Adaptive calibrates quickly and adds to it when missing.")
    d.DEFINE_enum("matmul_precision", "auto", list(MATMUL_PRECISIONS),
                  "Precision of the step's matmuls: auto = full float32 ('highest') for --dtype=float32, as the "
                  "float32 oracle needs on a GPU (where float32 dots otherwise run as TF32), and the backend's fast "
                  "default for 16-bit dtypes.")
    d.DEFINE_enum("decode_gemm", "auto", list(DECODE_GEMMS),
                  "GEMMs of the decode programs on a GPU: xla = XLA's Triton GEMM fusions (they copy each layer's "
                  "weight slices first); cublas = cuBLAS reading them in place, dot merger off; auto = cublas on a "
                  "GPU in bf16/fp16 (KernelConfig.decode_gemm; docs/PROFILE.md).")
    d.DEFINE_enum("decode_graphs", "auto", list(DECODE_GRAPHS),
                  "Decode programs on a GPU as CUDA graphs whose loops stay on the device (XLA command buffers "
                  "with WHILE and CONDITIONAL): on, off, or auto = on for --experts cached/on_demand when a step "
                  "fetches every miss (its miss copies loop a data-dependent number of times; not with CPU experts) "
                  "(KernelConfig.decode_graphs; docs/PROFILE.md).")
    d.DEFINE_enum("decode_loop", "auto", list(DECODE_LOOPS),
                  "How the loop of a generate's decode block ends: fixed = it runs --decode_block iterations, those "
                  "past the last step or after every row stopped with every row idle (no predicate read back to the "
                  "host each step; a shorter last block or an EOS costs the rest of the block); dynamic = it stops "
                  "there; auto = on a GPU, fixed for the full blocks of a generate without EOS ids, else dynamic. "
                  "The server's blocks always stop there (KernelConfig.decode_loop).")
    d.DEFINE_string("kernels", "auto", "Pallas kernels to run: auto (each where it applies and was measured faster: "
                    "on a GPU), xla (the plain-JAX references everywhere), interpret (every kernel in Pallas interpret "
                    "mode), a comma list of kernel names (ftjax.kernels.registry; a kernel asked for by name that "
                    "applies to no program is reported), or auto with kernels added or taken away, e.g. "
                    "auto+gated_deltanet_decode or auto-grouped_swiglu_triton.")
    d.DEFINE_list("kernel_tiles", [], "Tile overrides, name:ints with the ints separated by '/', e.g. "
                  "dense_decode:64/128/0/0,moe_decode:64/64/0/0 (KernelConfig.tiles).")
    d.DEFINE_enum("grouped_matmul", "auto", list(GROUPED_MATMULS), "The prefill expert matmul: on a GPU the "
                  "grouped_matmul_triton kernel where --kernels selects it (auto: 256 experts or more), else the "
                  "Mosaic GPU kernel where it runs (auto); the Mosaic kernel always (mgpu); or ragged_dot (xla).")
    d.DEFINE_enum("flash_prefill", "auto", list(FLASH_PREFILLS), "Flash attention of prefill, where --kernels "
                  "selects flash_prefill (auto: on a GPU): jax's Mosaic GPU attention for calls starting at 0 on a "
                  "Hopper GPU and the Pallas kernel for the others (auto), the Pallas kernel always (pallas), or the "
                  "Mosaic kernel and the jnp attention elsewhere (mgpu).")
    d.DEFINE_enum("slot_order", "auto", list(SLOT_ORDERS), "How the slot table finds the slots misses take (every "
                  "one gives the same table; auto: rank on an accelerator, sort on the CPU).")
    d.DEFINE_integer("min_dot_rows", None, "Rows a one-row dense projection is padded to (default 4 on a GPU, 0 "
                     "elsewhere).", lower_bound=0)
    d.DEFINE_integer("fetch_group", None, "The most cache misses copied per iteration of a layer's miss loop, all "
                     "their host reads issued before their slot writes (unset: 1; larger groups measured no faster "
                     "on an H200; the same pools either way; KernelConfig.fetch_group; "
                     "experiments/bench_miss_copy.py).", lower_bound=1)
    d.DEFINE_enum("miss_copy", "auto", list(MISS_COPIES), MISS_COPY_HELP)
    d.DEFINE_integer("prefetch_blocks", None, PREFETCH_BLOCKS_HELP, lower_bound=1, upper_bound=MAX_PREFETCH_BLOCKS)
    d.DEFINE_integer("fixed_fetch", None, "Adaptive: fetch min(N, misses) per layer instead of the calibrated split.")
    d.DEFINE_integer("devices", 1, "Devices of this host to split the routed experts over, as --expert_split says; "
                     "each copies its own misses over its own link; weights and KV cache replicated "
                     "(docs/MULTI_GPU.md). --vram_budget_gb is then each device's budget.", lower_bound=1)
    d.DEFINE_enum("expert_split", "expert", list(EXPERT_SPLITS), "How --devices > 1 split the experts: expert (each "
                  "device owns E/N experts of every layer, its own slot pool of S/N slots and slot table; N must "
                  "divide E and --expert_slots) or tensor (each device holds 1/N of every expert's FFN width, one "
                  "slot table replicated on all: balanced links, one device's hit rate; N must divide F; dense "
                  "experts only).")
    d.DEFINE_integer("prefetch_guesses", 0, "Experimental, 0 = off: each cached layer guesses this many experts per "
                     "token from its input (its router) and starts copying the guesses not cached before its token "
                     "mixer runs, on a GPU on the slot-copy kernel's own stream. Applies to cached calls of at most 16 "
                     "tokens, rows x padded tokens (decode steps of up to 16 rows, short prefills), on one device, "
                     "with --miss_policy=fetch and --cache_policy=lru. Measured slower: 0.94-0.95x the plain cached "
                     "tokens/s on an H100 at 2. Exact on the CPU, but not on every GPU: at the 16-layer qwen3.5 "
                     "shape its bf16 tokens left the resident ones at step 34 on some H100s, where plain cached kept "
                     "them. A copied guess counts as a miss even when right; the metrics' prefetch_copies, "
                     "prefetch_used, routed_hit_rate and lookup_hit_rate count the prefetch apart "
                     "(EngineConfig.prefetch_guesses; docs/PROFILE.md \"Open\").",
                     lower_bound=0)
    d.DEFINE_string("compilation_cache_dir", None, compile_cache.FLAG_HELP)


def _default_checkpoint(default: str | None) -> str | None:
    """``default`` when no --checkpoint / --preset is given and it holds a config.json, else None."""
    if FLAGS.checkpoint or FLAGS.preset or not default or not os.path.isfile(os.path.join(default, "config.json")):
        return None
    return default


def load_model(default_checkpoint: str | None = DEFAULT_CHECKPOINT, program: str = "ftjax"):
    """The model the flags name: --checkpoint, else --preset's random weights, else ``default_checkpoint``
    when it exists, else random weights at preset 'tiny'; experts stored as --expert_dtype says. Shows a
    progress bar with --progress. What the checkpoint has that is ignored (``CheckpointWarning``, e.g. an
    EOS id outside the vocabulary) is printed to stderr as one ``{program}: warning: ...`` line each.
    Raises:
      UserError: both --checkpoint and --preset; CheckpointError, ConfigError: a bad checkpoint or preset."""
    import warnings

    from ftjax.checkpoint import CheckpointWarning, load_checkpoint, random_model
    from ftjax.config import preset
    if FLAGS.checkpoint and FLAGS.preset:
        raise UserError("give --checkpoint or --preset, not both")
    ckpt = FLAGS.checkpoint or _default_checkpoint(default_checkpoint)
    if ckpt:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CheckpointWarning)
            model = load_checkpoint(ckpt, FLAGS.dtype, progress=FLAGS.progress, expert_dtype=FLAGS.expert_dtype)
        for w in caught:
            if issubclass(w.category, CheckpointWarning):
                print(f"{program}: warning: {w.message}", file=sys.stderr)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return model
    model = random_model(preset(FLAGS.preset or "tiny"), FLAGS.dtype, seed=FLAGS.seed)
    if FLAGS.expert_dtype is not None:
        from ftjax.experts.quant import quantize_banks
        model.banks = quantize_banks(model.banks, FLAGS.expert_dtype)
    return model


def check_flags() -> None:
    """Rejects values of these flags that would fail late or silently (call it before loading anything).
    Raises:
      UserError: a budget or host size that is not a finite number >= 0, a seed outside [0, 2^32), a size
        below 1, both --expert_slots and --vram_budget_gb, --fixed_fetch without --miss_policy=adaptive or
        below 0, --devices > 1 with --kv_offload, a cpu / adaptive miss policy or the pipelined prefill driver,
        --expert_split=tensor with a quantized --expert_dtype, kernel flags KernelConfig refuses."""
    for name in ("vram_budget_gb", "kv_host_gb"):
        v = FLAGS[name].value
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise UserError(f"--{name} must be a finite number >= 0, got {v}")
    if not 0 <= FLAGS.seed < 2**32:
        raise UserError(f"--seed must be in [0, 2^32), got {FLAGS.seed}")
    for name in ("expert_slots", "prefill_chunk", "kv_chunk_tokens", "decode_block"):
        v = FLAGS[name].value
        if v is not None and v < 1:
            least = "at least E, the model's experts per layer" if name == "expert_slots" else ">= 1"
            raise UserError(f"--{name} must be {least}, got {v}")
    if FLAGS.expert_slots is not None and FLAGS.vram_budget_gb is not None:
        raise UserError("give --expert_slots or --vram_budget_gb, not both")
    try:  # an unknown kernel, one named without the kernel it needs, a bad tile: refused before the model loads
        kernel_config()
    except ValueError as e:
        raise UserError(str(e)) from None
    if FLAGS.fixed_fetch is not None and (FLAGS.miss_policy != "adaptive" or FLAGS.fixed_fetch < 0):
        raise UserError("--fixed_fetch needs --miss_policy=adaptive and a value >= 0")
    if FLAGS.devices > 1:
        for name, bad in (("kv_offload", FLAGS.kv_offload), ("miss_policy", FLAGS.miss_policy != "fetch"),
                          ("prefill_driver", FLAGS.prefill_driver == "pipelined")):
            if bad:
                raise UserError(f"--devices={FLAGS.devices} runs the fetch miss policy on the layer scan without KV "
                                f"offload; --{name}={FLAGS[name].value} is one device's (use --devices=1)")
        if FLAGS.expert_split == "tensor" and FLAGS.expert_dtype not in (None, "bfloat16"):
            raise UserError(f"--expert_split=tensor splits dense experts only; --expert_dtype={FLAGS.expert_dtype} "
                            f"is quantized (use --expert_split=expert)")


def kernel_config() -> KernelConfig:
    """The run's KernelConfig from the kernel flags.
    Raises:
      UserError: a malformed --kernel_tiles entry, a choice the KernelConfig refuses (the message names the
        flag), or --miss_copy=kernel where the slot-copy kernel cannot run (the message says why)."""
    tiles = {}
    for entry in FLAGS.kernel_tiles:
        name, _, ints = entry.partition(":")
        try:
            tiles[name.strip()] = tuple(int(v) for v in ints.split("/"))
        except ValueError:
            raise UserError(f"--kernel_tiles entry {entry!r}: expected name:int/int/...") from None
    try:
        config = KernelConfig(use=FLAGS.kernels, tiles=tiles, grouped_matmul=FLAGS.grouped_matmul,
                              flash_prefill=FLAGS.flash_prefill, slot_order=FLAGS.slot_order,
                              min_dot_rows=FLAGS.min_dot_rows, decode_gemm=FLAGS.decode_gemm,
                              decode_graphs=FLAGS.decode_graphs, fetch_group=FLAGS.fetch_group,
                              decode_loop=FLAGS.decode_loop, miss_copy=FLAGS.miss_copy,
                              prefetch_blocks=FLAGS.prefetch_blocks)
    except ValueError as err:  # the config's message names its field: name the flag instead
        msg = re.sub(r"KernelConfig\.(\w+)", lambda m: "--" + _FLAG_OF_KERNEL_FIELD.get(m[1], m[1]), str(err))
        if msg.startswith("--kernels: unknown kernel"):
            msg += f" (or one of {', '.join(USES)})"
        raise UserError(msg) from None
    if FLAGS.miss_copy == "kernel":  # asked for by name: refused here, not deep inside the first trace
        from ftjax.experts import slot_copy
        why = slot_copy.unavailable()
        if why is not None:
            raise UserError(f"--miss_copy=kernel: {why}; use --miss_copy=auto or xla")
    return config


#: The kernel flags whose names differ from their ``KernelConfig`` fields.
_FLAG_OF_KERNEL_FIELD = {"use": "kernels", "tiles": "kernel_tiles"}


def miss_config(mode: str) -> MissPolicyConfig:
    """The run's MissPolicyConfig from the flags (a resident run has no misses: the policy is then
    fetch, with a note)."""
    if FLAGS.miss_policy != "fetch" and mode == "resident":
        print(f"note: all experts are resident, so there are no misses; --miss_policy={FLAGS.miss_policy} ignored")
        return MissPolicyConfig()
    if FLAGS.miss_policy != "fetch" and FLAGS.cpu_miss_driver == "host" and FLAGS["decode_block"].present \
            and FLAGS.decode_block > 1:
        print(f"note: --cpu_miss_driver=host decodes a step per call whose split uses the CPU (one host step per "
              f"layer), so --decode_block={FLAGS.decode_block} applies only where every miss is fetched")
    if FLAGS.miss_policy == "fetch" and any(FLAGS[name].present for name in ("cpu_expert_impl", "cpu_threads",
                                                                              "cpu_miss_driver")):
        print("note: --miss_policy=fetch copies every miss, so --cpu_expert_impl / --cpu_threads / --cpu_miss_driver "
              "are ignored (they take effect with --miss_policy=cpu or adaptive)")
    return MissPolicyConfig(FLAGS.miss_policy, FLAGS.cpu_expert_impl, FLAGS.cpu_threads, FLAGS.fixed_fetch,
                            calibration_profile=FLAGS.calibration_profile,
                            cpu_driver=FLAGS.cpu_miss_driver if FLAGS.miss_policy != "fetch" else "callback")


def engine_config(mode: str, slots: int | None, max_seq_len: int, batch: int, note: bool = True) -> EngineConfig:
    """The run's EngineConfig from the flags, for ``batch`` rows of ``max_seq_len`` tokens (a resident run has
    nothing to stream: --prefill=stream then prefills as auto does, with a note; --prefetch_guesses applies to the
    cached mode only, with a note elsewhere). ``note`` False: the planner's base config (no notes, the fetch miss
    policy, no prefetch: the plan may pick another mode)."""
    prefill = FLAGS.prefill
    if mode == "resident" and prefill == "stream":
        if note:
            print("note: all experts are resident, so there is nothing to stream; --prefill=stream ignored")
        prefill = "auto"
    prefetch = FLAGS.prefetch_guesses if note and mode == "cached" else 0
    if note and FLAGS.prefetch_guesses and mode != "cached":
        print(f"note: the experts run {mode}, not cached; --prefetch_guesses={FLAGS.prefetch_guesses} ignored")
    elif prefetch and batch > prefetch_lib.MAX_TOKENS:
        print(f"note: a decode step of {batch} rows has more than the prefetch's {prefetch_lib.MAX_TOKENS} tokens, "
              f"so decode runs without it (--prefetch_guesses={prefetch} applies to calls of at most "
              f"{prefetch_lib.MAX_TOKENS} tokens, rows x padded tokens)")
    if note and FLAGS.prefetch_blocks is not None and not prefetch:
        print(f"note: no prefetch runs (--prefetch_guesses={FLAGS.prefetch_guesses}, experts {mode}); "
              f"--prefetch_blocks={FLAGS.prefetch_blocks} ignored")
    return EngineConfig(mode, num_slots=slots, max_seq_len=max_seq_len, batch=batch, prefill=prefill,
                        prefill_chunk=FLAGS.prefill_chunk, prefill_overlap=FLAGS.prefill_overlap,
                        prefill_driver=FLAGS.prefill_driver, stream_d2d_hits=FLAGS.stream_d2d_hits,
                        prefix_copy=FLAGS.prefix_copy, prefix_copy_layers=FLAGS.prefix_copy_layers,
                        cache_policy=FLAGS.cache_policy, matmul_precision=FLAGS.matmul_precision,
                        kernels=kernel_config(), miss=miss_config(mode) if note else MissPolicyConfig(),
                        decode_block=FLAGS.decode_block, devices=FLAGS.devices, expert_split=FLAGS.expert_split,
                        prefetch_guesses=prefetch)


def plan(model, max_seq_len: int, prompts: list[list[int]], batch: int):
    """Chooses the experts mode and slot count (``ftjax.runtime.planner.plan_run``); returns (the planned
    EngineConfig, plan or None): its ``experts``, ``num_slots`` and ``prefill_driver`` (the planner's choice
    under --prefill_driver=auto, when the pipelined driver's buffers do not fit the budget) are the run's.
    With --vram_budget_gb the workspace is measured on the compiled steps of these ``prompts``, so
    that the plan is never below the run's peak. Without a budget or slots, a checkpoint runs resident and
    the demo or a preset keeps a cache of 2E slots, smaller than its pool, so that the mechanism shows.
    Raises:
      UserError: both --expert_slots and --vram_budget_gb; ValueError: a budget that does not fit."""
    from ftjax.runtime.planner import GB, plan_run
    cfg = model.cfg
    if FLAGS.expert_slots is not None and FLAGS.vram_budget_gb is not None:
        raise UserError("give --expert_slots or --vram_budget_gb, not both")
    mode, slots = FLAGS.experts, FLAGS.expert_slots
    if mode == "resident" and slots is not None:
        print(f"note: --experts=resident keeps all {cfg.num_layers * cfg.num_experts} experts on the device; "
              f"--expert_slots={slots} ignored")
        slots = None
    if slots is None and FLAGS.vram_budget_gb is None and not (mode == "resident" or
                                                                (mode == "auto" and FLAGS.checkpoint)):
        slots = min(2 * cfg.num_experts, cfg.num_layers * cfg.num_experts)
    budget = int(FLAGS.vram_budget_gb * GB) if FLAGS.vram_budget_gb is not None else None
    base = engine_config("cached", min(2 * cfg.num_experts, cfg.num_layers * cfg.num_experts), max_seq_len, batch,
                         note=False)
    return plan_run(model, base, prompts, budget_bytes=budget, slots=slots, mode=mode)


def describe_miss(miss, max_misses: int) -> None:
    """Prints the miss policy, and where its calibration came from."""
    from ftjax import calibrate
    cal = miss.calibration
    if cal is not None:
        fresh = " (calibrated now)" if cal["calibrated_now"] else ""
        print(f"calibration profile: {cal['path']} [{cal['key']}]{fresh}")
        if not cal["calibrated_now"]:  # the mechanism's entry: "<impl>@host" under the host-split driver
            impl = cal["impl"]
            print(calibrate.describe_impl(impl, cal["entry"]["impls"][impl]))
    print(miss.describe(max_misses))


def build_engine(model, max_seq_len: int, probe_prompts: list[list[int]], batch: int):
    """The run's Engine: plans the experts mode and slots (:func:`plan`, measured on ``probe_prompts``
    with --vram_budget_gb), prints the model, the memory plan and the miss policy, and builds the engine
    for ``batch`` rows of ``max_seq_len`` tokens. Returns (engine, memory plan or None).
    Raises:
      UserError, ValueError: flags that do not fit the model or the budget."""
    from ftjax import Engine
    cfg = model.cfg
    planned, memory_plan = plan(model, max_seq_len, probe_prompts, batch)
    mode = planned.experts
    print(f"model: {model.name} ({cfg.model_type}, L={cfg.num_layers}, E={cfg.num_experts}, "
          f"top-k={cfg.top_k}, {model.dtype}); experts: {mode}, stored {model.banks.fmt} "
          f"({model.banks.gate_up.dtype}, {model.expert_bytes / 1e6:.3f} MB per expert)")
    if memory_plan is not None:
        print(memory_plan.describe())
    slots = memory_plan.total_slots if memory_plan and mode != "resident" else None
    config = engine_config(mode, slots, max_seq_len, batch)
    if config.prefill_driver != planned.prefill_driver:  # the planner's choice: the run is the one it planned
        config = dataclasses.replace(config, prefill_driver=planned.prefill_driver)
    engine = Engine(model, config)
    if engine.miss.policy != "fetch":
        describe_miss(engine.miss, min(cfg.num_experts, batch * cfg.top_k))
    return engine, memory_plan


def kv_manager():
    """With --kv_offload, the prefix cache (``ftjax.kv.prefix_cache.PrefixCache``) over a host KV store of
    --kv_host_gb holding chunks of --kv_chunk_tokens; None without."""
    if not FLAGS.kv_offload:
        return None
    from ftjax.kv.host_store import HostKVStore
    from ftjax.kv.prefix_cache import PrefixCache
    from ftjax.runtime.planner import GB
    c = FLAGS.kv_chunk_tokens
    return PrefixCache(HostKVStore(int(FLAGS.kv_host_gb * GB)),
                       KVOffloadConfig(chunk_tokens=c, load=FLAGS.kv_load,
                                       prefill_chunk=max(c, FLAGS.prefill_chunk // c * c)))


def run_command(program: str, argv: list[str], body: Callable[[], Any]) -> Any:
    """The shared ``main`` of the command lines (``ftjax.generate``, ``ftjax.serve``): refuses stray
    arguments in one line (not absl's whole usage text), quiets absl's INFO notes, switches JAX's CPU
    client to synchronous dispatch when host-callback misses need it (before JAX starts), turns on JAX's
    persistent compilation cache as --compilation_cache_dir says (``ftjax.compile_cache.configure``), then
    runs ``body``. Bad input (UserError, ConfigError, CheckpointError, ValueError, OSError, HostViewError,
    NativeBuildError: no C compiler for ``--cpu_expert_impl=native_async``) is printed as
    ``{program}: error: ...`` with exit status 1. Returns what ``body`` returns."""
    from absl import logging

    if len(argv) > 1:
        print(f"{program}: error: unexpected arguments: {' '.join(argv[1:])} (flags take the form "
              "--name=value; --helpshort lists them)", file=sys.stderr)
        sys.exit(1)
    if logging.get_verbosity() == logging.INFO:  # absl's default: hide JAX's backend probing notes
        logging.set_verbosity(logging.WARNING)
    from ftjax.experts.cpu_experts import CALLBACK_IMPLS, HostViewError, use_sync_cpu_dispatch
    from ftjax.experts.cpu_native import NativeBuildError
    if FLAGS.miss_policy != "fetch" and FLAGS.cpu_expert_impl in CALLBACK_IMPLS and FLAGS.cpu_miss_driver == "callback":
        use_sync_cpu_dispatch()  # before JAX starts; the callbacks deadlock on an async CPU client
    compile_cache.configure(FLAGS.compilation_cache_dir)
    from ftjax.checkpoint import CheckpointError
    from ftjax.config import ConfigError
    try:
        return body()
    except (UserError, ConfigError, CheckpointError, ValueError, OSError, HostViewError, NativeBuildError) as e:
        print(f"{program}: error: {e}", file=sys.stderr)
        sys.exit(1)


def alias_no_flags(argv: list[str]) -> list[str]:
    """Accepts the spelling --no_prefill_overlap for absl's --noprefill_overlap."""
    return ["--noprefill_overlap" if a == "--no_prefill_overlap" else a for a in argv]
