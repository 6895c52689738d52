"""LayerStats.packed / unpacked: one layer's counters and routed ids as the one int32 vector a layer scan stacks."""

import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.seams import LayerStats


@pytest.mark.parametrize("d2d", [None, 3])
def test_packed_stats_unpack_to_the_same_fields_over_stacked_layers(d2d):
    ids = [jnp.array([[5, 1], [-1, -1], [7, 2]], jnp.int32), jnp.array([[0, 4], [6, 3], [2, 2]], jnp.int32)]
    layers = [LayerStats(jnp.int32(1 + i), jnp.int32(2), jnp.int32(2 - i), jnp.int32(i), ids[i],
                         None if d2d is None else jnp.int32(d2d + i)) for i in range(2)]
    stacked = jnp.stack([s.packed() for s in layers])  # [L, 4 (5) + N*k], as the layer scan stacks it
    assert stacked.shape == (2, (4 if d2d is None else 5) + 6) and stacked.dtype == jnp.int32
    back = LayerStats.unpacked(stacked, (3, 2), d2d is not None)
    np.testing.assert_array_equal(back.hits, [1, 2])
    np.testing.assert_array_equal(back.fetched, [2, 1])
    np.testing.assert_array_equal(back.cpu, [0, 1])
    np.testing.assert_array_equal(back.routed_ids, np.stack(ids))
    if d2d is None:
        assert back.d2d is None
    else:
        np.testing.assert_array_equal(back.d2d, [3, 4])


def test_stacked_stats_pack_along_their_leading_axes():
    """A decode block's per-step stats ([steps, L] counters, [steps, L, N, k] ids) pack into [steps, L, 4 + N*k]."""
    ids = jnp.arange(2 * 3 * 1 * 2, dtype=jnp.int32).reshape(2, 3, 1, 2)
    hits = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
    s = LayerStats(hits, hits + 10, hits + 20, jnp.zeros((2, 3), jnp.int32), ids)
    packed = s.packed()
    assert packed.shape == (2, 3, 4 + 2)
    np.testing.assert_array_equal(packed[1, 2], [5, 15, 25, 0, 10, 11])
    assert s.layout() == ((1, 2), False)
    back = LayerStats.unpacked(packed, *s.layout())
    np.testing.assert_array_equal(back.routed_ids, ids)
    np.testing.assert_array_equal(back.misses, hits + 10)


def test_unpacking_with_the_wrong_ids_shape_is_refused():
    s = LayerStats(jnp.int32(1), jnp.int32(0), jnp.int32(0), jnp.int32(0), jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(ValueError, match="expected 4 counts \\+ 4 routed ids"):
        LayerStats.unpacked(s.packed()[None], (1, 4), False)
