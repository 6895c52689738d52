"""LayerStats.packed / unpacked: one layer's counters and routed ids as the one int32 vector a layer scan stacks."""

import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.seams import OPTIONAL_COUNTS, LayerStats


@pytest.mark.parametrize("optional", [{}, {"d2d": 3}, {"prefetched": 5, "prefetch_used": 1}])
def test_packed_stats_unpack_to_the_same_fields_over_stacked_layers(optional):
    ids = [jnp.array([[5, 1], [-1, -1], [7, 2]], jnp.int32), jnp.array([[0, 4], [6, 3], [2, 2]], jnp.int32)]
    layers = [LayerStats(jnp.int32(1 + i), jnp.int32(2), jnp.int32(2 - i), jnp.int32(i), ids[i],
                         **{n: jnp.int32(v + i) for n, v in optional.items()}) for i in range(2)]
    stacked = jnp.stack([s.packed() for s in layers])  # [L, 4 + optional + N*k], as the layer scan stacks it
    assert stacked.shape == (2, 4 + len(optional) + 6) and stacked.dtype == jnp.int32
    assert layers[0].layout() == ((3, 2), tuple(optional))
    back = LayerStats.unpacked(stacked, *layers[0].layout())
    np.testing.assert_array_equal(back.hits, [1, 2])
    np.testing.assert_array_equal(back.fetched, [2, 1])
    np.testing.assert_array_equal(back.cpu, [0, 1])
    np.testing.assert_array_equal(back.routed_ids, np.stack(ids))
    for name in OPTIONAL_COUNTS:
        if name in optional:
            np.testing.assert_array_equal(getattr(back, name), [optional[name], optional[name] + 1])
        else:
            assert getattr(back, name) is None


def test_stacked_stats_pack_along_their_leading_axes():
    """A decode block's per-step stats ([steps, L] counters, [steps, L, N, k] ids) pack into [steps, L, 4 + N*k]."""
    ids = jnp.arange(2 * 3 * 1 * 2, dtype=jnp.int32).reshape(2, 3, 1, 2)
    hits = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
    s = LayerStats(hits, hits + 10, hits + 20, jnp.zeros((2, 3), jnp.int32), ids)
    packed = s.packed()
    assert packed.shape == (2, 3, 4 + 2)
    np.testing.assert_array_equal(packed[1, 2], [5, 15, 25, 0, 10, 11])
    assert s.layout() == ((1, 2), ())
    back = LayerStats.unpacked(packed, *s.layout())
    np.testing.assert_array_equal(back.routed_ids, ids)
    np.testing.assert_array_equal(back.misses, hits + 10)


def test_unpacking_with_the_wrong_ids_shape_is_refused():
    s = LayerStats(jnp.int32(1), jnp.int32(0), jnp.int32(0), jnp.int32(0), jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(ValueError, match="expected 4 counts \\+ 4 routed ids"):
        LayerStats.unpacked(s.packed()[None], (1, 4))
    with pytest.raises(ValueError, match="expected a subsequence of"):  # out of the packed order
        LayerStats.unpacked(s.packed()[None], (1, 8), ("prefetch_used", "prefetched"))
    with pytest.raises(ValueError, match="expected a subsequence of .* \\(a tuple of names\\)"):  # the old bool
        LayerStats.unpacked(s.packed()[None], (1, 8), True)


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
    layouts = r"\[\(\(4, 4\), \(\)\), \(\(4, 4\), \('d2d',\)\)\]"  # 4 tokens x top-4, d2d counted or not
    with pytest.raises(ValueError, match=r"forward: the layers' stats differ in layout " + layouts):
        jax.eval_shape(lambda: model_lib.forward(m.params, cfg, tokens, jnp.zeros(1, jnp.int32),
                                                 jnp.full(1, 4, jnp.int32), cache, expert_fn, state))
