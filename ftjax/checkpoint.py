"""Hugging Face safetensors checkpoints -> ftjax params and host expert banks.

Non-expert weights go to the device in the compute dtype. Routed-expert weights are stacked into
two banks indexed by ``flat_id = layer * E + expert`` and placed in host memory (``pinned_host``
where the backend has it); they never exist whole on the accelerator:

  gate_up [L*E, D, 2F]   (gate_proj.T | up_proj.T)
  down    [L*E, F, D]    (down_proj.T)

Also builds random weights at a preset's shape directly in host memory (for benchmarks).

Quantized experts (``ftjax.experts.quant``): ``expert_dtype`` quantizes the banks after loading;
an fp8 block-wise checkpoint (``quantization_config.quant_method == "fp8"``, the layout of the
official fp8 Qwen3 MoE checkpoints: ``*.weight`` float8_e4m3fn + ``*.weight_scale_inv`` float32
[ceil(out/128), ceil(in/128)]) loads its experts as they are into fp8 banks, so no bf16 copy of
the experts ever exists; its other quantized weights are dequantized to the compute dtype.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import math
import os
import struct
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from tqdm.auto import tqdm

from ftjax import families, memory
from ftjax import model as model_lib
from ftjax.config import ModelConfig
from ftjax.experts import formats, quant
from ftjax.experts.formats import fp8 as fp8_format
from ftjax.experts.state import ExpertBanks
from ftjax.families import load_hf_config
from ftjax.sampling import SamplingDefaults

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing/unreadable file, missing tensor, bad shape."""


class CheckpointWarning(UserWarning):
    """Something in a checkpoint that is ignored rather than refused (an EOS id outside the vocabulary)."""


@dataclasses.dataclass
class LoadedModel:
    """A model ready to run.

    cfg: the config; params: device pytree (see ``ftjax.model``); banks: the routed-expert
    banks in host memory (``ExpertBanks``: gate_up [L*E, D, 2F], down [L*E, F, D]); dtype: compute dtype name;
    tokenizer: a ``tokenizers.Tokenizer`` or None; name: where it came from (a path: display only);
    eos_token_ids: end-of-sequence ids (:func:`eos_token_ids`; () for random weights: no EOS);
    fingerprint: a string naming the weights' content, which keys stored KV chunks
    (``PrefixCache.identity``): :class:`TensorHasher`'s digest of the tensors as a checkpoint was
    read, or the generator, seed and config of random weights. "" (a model built by hand): computed
    from the arrays on first use (:func:`model_fingerprint`). ``dataclasses.replace`` keeps it, so a
    copy given other weights must be given another fingerprint (or "").
    sampling_defaults: the checkpoint's sampling defaults (:func:`sampling_defaults`; none for random
    weights: greedy unless a request says otherwise).
    """

    cfg: ModelConfig
    params: dict[str, Any]
    banks: ExpertBanks
    dtype: str
    tokenizer: Any = None
    name: str = ""
    eos_token_ids: tuple[int, ...] = ()
    fingerprint: str = ""
    sampling_defaults: SamplingDefaults = SamplingDefaults()

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert as stored in the banks: what one H2D copy moves."""
        return self.banks.expert_bytes

    @property
    def host_gate_up(self) -> jax.Array:
        """The gate/up bank [L*E, D, 2F] (``banks.gate_up``)."""
        return self.banks.gate_up

    @property
    def host_down(self) -> jax.Array:
        """The down bank [L*E, F, D] (``banks.down``)."""
        return self.banks.down


class _TensorIndex:
    """Finds tensors across a single ``model.safetensors`` or a sharded checkpoint."""

    def __init__(self, ckpt_dir: str, hasher: "TensorHasher | None" = None):
        self.hasher = hasher  # every tensor read is added to it (the weights' fingerprint)
        index_path = os.path.join(ckpt_dir, "model.safetensors.index.json")
        single = os.path.join(ckpt_dir, "model.safetensors")
        if os.path.exists(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_path}: cannot read 'weight_map' ({e})") from None
            self.where = {k: os.path.join(ckpt_dir, v) for k, v in weight_map.items()}
        elif os.path.exists(single):
            self.where = None
            self._single = single
        else:
            raise CheckpointError(f"{ckpt_dir}: no model.safetensors or model.safetensors.index.json")
        self._open: dict[str, Any] = {}
        if self.where is None:
            self.where = {k: single for k in self._file(single).keys()}

    def _header(self, path: str) -> dict:
        """The safetensors header of ``path`` (name -> dtype, shape, data_offsets), cached."""
        key = ("header", path)
        if key not in self._open:
            try:
                with open(path, "rb") as f:
                    n = struct.unpack("<Q", f.read(8))[0]
                    self._open[key] = (8 + n, json.loads(f.read(n)))
            except (OSError, ValueError, struct.error) as e:
                raise CheckpointError(f"{path}: cannot read the safetensors header ({e})") from None
        return self._open[key]

    def _raw(self, path: str, name: str) -> np.ndarray:
        """A tensor whose dtype safetensors' numpy reader lacks (F8_E4M3), read from the bytes."""
        base, header = self._header(path)
        info = header[name]
        dtype = RAW_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor '{name}' has unsupported dtype {info['dtype']}")
        lo, hi = info["data_offsets"]
        with open(path, "rb") as f:
            f.seek(base + lo)
            buf = f.read(hi - lo)
        return np.frombuffer(buf, dtype=dtype).reshape(info["shape"])

    def has(self, name: str) -> bool:
        return name in self.where

    def _file(self, path: str):
        if path not in self._open:
            try:
                self._open[path] = safe_open(path, framework="np")
            except Exception as e:  # safetensors raises several error types for bad files
                raise CheckpointError(f"{path}: cannot open safetensors file ({e})") from None
        return self._open[path]

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.where:
            raise CheckpointError(f"checkpoint is missing tensor '{name}'")
        path = self.where[name]
        try:
            f = self._file(path)
            t = self._raw(path, name) if f.get_slice(name).get_dtype() in RAW_DTYPES else f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read tensor '{name}' ({e})") from None
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{path}: tensor '{name}' has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if self.hasher is not None:
            self.hasher.add(name, t)
        return t


#: safetensors dtypes read from the raw bytes (safetensors' numpy reader has no fp8).
RAW_DTYPES = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}


#: Tag of the fingerprint scheme: a new scheme gives new fingerprints (and new KV chunk keys).
FINGERPRINT_SCHEME = "sha256-tensors-v1"


class TensorHasher:
    """The content fingerprint of a checkpoint's weights, taken as the loader reads them.

    Every tensor the loader reads (non-expert and routed-expert weights, fp8 ``weight_scale_inv``
    scales) is hashed as stored in the file, before any cast to the compute dtype: SHA-256 of its
    bytes, one digest per tensor. :meth:`hexdigest` is SHA-256 over the scheme tag and, in name
    order, each tensor's name, dtype (the stored format: float32 / bfloat16 / float8_e4m3fn), shape
    and digest. So the fingerprint changes with any byte, dtype or shape of any weight the model
    uses, and not with the path, the file layout (single file or shards, tensor order), mtimes or
    tensors the loader skips (a vision tower). The compute dtype and the expert storage format are
    not part of it: ``PrefixCache.identity`` adds them.

    Why all bytes and not file headers, sizes and mtimes: a checkpoint rewritten in place with the
    same shapes keeps its header and size, and a copy (``cp -p``, ``rsync -t``, a restore) can keep
    an mtime, so such a key served the old model's K/V; hashing what is read costs CPU but no I/O.
    Cost: hashlib's SHA-256 (SHA-NI) runs at about 1.7 GB/s per core and drops the GIL, so the
    digests run on ``workers`` threads while the loading thread reads and converts the next
    tensors: about 0.6 core-seconds per GB, ~35 core-s for a 60 GB checkpoint, spread over the pool
    (~5 s of wall time on 8 free cores, partly hidden behind the reads and conversions). Measured on
    a shared 2-core CPU host: a 1.6 GB bf16 checkpoint loaded in 6.6 s instead of 6.0 s (+10%,
    ~0.4 s per GB), a test fixture (~1 MB, ~100 tensors) in 7 ms instead of 3 ms.
    At most ``max_pending_bytes`` of read tensors wait for their digest (then the reader waits).

    Args:
      workers: hashing threads; default min(8, CPUs).
      max_pending_bytes: bytes of tensors held for hashing before :meth:`add` blocks.
    """

    #: Tensors smaller than this are hashed in the reading thread.
    INLINE_BYTES = 256 << 10

    def __init__(self, workers: int | None = None, max_pending_bytes: int = 512 << 20):
        self._pool = concurrent.futures.ThreadPoolExecutor(workers or min(8, os.cpu_count() or 1),
                                                           thread_name_prefix="ftjax-hash")
        self._items: list[tuple[str, str, tuple, concurrent.futures.Future]] = []
        self._pending: collections.deque = collections.deque()
        self._pending_bytes, self._max_pending = 0, max_pending_bytes
        self.nbytes = 0  # bytes hashed (for reports)

    def add(self, name: str, t: np.ndarray) -> None:
        """Hashes tensor ``t`` (any dtype and shape, as read from the file) under ``name``."""
        flat = np.ascontiguousarray(t).reshape(-1).view(np.uint8)
        if flat.nbytes < self.INLINE_BYTES:  # a thread hand-off costs more than the hash
            fut = concurrent.futures.Future()
            fut.set_result(hashlib.sha256(flat).digest())
        else:
            fut = self._pool.submit(lambda b: hashlib.sha256(b).digest(), flat)
        self._items.append((name, str(t.dtype), tuple(t.shape), fut))
        self._pending.append((fut, flat.nbytes))
        self._pending_bytes += flat.nbytes
        self.nbytes += flat.nbytes
        while self._pending_bytes > self._max_pending:
            done, n = self._pending.popleft()
            done.result()
            self._pending_bytes -= n

    def hexdigest(self) -> str:
        """``FINGERPRINT_SCHEME:<64 hex digits>`` over every tensor added (waits for the digests)."""
        h = hashlib.sha256(FINGERPRINT_SCHEME.encode())
        for name, dtype, shape, fut in sorted(self._items, key=lambda x: x[0]):
            h.update(json.dumps([name, dtype, list(shape)]).encode() + b"\0" + fut.result())
        return f"{FINGERPRINT_SCHEME}:{h.hexdigest()}"

    def close(self) -> None:
        """Stops the threads (after the digests already asked for)."""
        self._pool.shutdown(wait=True)


def model_fingerprint(model: "LoadedModel") -> str:
    """``model.fingerprint``, computed from the arrays and kept on the model when it is "" (a model
    built by hand): SHA-256 over every leaf of ``params`` and of the expert banks (path, dtype,
    shape, bytes). That copies every array to the host once; loaded and random models carry theirs."""
    if model.fingerprint:
        return model.fingerprint
    hasher = TensorHasher()
    try:
        leaves = jax.tree_util.tree_flatten_with_path({"params": model.params, "banks": model.banks})[0]
        for path, leaf in leaves:
            hasher.add(jax.tree_util.keystr(path), np.asarray(leaf))
        model.fingerprint = "arrays:" + hasher.hexdigest()
    finally:
        hasher.close()
    return model.fingerprint


def random_fingerprint(cfg: ModelConfig, dtype: str, seed: int, scale: float) -> str:
    """The fingerprint of :func:`random_model`'s weights: its generator, seed, scale, dtype and
    config, and JAX's random-bit settings (which change the values)."""
    fields = {"generator": "ftjax.checkpoint.random_model.v1", "config": cfg.identity(), "dtype": dtype,
              "seed": seed, "scale": scale, "prng_impl": str(jax.config.jax_default_prng_impl),
              "threefry_partitionable": bool(jax.config.jax_threefry_partitionable)}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()
    return f"random:{digest}"


def checkpoint_quantization(ckpt_dir: str) -> str | None:
    """"fp8" for an fp8 block-wise checkpoint (config.json ``quantization_config``), None for a
    plain one.

    Raises:
      CheckpointError: another quantization method, or fp8 blocks other than [128, 128].
    """
    q = (_read_json(os.path.join(ckpt_dir, "config.json")) or {}).get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method != "fp8":
        raise CheckpointError(f"{ckpt_dir}: unsupported quantization_config quant_method {method!r} (only fp8)")
    if list(q.get("weight_block_size") or []) != list(fp8_format.BLOCK):
        raise CheckpointError(f"{ckpt_dir}: fp8 weight_block_size {q.get('weight_block_size')!r} is not supported "
                              f"(only {list(fp8_format.BLOCK)})")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"{ckpt_dir}: fp8 fmt {fmt!r} is not supported (only e4m3)")
    return fp8_format.FORMAT.name


def dequantize_fp8_block(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = fp8_format.BLOCK) -> np.ndarray:
    """float32 ``w * scale_inv`` per block of a [out, in] fp8 weight with scales [ceil(out/bo), ceil(in/bi)]."""
    out, inp = w.shape
    bo, bi = block
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), bo, axis=0)[:out], bi, axis=1)[:, :inp]
    return w.astype(np.float32) * s


def load_tokenizer(ckpt_dir: str):
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json``, or None when the file is absent."""
    path = os.path.join(ckpt_dir, "tokenizer.json")
    if not os.path.exists(path):
        return None
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(path)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot load tokenizer ({e})") from None


def load_checkpoint(ckpt_dir: str, dtype: str | None = None, progress: bool = True,
                    expert_dtype: str | None = None) -> LoadedModel:
    """Loads an HF MoE checkpoint directory of a registered family (``ftjax.families``: the family says
    where each weight sits).

    Args:
      ckpt_dir: directory with config.json and model.safetensors (or an index + shards).
      dtype: compute dtype ("float32" | "bfloat16" | "float16"); default: the checkpoint's.
      progress: show a tqdm progress bar over layers.
      expert_dtype: format of the expert banks (``ftjax.experts.formats`` registry): a plain
        checkpoint's experts are quantized after loading (round to nearest); an fp8 checkpoint's
        experts load as they are ("fp8" or None only). None: the compute dtype (plain) / fp8.
    Returns:
      LoadedModel with device params and host-memory expert banks (compute dtype, or quantized),
      and the fingerprint of the tensors read (:class:`TensorHasher`: SHA-256 of every weight's
      bytes, hashed on threads while loading; what keys its stored KV, not the path).
    Raises:
      ConfigError / CheckpointError: missing or unreadable files, missing tensors, shape mismatch,
        an unsupported quantization, an fp8 checkpoint with another ``expert_dtype``.
    """
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir}: checkpoint directory does not exist")
    cfg = load_hf_config(ckpt_dir)
    dtype = dtype or cfg.dtype
    if dtype not in DTYPES:
        raise CheckpointError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    np_dtype = DTYPES[dtype]
    stored = checkpoint_quantization(ckpt_dir)
    if stored is not None and expert_dtype not in (None, stored):
        raise CheckpointError(f"{ckpt_dir}: an {stored} checkpoint's experts load as {stored}; "
                              f"expert_dtype {expert_dtype!r} is not supported for it")
    if expert_dtype is not None:
        quant.bank_format(expert_dtype)  # ValueError for an unknown format, before any loading
    L, E, D, F = cfg.num_layers, cfg.num_experts, cfg.hidden_size, cfg.expert_ffn
    if stored and cfg.is_hybrid:
        raise CheckpointError(f"{ckpt_dir}: fp8 checkpoints of the {cfg.model_type} family are not supported")
    check_host_memory(L * E * quant.expert_bytes(stored or "dense", D, F, np.dtype(np_dtype).itemsize), ckpt_dir)
    hasher = TensorHasher()
    try:
        return _load(ckpt_dir, cfg, dtype, np_dtype, stored, expert_dtype, progress, hasher)
    finally:
        hasher.close()


def _load(ckpt_dir: str, cfg: ModelConfig, dtype: str, np_dtype, stored: str | None, expert_dtype: str | None,
          progress: bool, hasher: TensorHasher) -> LoadedModel:
    """:func:`load_checkpoint` after its checks: reads every tensor (each one added to ``hasher``)."""
    L, E, D, F = cfg.num_layers, cfg.num_experts, cfg.hidden_size, cfg.expert_ffn
    idx = _TensorIndex(ckpt_dir, hasher)
    fam = families.get(cfg.model_type)
    prefix = fam.tensor_prefix(idx.has)
    _note_skipped(idx, prefix, ckpt_dir)
    bar = tqdm(total=L, desc=f"loading {os.path.basename(os.path.normpath(ckpt_dir))}", unit="layer",
               disable=None if progress else True, leave=False)  # None: no bar where stderr is not a terminal

    def scale_of(name, shape):
        """The fp8 weight_scale_inv of weight ``name`` [out, in], or None when it has none."""
        sname = name + "_scale_inv"
        if stored is None or not idx.has(sname):
            return None
        return idx.get(sname, tuple(math.ceil(n / b) for n, b in zip(shape, fp8_format.BLOCK)))

    def get(name, shape):
        """A non-expert tensor as stored, in the compute dtype (an fp8 one dequantized)."""
        t = idx.get(name, tuple(shape))
        s = scale_of(name, shape) if len(shape) == 2 else None
        if s is not None:
            t = dequantize_fp8_block(t, s)
        return t.astype(np_dtype)

    def get_expert(name, shape):
        """fp8 checkpoint: the stored fp8 weight [in, out] and its scales [nbi, nbo] as they are."""
        t, s = idx.get(name, shape), scale_of(name, shape)
        if s is None or t.dtype != fp8_format.FORMAT.storage:
            raise CheckpointError(f"{ckpt_dir}: fp8 checkpoint expert tensor '{name}' is not float8_e4m3fn with a "
                                  f"weight_scale_inv")
        return t.T, s.T

    st = model_lib.structure(cfg)
    shapes = model_lib.param_shapes(cfg)["layers"]
    layers = {k: np.empty(sh, np_dtype) for k, sh in shapes.items()}
    sfmt = formats.get(stored) if stored else None  # the registry entry of the stored format
    bank_dtype = sfmt.storage if stored else np_dtype
    gate_up = np.empty((L * E, D, 2 * F), bank_dtype)
    down = np.empty((L * E, F, D), bank_dtype)
    if stored:
        sg = np.empty((L * E,) + sfmt.scale_shape(D, 2 * F, 2), sfmt.scale_dtype)
        sd = np.empty((L * E,) + sfmt.scale_shape(F, D, 1), sfmt.scale_dtype)
        nbf = sg.shape[-1] // 2
    for i in range(L):
        kind = st.kinds[i]
        tensors = fam.layer_tensors(cfg, get, prefix, i, kind)
        for key in layers:
            owner = st.owner_of(key)
            if owner not in ("", kind):
                continue
            if key not in tensors:
                raise CheckpointError(f"{ckpt_dir}: the {cfg.model_type} family gave no '{key}' for layer {i}")
            layers[key][i if owner == "" else st.kind_index[i]] = tensors[key]
        fused = fam.fused_expert_tensors(cfg, prefix, i)
        rows = slice(i * E, (i + 1) * E)
        if fused is not None and idx.has(fused[0]):
            gate_up[rows] = idx.get(fused[0], (E, 2 * F, D)).astype(np_dtype).transpose(0, 2, 1)
            down[rows] = idx.get(fused[1], (E, D, F)).astype(np_dtype).transpose(0, 2, 1)
        else:
            for j in range(E):
                g, u, dn = fam.expert_tensors(cfg, prefix, i, j)
                r = i * E + j
                if stored:
                    gate_up[r, :, :F], sg[r, :, :nbf] = get_expert(g, (F, D))
                    gate_up[r, :, F:], sg[r, :, nbf:] = get_expert(u, (F, D))
                    down[r], sd[r] = get_expert(dn, (D, F))
                    continue
                gate_up[r, :, :F] = idx.get(g, (F, D)).astype(np_dtype).T
                gate_up[r, :, F:] = idx.get(u, (F, D)).astype(np_dtype).T
                down[r] = idx.get(dn, (D, F)).astype(np_dtype).T
        bar.update(1)
    params: dict[str, Any] = {"embed": get(prefix + "embed_tokens.weight", (cfg.vocab_size, D)),
                              "final_norm": get(prefix + "norm.weight", (D,)), "layers": layers}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = get("lm_head.weight", (cfg.vocab_size, D)).T
    bar.close()
    if stored:
        banks = ExpertBanks(memory.to_host(gate_up), memory.to_host(down), (memory.to_host(sg), memory.to_host(sd)),
                            stored)
    else:
        banks = ExpertBanks(memory.to_host(gate_up), memory.to_host(down))
    del gate_up, down  # the numpy copies go before any quantization allocates more host memory
    params = jax.tree.map(memory.to_device, params)
    if expert_dtype is not None and banks.fmt == "dense":
        banks = quant.quantize_banks(banks, expert_dtype)
    return LoadedModel(cfg, params, banks, dtype, load_tokenizer(ckpt_dir), name=ckpt_dir,
                       eos_token_ids=eos_token_ids(ckpt_dir), fingerprint=hasher.hexdigest(),
                       sampling_defaults=sampling_defaults(ckpt_dir))


def _note_skipped(idx: "_TensorIndex", prefix: str, ckpt_dir: str) -> None:
    """Says (on stderr) which tensor groups of a multimodal checkpoint are not read (the text model only)."""
    if prefix == "model.":
        return
    skipped = {k.split(".")[1] if k.startswith("model.") else k.split(".")[0] for k in idx.where
               if not k.startswith(prefix) and k != "lm_head.weight"}
    if skipped:
        print(f"note: {ckpt_dir}: text model only; skipping the tensors of {', '.join(sorted(skipped))} "
              f"(vision tower / multi-token-prediction head)", file=sys.stderr)


EOS_FILES = ("generation_config.json", "config.json")


def _read_json(path: str) -> dict | None:
    """The JSON object in ``path``; None when the file does not exist.
    Raises CheckpointError for an unreadable file or one that is not a JSON object."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def eos_token_ids(ckpt_dir: str) -> tuple[int, ...]:
    """The end-of-sequence token ids of a checkpoint, in file order without repeats.

    ``eos_token_id`` is read from ``generation_config.json`` first (what transformers'
    ``generate`` uses), else from ``config.json``; a file that is absent, or has the field absent
    or null, does not count. The value is an int or a list of ints (Llama 3 style). Returns () when
    neither file gives one (a list may also be empty: no EOS). An id >= ``vocab_size`` of
    config.json (when it gives one; small test checkpoints often keep a real model's
    generation_config.json) can never be generated: it is left out with a :class:`CheckpointWarning`
    naming the file, the id and the vocabulary, as transformers ignores it (the file's other ids
    stay; when none is left there is no EOS: config.json is not read instead).

    Raises:
      CheckpointError (a ValueError): a file that is not a JSON object; a value that is not an int
        or a list of ints (strings, floats and booleans are refused), or a negative id. The message
        names the file, the field and the value.
    """
    config = _read_json(os.path.join(ckpt_dir, "config.json")) or {}
    vocab = config.get("vocab_size")
    for name in EOS_FILES:
        obj = config if name == "config.json" else _read_json(os.path.join(ckpt_dir, name))
        value = (obj or {}).get("eos_token_id")
        if value is not None:
            return _check_eos(value, os.path.join(ckpt_dir, name), vocab)
    return ()


SAMPLING_FIELDS = ("do_sample", "temperature", "top_p", "top_k")


def sampling_defaults(ckpt_dir: str) -> SamplingDefaults:
    """The sampling defaults of a checkpoint: ``do_sample``, ``temperature``, ``top_p``, ``top_k`` of its
    ``generation_config.json`` (an absent file, or a field absent or null, gives None: see
    ``ftjax.sampling.SamplingDefaults`` for how requests use them).

    Raises:
      CheckpointError (a ValueError): a file that is not a JSON object, or a value of the wrong type or
        range (do_sample not a bool; temperature not a finite number >= 0; top_p outside (0, 1]; top_k not
        an integer >= 0). The message names the file and the field.
    """
    path = os.path.join(ckpt_dir, "generation_config.json")
    obj = _read_json(path) or {}
    values = {k: obj.get(k) for k in SAMPLING_FIELDS}
    if isinstance(values["temperature"], int) and not isinstance(values["temperature"], bool):
        values["temperature"] = float(values["temperature"])
    if isinstance(values["top_p"], int) and not isinstance(values["top_p"], bool):
        values["top_p"] = float(values["top_p"])
    try:
        return SamplingDefaults(**values)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def _check_eos(value: Any, where: str, vocab: Any) -> tuple[int, ...]:
    """``value`` of ``eos_token_id`` in file ``where`` as a tuple of ids (those >= ``vocab`` left out
    with a CheckpointWarning), or CheckpointError."""
    items = value if isinstance(value, list) else [value]
    ids: list[int] = []
    for v in items:
        if isinstance(v, bool) or not isinstance(v, int):
            raise CheckpointError(f"{where}: 'eos_token_id' must be an integer or a list of integers, got {value!r}")
        if v < 0:
            raise CheckpointError(f"{where}: 'eos_token_id' has a negative id {v} (value {value!r})")
        if isinstance(vocab, int) and not isinstance(vocab, bool) and v >= vocab:
            warnings.warn(f"{where}: 'eos_token_id' id {v} is outside the vocabulary [0, {vocab}) "
                          f"(value {value!r}); ignored", CheckpointWarning, stacklevel=3)
            continue
        if v not in ids:
            ids.append(v)
    return tuple(ids)


def check_host_memory(nbytes: int, what: str) -> None:
    """Raises CheckpointError when ``nbytes`` of expert banks cannot fit this machine's RAM.

    Applied on the CPU backend only, where host RAM holds everything; GPU hosts of some VM kinds
    report less memory than they can use until it is touched, so there the check would mislead.
    """
    if memory.backend() != "cpu":
        return
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if nbytes > 0.8 * total:
        raise CheckpointError(f"{what}: the expert banks need {nbytes / 1e9:.1f} GB of host memory; this machine "
                              f"has {total / 1e9:.1f} GB in all (use a smaller preset, e.g. tiny)")


def random_model(cfg: ModelConfig, dtype: str | None = None, seed: int = 0, scale: float = 0.5) -> LoadedModel:
    """Random weights at ``cfg``'s shape: non-expert params on the device, expert banks created
    directly in host memory by a jitted generator whose output sharding is the host memory kind
    (no numpy detour through one host thread).

    Weights are N(0, 1) * scale / sqrt(fan_in); norms are ones. Deterministic in ``seed``.
    """
    dtype = dtype or cfg.dtype
    jdt = jnp.dtype(DTYPES[dtype])
    check_host_memory(cfg.pool_bytes(jdt.itemsize), f"random {cfg.model_type} weights")
    L, E, D, F = cfg.num_layers, cfg.num_experts, cfg.hidden_size, cfg.expert_ffn
    shapes = model_lib.param_shapes(cfg)
    keys = iter(jax.random.split(jax.random.key(seed), 64 if cfg.is_hybrid else 16))

    def w(name, shape):
        if "norm" in name:
            return jnp.ones(shape, jdt)
        fan_in = 1.0 if name == "embed" else shape[-2]
        return (jax.random.normal(next(keys), shape, jnp.float32) * (scale / fan_in ** 0.5)).astype(jdt)

    # layers first (in param_shapes' order), then embed and head: the order the random keys are drawn in
    layers = {n: w(n, sh) for n, sh in shapes.pop("layers").items()}
    params = {"layers": layers, **{k: w(k, v) for k, v in shapes.items()}}
    params = jax.tree.map(memory.to_device, params)

    host = memory.host_sharding()

    def bank(key, shape, fan_in):
        # One layer at a time inside a scan, each layer moved to host memory inside the body (a
        # scan output in host memory: the supported way down, DESIGN.md section 2), so the device
        # holds one layer at a time, not the whole bank (38.6 GB for qwen3-30b-a3b's gate_up).
        def gen(k):
            def layer(_, kl):
                w = (jax.random.normal(kl, shape, jnp.float32) * (scale / fan_in ** 0.5)).astype(jdt)
                return None, jax.device_put(w, jax.memory.Space.Host)
            return jax.lax.scan(layer, None, jax.random.split(k, L))[1].reshape((L * E,) + shape[1:])
        return jax.jit(gen, out_shardings=host)(key)

    k_gu, k_dn = jax.random.split(jax.random.key(seed + 1))
    banks = ExpertBanks(bank(k_gu, (E, D, 2 * F), D), bank(k_dn, (E, F, D), F))
    name = f"random:{cfg.model_type}:seed={seed}:scale={scale}"
    return LoadedModel(cfg, params, banks, dtype, None, name=name,
                       fingerprint=random_fingerprint(cfg, dtype, seed, scale))
