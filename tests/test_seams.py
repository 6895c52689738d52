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


def test_a_block_whose_layers_pack_their_stats_differently_is_refused():
    """``model.forward`` stacks one packed vector per layer: a block of the layer pattern whose expert functions
    report different layouts (here ``d2d`` counted in one layer of the block and not in the next) cannot stack, and
    the error names the layouts."""
    import jax

    from ftjax import model as model_lib
    from ftjax.checkpoint import random_model
    from ftjax.config import preset
    from ftjax.experts import offload
    from ftjax.experts.state import init_expert_state

    m = random_model(preset("tiny-hybrid"), "float32")  # one block of 4 layers
    cfg, resident = m.cfg, offload.make_expert_fn("resident", m.cfg.num_experts)
    calls = []

    def expert_fn(state, layer, routing):
        y, state, st = resident(state, layer, routing)
        calls.append(0)
        return y, state, st._replace(d2d=jnp.int32(0) if len(calls) % 2 else None)

    state = init_expert_state("resident", cfg.num_layers, cfg.num_experts, 0, m.banks, jnp.float32)
    cache = model_lib.init_kv_cache(cfg, 1, 16, jnp.float32)
    tokens = jnp.zeros((1, 4), jnp.int32)
    layouts = r"\[\(\(4, 4\), False\), \(\(4, 4\), True\)\]"  # 4 tokens x top-4, d2d counted or not
    with pytest.raises(ValueError, match=r"forward: the layers' stats differ in layout " + layouts):
        jax.eval_shape(lambda: model_lib.forward(m.params, cfg, tokens, jnp.zeros(1, jnp.int32),
                                                 jnp.full(1, 4, jnp.int32), cache, expert_fn, state))
