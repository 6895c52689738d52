"""Routing traces: the routed expert ids of a run, per call and layer, in one ``.npz`` file.

``python -m ftjax.generate --trace_routing=FILE.npz`` writes :func:`arrays`; experiments/replay_policies.py
reads it back with :func:`load` and :func:`check`. A trace holds ``step{i}``: int [L, tokens, top_k] routed
ids of call i (the prefill, then each decode step; -1 = a padding token), and the model's shape as scalar
int arrays ``num_layers``, ``num_experts`` and ``top_k`` (:data:`SHAPE_KEYS`). Traces written before the
shape was recorded have only the ``step{i}`` arrays: a reader then needs E from elsewhere.
"""

from __future__ import annotations

import re

import numpy as np

#: The scalar fields that record the model's shape beside the ``step{i}`` arrays.
SHAPE_KEYS = ("num_layers", "num_experts", "top_k")
_STEP = re.compile(r"step(\d+)")


class TraceError(ValueError):
    """A routing trace that cannot be read or does not hold what it says: one line naming the file and
    the field."""


def arrays(routing, cfg) -> dict[str, np.ndarray]:
    """The arrays of a trace file (for ``np.savez``): ``step{i}`` per call of ``routing`` (int arrays
    [L, tokens, top_k], e.g. ``GenerateResult.routing``) and the scalar int64 arrays ``num_layers``,
    ``num_experts`` and ``top_k`` of ``cfg`` (a ``ModelConfig``)."""
    out = {f"step{i}": np.asarray(r) for i, r in enumerate(routing)}
    return {**out, **{k: np.asarray(int(getattr(cfg, k)), np.int64) for k in SHAPE_KEYS}}


def load(path: str) -> tuple[list[np.ndarray], dict[str, int] | None]:
    """Reads a trace file. Returns (the ``step{i}`` arrays in call order, {num_layers, num_experts,
    top_k} as recorded, or None for a trace written before the shape was recorded).
    Raises:
      TraceError: an unreadable file or one that is not an ``.npz``, no ``step{i}`` arrays, only some of
        :data:`SHAPE_KEYS`, or a shape field that is not a scalar integer >= 1."""
    try:
        z = np.load(path, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 -- OSError, BadZipFile, ValueError...: all mean the same to the user
        raise TraceError(f"{path}: cannot read it as a routing trace ({type(e).__name__}: {e})") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise TraceError(f"{path}: expected an .npz routing trace (ftjax.generate --trace_routing), got one array")
    with z:
        steps = sorted((int(m.group(1)), k) for k in z.files if (m := _STEP.fullmatch(k)))
        if not steps:
            raise TraceError(f"{path}: no step<i> arrays (expected a ftjax.generate --trace_routing file)")
        present = [k for k in SHAPE_KEYS if k in z.files]
        if present and len(present) < len(SHAPE_KEYS):
            missing = [k for k in SHAPE_KEYS if k not in present]
            raise TraceError(f"{path}: has {', '.join(present)} but not {', '.join(missing)} (a routing trace "
                             f"records {', '.join(SHAPE_KEYS)} together)")
        shape = {k: _scalar(path, k, z[k]) for k in present} or None
        return [z[k] for _, k in steps], shape


def _scalar(path: str, key: str, value: np.ndarray) -> int:
    if value.shape != () or not np.issubdtype(value.dtype, np.integer) or int(value) < 1:
        raise TraceError(f"{path}: {key}: expected a scalar integer >= 1, got {value.dtype} {value.tolist()!r}")
    return int(value)


def check(path: str, steps: list[np.ndarray], num_layers: int, num_experts: int, top_k: int | None = None) -> None:
    """Checks that every step's array is int [num_layers, tokens, top_k] (``top_k`` None: any) of ids
    in [0, num_experts) or -1 (padding).
    Raises:
      TraceError: the first step at fault, its field, and expected vs got."""
    for i, ids in enumerate(steps):
        if ids.ndim != 3 or not np.issubdtype(ids.dtype, np.integer):
            raise TraceError(f"{path}: step{i}: expected integer ids [num_layers, tokens, top_k], got "
                             f"{ids.dtype} of shape {list(ids.shape)}")
        if ids.shape[0] != num_layers:
            raise TraceError(f"{path}: step{i}: num_layers: expected {num_layers}, got {ids.shape[0]} layers")
        if top_k is not None and ids.shape[2] != top_k:
            raise TraceError(f"{path}: step{i}: top_k: expected {top_k}, got {ids.shape[2]} ids per token")
        bad = ids[(ids < -1) | (ids >= num_experts)]
        if bad.size:
            raise TraceError(f"{path}: step{i}: routed expert id {int(bad.flat[0])}: expected ids in "
                             f"[0, num_experts={num_experts}) or -1")
