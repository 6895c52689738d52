"""Chained-hash chunk keys for the KV prefix store (DESIGN.md section 1.4).

After LMCache's chunked prefix caching: a prompt's token ids are cut into chunks of
``chunk_tokens`` tokens, and each full chunk gets a key that depends on the chunk's own
tokens, on *every token before it* (through the previous chunk's key) and on the model
identity.  Two prompts therefore share the key of chunk ``i`` exactly when they share the
first ``(i + 1) * chunk_tokens`` tokens and run on the same model/dtype, so a stored
chunk's KV (which depends on all earlier tokens through attention) is only ever reused in
the context it was computed in.

Key chain (all hashes SHA-256, keys are 32-byte digests)::

    key_{-1} = b""
    key_i    = sha256(key_{i-1} || identity || int32_le(tokens[i*C : (i+1)*C]))

A trailing partial chunk (fewer than ``C`` tokens) gets no key: it is never stored, it is
recomputed.  Since ``key_{i-1}`` is empty for ``i == 0`` and 32 bytes otherwise, and
``identity`` is a fixed-length digest from :func:`model_identity`, the concatenation is
unambiguous.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["model_identity", "chunk_keys", "KEY_BYTES"]

#: Length in bytes of every key returned by :func:`chunk_keys` and of
#: :func:`model_identity`'s digest.
KEY_BYTES = hashlib.sha256().digest_size

_IDENTITY_TAG = "ftjax.kv.model_identity.v1"
_INT32_MIN = np.iinfo(np.int32).min
_INT32_MAX = np.iinfo(np.int32).max


def _json_default(obj: Any) -> Any:
    # numpy scalars / arrays show up in configs built from numpy arithmetic.
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(
        f"model_identity: config value of type {type(obj).__name__} is not JSON-serialisable; "
        "pass plain ints/floats/strings/bools/lists/dicts"
    )


def _dtype_name(dtype: Any) -> str:
    """Canonical dtype name, so that ``"bfloat16"`` and ``jnp.bfloat16`` give one identity."""
    try:
        import jax.numpy as jnp  # local import: keys do not need JAX otherwise

        return jnp.dtype(dtype).name
    except Exception:  # unknown name: fall back to the string as given
        return str(dtype)


def model_identity(config_fields: dict, dtype: str) -> bytes:
    """Stable 32-byte digest identifying a model for KV-key purposes.

    Args:
      config_fields: dict of the config fields that determine the KV contents (layer
        count, head counts, head_dim, rope settings, the weights' content fingerprint, ...).  Must be
        JSON-serialisable (numpy scalars are accepted).  Key order does not matter: the
        dict is serialised as sorted JSON.
      dtype: KV dtype name, e.g. ``"bfloat16"``; a numpy/JAX dtype object is also
        accepted and normalised to its name.

    Returns:
      ``sha256(tag || sorted-JSON({"config": config_fields, "dtype": name}))``, 32 bytes.
      Different configs or dtypes give different digests, so two models never share
      chunk keys.

    Raises:
      TypeError: a config value is not JSON-serialisable, or ``config_fields`` is not a dict.
    """
    if not isinstance(config_fields, dict):
        raise TypeError(f"model_identity: config_fields must be a dict, got {type(config_fields).__name__}")
    payload = json.dumps(
        {"config": config_fields, "dtype": _dtype_name(dtype)},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
        allow_nan=True,
        default=_json_default,
    )
    h = hashlib.sha256()
    h.update(_IDENTITY_TAG.encode("ascii"))
    h.update(b"\x00")
    h.update(payload.encode("ascii"))
    return h.digest()


def chunk_keys(token_ids: Sequence[int] | np.ndarray, chunk_tokens: int, identity: bytes) -> list[bytes]:
    """Chained SHA-256 keys of the full ``chunk_tokens``-token chunks of ``token_ids``.

    Args:
      token_ids: 1-D sequence of token ids (ints in int32 range).
      chunk_tokens: tokens per chunk, > 0 (DESIGN.md default 256).
      identity: model identity digest from :func:`model_identity`.

    Returns:
      ``len(token_ids) // chunk_tokens`` keys of 32 bytes each; ``key_i`` covers tokens
      ``[0, (i + 1) * chunk_tokens)``.  A trailing partial chunk gets no key.  See the
      module docstring for the exact chain.

    Raises:
      ValueError: ``chunk_tokens <= 0``, ``token_ids`` not 1-D, a token id outside int32
        range, or non-integer token ids.
      TypeError: ``identity`` is not bytes.
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, (int, np.integer)):
        raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    chunk_tokens = int(chunk_tokens)
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    if not isinstance(identity, (bytes, bytearray)):
        raise TypeError(f"identity must be bytes (see model_identity), got {type(identity).__name__}")
    identity = bytes(identity)

    toks = np.asarray(token_ids)
    if toks.size == 0:
        return []
    if toks.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {toks.shape}")
    if not np.issubdtype(toks.dtype, np.integer):
        raise ValueError(f"token_ids must be integers, got dtype {toks.dtype}")
    toks = toks.astype(np.int64, copy=False)
    if toks.min() < _INT32_MIN or toks.max() > _INT32_MAX:
        raise ValueError("token_ids must fit in int32")
    le = toks.astype("<i4", copy=False)

    n_full = le.shape[0] // chunk_tokens
    keys: list[bytes] = []
    prev = b""
    for i in range(n_full):
        h = hashlib.sha256()
        h.update(prev)
        h.update(identity)
        h.update(le[i * chunk_tokens : (i + 1) * chunk_tokens].tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys
