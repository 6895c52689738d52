"""Memory-kind helpers: where arrays live on one accelerator (DESIGN.md section 2).

Memory kinds of a JAX device: ``device`` (HBM), ``pinned_host`` (page-locked host RAM that the
GPU can DMA from at full PCIe speed) and, on CPU, ``unpinned_host``. On the CPU backend the kinds
exist but moving between them is an identity, so CPU tests check logic, not movement.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding


def default_device() -> jax.Device:
    """The first local device (the accelerator when there is one)."""
    return jax.local_devices()[0]


def backend() -> str:
    """'gpu', 'tpu' or 'cpu'."""
    return default_device().platform


def memory_kinds(device: jax.Device | None = None) -> set[str]:
    """Memory kinds addressable by ``device``."""
    device = device or default_device()
    return {m.kind for m in device.addressable_memories()}


def host_sharding(kind: str | None = "pinned_host", device: jax.Device | None = None) -> SingleDeviceSharding:
    """Sharding in memory kind ``kind`` (default ``pinned_host``), falling back gracefully.

    If the device lacks ``kind``: ``pinned_host`` falls back to ``unpinned_host``; anything else
    (and ``kind=None``) to the device's default memory. Check ``.memory_kind`` of the result for
    what was chosen.
    """
    device = device or default_device()
    kinds = memory_kinds(device)
    for candidate in ([kind, "unpinned_host"] if kind == "pinned_host" else [kind]):
        if candidate is not None and candidate in kinds:
            return SingleDeviceSharding(device, memory_kind=candidate)
    return SingleDeviceSharding(device)


def device_sharding(device: jax.Device | None = None) -> SingleDeviceSharding:
    """Sharding for accelerator memory (memory kind ``device``)."""
    device = device or default_device()
    return SingleDeviceSharding(device, memory_kind="device")


def to_host(x: np.ndarray | jax.Array) -> jax.Array:
    """Places ``x`` in host memory (pinned where available). Shape and dtype are kept."""
    return jax.device_put(x, host_sharding())


def to_device(x: np.ndarray | jax.Array) -> jax.Array:
    """Places ``x`` in device memory."""
    return jax.device_put(x, device_sharding())


def memory_kind(x: jax.Array) -> str | None:
    """The memory kind an array lives in."""
    return x.sharding.memory_kind
