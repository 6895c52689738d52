"""Sampling at the edges of its parameters (issue 11, case 1).

Statistical claims are checked on N = 20000 independent rows drawn with one fixed key (each row
of a batch draws its own Gumbel noise): an observed frequency f of a token with probability p is
accepted within 5 standard deviations, |f - p| <= 5 sqrt(p (1 - p) / N) (<= 0.0177 at p = 0.5;
a false failure has probability < 1e-6 per check). Exact claims (greedy ids, tokens never sampled)
are checked on every row of every key.
"""

from __future__ import annotations

import math
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_fixture
from ftjax import Engine
from ftjax.config import EngineConfig
from ftjax.sampling import GREEDY_BELOW, ParamError, check_sampling, sample, sample_rows

N = 20000
_sample = jax.jit(sample, static_argnames=("temperature", "top_p", "top_k"))  # as ftjax.runtime.step.sample_next
_sample_rows = jax.jit(sample_rows)
NEG = -np.inf


def _draw(row, temperature, top_p, n=N, seed=0, top_k=0) -> np.ndarray:
    """int [n]: n independent samples of one logits row."""
    logits = jnp.asarray(np.tile(np.asarray(row, np.float32), (n, 1)))
    return np.asarray(_sample(logits, jax.random.key(seed), temperature, top_p, top_k))


def _draw_rows(row, temperature, top_p, top_k=0, n=N, seed=0) -> np.ndarray:
    """int [n]: n samples of one logits row through the per-row sampler, one key per row."""
    logits = jnp.asarray(np.tile(np.asarray(row, np.float32), (n, 1)))
    full = lambda v, dt: jnp.full((n,), v, dt)  # noqa: E731
    return np.asarray(_sample_rows(logits, jax.random.split(jax.random.key(seed), n), full(temperature, jnp.float32),
                                   full(top_p, jnp.float32), full(top_k, jnp.int32)))


def _freqs(ids: np.ndarray, v: int) -> np.ndarray:
    return np.bincount(ids, minlength=v) / len(ids)


def _assert_distribution(ids: np.ndarray, probs) -> None:
    probs = np.asarray(probs, np.float64)
    f = _freqs(ids, len(probs))
    tol = 5 * np.sqrt(probs * (1 - probs) / len(ids))
    assert np.all(np.abs(f - probs) <= tol), (f, probs, tol)
    assert np.all(f[probs == 0] == 0)  # impossible tokens: never, not just rarely


def _softmax(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


# ---- temperature -> 0 --------------------------------------------------------------------------
def _fixture_step_logits() -> np.ndarray:
    """float32 [32, 384]: transformers' step logits of qwen3_moe_fp32 (short and long prompts)."""
    _, exp = load_fixture("qwen3_moe_fp32")
    return np.concatenate([exp["short_step_logits"], exp["long_step_logits"]])


@pytest.mark.parametrize("temperature", [1e-3, 1e-5, GREEDY_BELOW, 1e-7, 1e-20, 1e-38, 1e-45, 5e-324, 0.0])
def test_tiny_temperature_samples_are_the_greedy_ids(temperature):
    logits = _fixture_step_logits()
    greedy = logits.argmax(-1)
    top2 = np.sort(logits, -1)[:, -2:]
    # the premise of 1e-3: every row's top-1/top-2 margin exceeds the 20.4 * T span of float32
    # Gumbel noise (module docstring), so no key can pick another token
    assert (top2[:, 1] - top2[:, 0]).min() > 20.4e-3
    x = jnp.asarray(logits)
    for seed in range(50):
        got = np.asarray(_sample(x, jax.random.key(seed), temperature, 1.0))
        np.testing.assert_array_equal(got, greedy)
        got = np.asarray(_sample(x, jax.random.key(seed), temperature, 0.5))
        np.testing.assert_array_equal(got, greedy)


def test_generate_at_tiny_temperature_equals_greedy():
    """The reported case end to end: --temperature=1e-38 on qwen3_moe_fp32 gives the greedy ids
    (it used to overflow to nan and sample unrelated ids)."""
    model, exp = load_fixture("qwen3_moe_fp32")
    engine = Engine(model, EngineConfig("resident", max_seq_len=64))
    prompt = exp["short_prompt_ids"].tolist()
    for t in (1e-38, 1e-4):
        res = engine.generate([prompt], max_new_tokens=16, temperature=t, seed=3)
        assert res.generated_ids[0] == exp["short_generated_ids"].tolist()


def test_ties_greedy_lowest_id_and_sampled_uniformly_above_the_threshold():
    row = [1.0, 3.0, 3.0, 0.0, 3.0]
    assert set(_draw(row, 1e-7, 1.0, n=256)) == {1}                        # greedy: lowest tied id
    _assert_distribution(_draw(row, 1e-3, 1.0), [0, 1 / 3, 1 / 3, 0, 1 / 3])  # the T -> 0 limit


def test_moderate_temperature_follows_softmax():
    row = [0.0, 1.0, 2.0, 3.0]
    for t in (0.5, 1.0, 2.0):
        _assert_distribution(_draw(row, t, 1.0, seed=int(t * 10)), _softmax(np.array(row) / t))


# ---- very large temperatures -----------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1e6, 1e30, 3e38, 1e300])
def test_huge_temperature_is_near_uniform(temperature):
    row = [-50.0, 0.0, 7.0, 20.0, 100.0, 100.0]
    _assert_distribution(_draw(row, temperature, 1.0), [1 / 6] * 6)


@pytest.mark.parametrize("temperature", [1.0, 2.0, 1e6, 1e38, 1e300])
def test_logits_at_float32_ends_stay_finite(temperature):
    from ftjax.sampling import _scaled
    row = np.array([-3e38, 3e38, 0.0, 1e30], np.float32)
    s = np.asarray(jax.jit(_scaled, static_argnums=1)(jnp.asarray(row[None]), temperature))[0]
    assert s[1] == 0.0 and np.all(s <= 0) and not np.isnan(s).any() and not np.isposinf(s).any()
    want = _softmax(row.astype(np.float64) / temperature) if temperature < 3.5e38 else np.full(4, 0.25)
    _assert_distribution(_draw(row, temperature, 1.0, seed=9), want)
    if temperature >= 1e38:  # [-3, 3, 0, 0.01] and uniform: every token is sampled
        assert np.isfinite(s).all()


def test_huge_temperature_keeps_masked_tokens_out_and_top_p_follows_logit_order():
    row = [2.0, NEG, 1.0, 4.0, NEG, 3.0, 0.0, -1.0]
    _assert_distribution(_draw(row, 1e30, 1.0), [1 / 6, 0, 1 / 6, 1 / 6, 0, 1 / 6, 1 / 6, 1 / 6])
    # near-uniform mass: top_p = 0.5 keeps the 3 most likely tokens (mass before the third: 1/3)
    _assert_distribution(_draw(row, 1e30, 0.5), [1 / 3, 0, 0, 1 / 3, 0, 1 / 3, 0, 0])


# ---- top_p -------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 1e3, 1e30])
def test_top_p_near_zero_keeps_exactly_the_greedy_token(temperature):
    assert set(_draw([0.5, 2.0, -1.0, 1.9], temperature, 1e-9, n=4096)) == {1}
    assert set(_draw([1.0, 3.0, 3.0, 0.0, 3.0], temperature, 1e-9, n=4096)) == {1}   # tie: lowest id
    assert set(_draw([0.0] * 7, temperature, 1e-9, n=4096)) == {0}                  # all equal: id 0
    # a top_p that float32 flushes to zero (a server passes any float > 0) keeps the greedy token, not none
    assert set(_draw([0.5, 2.0, -1.0, 1.9], temperature, 1e-38, n=256)) == {1}


def test_top_p_keeps_the_shortest_prefix_reaching_the_mass():
    probs = np.array([0.15, 0.5, 0.05, 0.3])
    row = np.log(probs)
    # sorted: 0.5, 0.3, 0.15, 0.05; mass before each: 0, 0.5, 0.8, 0.95
    _assert_distribution(_draw(row, 1.0, 0.75, seed=1), [0, 0.625, 0, 0.375])
    _assert_distribution(_draw(row, 1.0, 0.9, seed=2), [0.15 / 0.95, 0.5 / 0.95, 0, 0.3 / 0.95])
    _assert_distribution(_draw(row, 1.0, 0.5, seed=3), [0, 1, 0, 0])
    # the mass is the tempered distribution's: at T = 2 the probabilities are sqrt-flattened
    tempered = _softmax(row / 2.0)
    order = np.argsort(-tempered, kind="stable")
    before = np.concatenate([[0], np.cumsum(tempered[order])[:-1]])
    kept = order[before < 0.7]
    want = np.zeros(4)
    want[kept] = tempered[kept] / tempered[kept].sum()
    assert len(kept) == 3
    _assert_distribution(_draw(row, 2.0, 0.7, seed=4), want)


def test_top_p_one_keeps_every_token():
    # a tail of small probabilities that a rounded cumulative sum could drop: all must appear
    probs = np.array([0.9] + [0.01] * 10)
    ids = _draw(np.log(probs), 1.0, 1.0)
    assert set(ids) == set(range(11))
    _assert_distribution(ids, probs)
    _assert_distribution(_draw(np.log(probs), 1.0, 1.0 - 1e-6, seed=5), probs)   # mass before last < top_p


def test_all_equal_logits_uniform():
    for value in (0.0, -1e30, 5e37):
        _assert_distribution(_draw([value] * 16, 1.0, 1.0), [1 / 16] * 16)
        _assert_distribution(_draw([value] * 16, 1.0, 0.5, seed=1), [1 / 8] * 8 + [0] * 8)  # ids 0..7 kept
        assert set(_draw([value] * 16, 0.0, 1.0, n=64)) == {0}


# ---- -inf entries ------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1e-38, 1e-3, 1.0, 1e30])
@pytest.mark.parametrize("top_p", [1e-9, 0.5, 0.9, 1.0])
def test_masked_tokens_never_sampled(temperature, top_p):
    rng = np.random.default_rng(7)
    row = rng.normal(size=64).astype(np.float32)
    masked = rng.choice(64, 40, replace=False)
    row[masked] = NEG
    ids = _draw(row, temperature, top_p, n=5000)
    assert not np.isin(ids, masked).any()
    assert np.isfinite(row[ids]).all()
    if temperature >= 1.0 and top_p == 1.0:
        assert set(ids) == set(np.flatnonzero(np.isfinite(row)))  # and every finite token can be


@pytest.mark.parametrize("temperature", [0.0, 1e-38, 1.0, 1e30])
@pytest.mark.parametrize("top_p", [1e-9, 0.5, 1.0])
def test_a_single_finite_logit_is_always_sampled(temperature, top_p):
    for j, value in ((0, -1e30), (5, 0.0), (383, 42.0)):
        row = np.full(384, NEG, np.float32)
        row[j] = value
        assert set(_draw(row, temperature, top_p, n=1000)) == {j}
    # all -inf: id 0, as argmax gives
    assert set(_draw(np.full(384, NEG), temperature, top_p, n=64)) == {0}


def test_rows_are_independent_distributions():
    """One call, rows with different shapes of distribution: each row follows its own."""
    rows = np.array([[0.0, 0.0, 0.0, 0.0], [NEG, 5.0, NEG, NEG], [np.log(0.7), np.log(0.3), NEG, NEG]], np.float32)
    logits = jnp.asarray(np.repeat(rows, N, axis=0))
    ids = np.asarray(_sample(logits, jax.random.key(11), 1.0, 1.0)).reshape(3, N)
    _assert_distribution(ids[0], [0.25] * 4)
    assert set(ids[1]) == {1}
    _assert_distribution(ids[2], [0.7, 0.3, 0, 0])


# ---- validation --------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature, text", [(-1.0, "-1.0"), (-1e-30, "-1e-30"), (math.nan, "nan"),
                                               (math.inf, "inf"), (-math.inf, "-inf"), ("0.5", "'0.5'"),
                                               (True, "True"), (None, "None")])
def test_bad_temperature_refused(temperature, text):
    with pytest.raises(ValueError, match=r"^temperature .*got " + text.replace("+", r"\+") + "$"):
        check_sampling(temperature, 1.0)
    with pytest.raises(ValueError, match="temperature"):
        _sample(jnp.zeros((1, 4)), jax.random.key(0), temperature, 1.0)


@pytest.mark.parametrize("top_p, text", [(0.0, "0.0"), (-0.5, "-0.5"), (1.0000001, "1.0000001"), (2.0, "2.0"),
                                         (math.nan, "nan"), (math.inf, "inf"), (False, "False"), ("1", "'1'")])
def test_bad_top_p_refused(top_p, text):
    with pytest.raises(ValueError, match=r"^top_p .*got " + text + "$"):
        check_sampling(1.0, top_p)
    with pytest.raises(ValueError, match="top_p"):
        _sample(jnp.zeros((1, 4)), jax.random.key(0), 1.0, top_p)


def test_top_k_beyond_int32_refused():
    """top_k is an int32 operand of the sampling program: 2**31 is refused by name, 2**31 - 1 kept."""
    check_sampling(1.0, 1.0, 2**31 - 1)
    with pytest.raises(ParamError, match=r"^top_k .*got 2147483648$") as err:
        check_sampling(1.0, 1.0, 2**31)
    assert err.value.param == "top_k" and isinstance(err.value, ValueError)
    again = pickle.loads(pickle.dumps(err.value))  # a refusal crosses processes and copies whole
    assert (again.param, str(again)) == ("top_k", str(err.value))


def test_good_values_accepted_including_numpy_scalars():
    for t, p in ((0.0, 1.0), (0, 1), (1e-300, 1e-300), (3e38, 0.999), (np.float32(0.7), np.float64(0.9))):
        check_sampling(t, p)
    ids = np.asarray(_sample(jnp.asarray([[0.0, 1.0, 9.0]]), jax.random.key(0), np.float32(1e-9), np.float64(0.5)))
    assert ids.tolist() == [2]


def test_engine_generate_refuses_bad_values_before_running():
    model, exp = load_fixture("qwen3_moe_fp32")
    engine = Engine(model, EngineConfig("resident", max_seq_len=64))
    prompt = exp["short_prompt_ids"].tolist()
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0 .*got -0.1"):
        engine.generate([prompt], max_new_tokens=2, temperature=-0.1)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0.0"):
        engine.generate([prompt], max_new_tokens=2, temperature=1.0, top_p=0.0)


# ---- top_k ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 1e3, 1e30])
def test_top_k_1_is_greedy_at_any_temperature(temperature):
    assert set(_draw([0.5, 2.0, -1.0, 1.9], temperature, 1.0, n=4096, top_k=1)) == {1}
    assert set(_draw([1.0, 3.0, 3.0, 0.0, 3.0], temperature, 1.0, n=4096, top_k=1)) == {1}   # tie: lowest id
    assert set(_draw_rows([1.0, 3.0, 3.0, 0.0, 3.0], temperature, 1.0, 1, n=4096)) == {1}


def test_top_k_keeps_the_k_most_likely_ties_to_the_lowest_ids():
    row = [0.0, 1.0, 2.0, 3.0]
    _assert_distribution(_draw(row, 1.0, 1.0, top_k=2), [0, 0, *_softmax([2.0, 3.0])])
    _assert_distribution(_draw([1.0, 3.0, 3.0, 0.0, 3.0], 1.0, 1.0, seed=1, top_k=2), [0, 0.5, 0.5, 0, 0])
    for k in (0, 4, 10):  # no limit
        _assert_distribution(_draw(row, 1.0, 1.0, seed=2, top_k=k), _softmax(row))


def test_top_p_applies_to_the_renormalized_top_k_set():
    probs = np.array([0.15, 0.5, 0.05, 0.3])
    # top-3: 0.5, 0.3, 0.15 renormalized by 0.95; mass before each: 0, 0.526, 0.842 -> top_p 0.8 keeps two
    for draw in (_draw(np.log(probs), 1.0, 0.8, seed=3, top_k=3), _draw_rows(np.log(probs), 1.0, 0.8, 3, seed=3)):
        _assert_distribution(draw, [0, 0.625, 0, 0.375])


def test_top_k_never_samples_masked_tokens():
    row = np.full(16, NEG, np.float32)
    row[[3, 9]] = [1.0, 2.0]
    assert set(_draw(row, 1.0, 1.0, top_k=8, n=4096)) == {3, 9}
    assert set(_draw_rows(row, 1e30, 1.0, 8, n=4096)) == {3, 9}


# ---- per-row parameters and keys ---------------------------------------------------------------------
def test_rows_follow_their_own_parameters():
    row = [0.0, 1.0, 2.0, 3.0]
    _assert_distribution(_draw_rows(row, 1.0, 1.0), _softmax(row))
    _assert_distribution(_draw_rows(row, 0.5, 1.0, seed=1), _softmax(np.array(row) / 0.5))
    assert set(_draw_rows(row, 0.0, 1.0, n=256)) == {3} and set(_draw_rows(row, 1e-7, 1.0, n=256)) == {3}
    _assert_distribution(_draw_rows([-50.0, 0.0, 100.0, 100.0], 1e30, 1.0, seed=2), [0.25] * 4)
    _assert_distribution(_draw_rows([-50.0, 0.0, 100.0, 100.0], np.inf, 1.0, seed=2), [0.25] * 4)  # T overflowed
    probs = np.array([0.9] + [0.01] * 10)
    assert set(_draw_rows(np.log(probs), 1.0, 1.0)) == set(range(11))  # top_p 1 drops no tail token
    # one call, rows with different parameters
    logits = jnp.asarray(np.tile(np.array(row, np.float32), (3 * N, 1)))
    t = np.repeat(np.array([0.0, 1.0, 1.0], np.float32), N)
    k = np.repeat(np.array([0, 0, 2], np.int32), N)
    ids = np.asarray(_sample_rows(logits, jax.random.split(jax.random.key(4), 3 * N), t, np.ones(3 * N, np.float32),
                                  k)).reshape(3, N)
    assert set(ids[0]) == {3}
    _assert_distribution(ids[1], _softmax(row))
    _assert_distribution(ids[2], [0, 0, *_softmax([2.0, 3.0])])


def test_a_rows_token_depends_on_its_key_not_on_the_batch():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(6, 64)).astype(np.float32)
    keys = jax.random.split(jax.random.key(6), 6)
    t = np.array([1.0, 0.7, 2.0, 1.0, 0.0, 1.0], np.float32)
    p = np.array([1.0, 0.9, 1.0, 0.5, 1.0, 1.0], np.float32)
    k = np.array([0, 0, 5, 0, 0, 1], np.int32)
    batch = np.asarray(_sample_rows(jnp.asarray(logits), keys, t, p, k))
    for i in range(6):
        alone = np.asarray(_sample_rows(jnp.asarray(logits[i:i + 1]), keys[i:i + 1], t[i:i + 1], p[i:i + 1],
                                        k[i:i + 1]))
        assert alone[0] == batch[i]
    assert batch[4] == logits[4].argmax() and batch[5] == logits[5].argmax()


@pytest.mark.parametrize("top_k, text", [(-1, "-1"), (1.5, "1.5"), (True, "True"), ("3", "'3'")])
def test_bad_top_k_refused(top_k, text):
    with pytest.raises(ValueError, match=r"^top_k .*got " + text + "$"):
        check_sampling(1.0, 1.0, top_k)
    check_sampling(1.0, 1.0, np.int64(3))


def test_an_all_greedy_batch_takes_the_argmax_without_the_draw():
    """A batch whose rows are all greedy skips the draw (a conditional in the one program, no sort of the
    vocabulary): argmax of every row, ties to the lowest id, whatever top-p / top-k say; one sampled row
    brings the draw back for it alone."""
    logits = jnp.asarray(np.random.default_rng(5).normal(size=(3, 50)), jnp.float32).at[1, :4].set(9.0)  # a tie
    keys = jax.random.split(jax.random.key(1), 3)
    p, k = jnp.full(3, 0.5, jnp.float32), jnp.asarray([0, 2, 40], jnp.int32)
    greedy = np.asarray(_sample_rows(logits, keys, jnp.zeros(3, jnp.float32), p, k))
    np.testing.assert_array_equal(greedy, np.argmax(np.asarray(logits), axis=-1))
    assert greedy[1] == 0
    hlo = jax.jit(sample_rows).lower(logits, keys, jnp.zeros(3, jnp.float32), p, k).as_text()
    assert "stablehlo.case" in hlo or "stablehlo.if" in hlo
    mixed = np.asarray(_sample_rows(logits, keys, jnp.asarray([0.0, 1.0, 0.0], jnp.float32), p, k))
    assert mixed[0] == greedy[0] and mixed[2] == greedy[2] and mixed[1] in (0, 1)  # top_k 2 of the tied four


@pytest.mark.parametrize("temps", [[0.0, 0.0, 0.0], [0.0, 1.0, 0.7]])
def test_a_static_greedy_hint_draws_the_same_tokens_without_a_conditional(temps):
    """``all_greedy`` (what the scheduler's one-step draw knows of its requests) picks the branch on the host:
    the same tokens as the conditional's, and no ``case``/``if`` in the program (on a GPU its predicate would be
    copied to the host, which then waits for the queued step)."""
    logits = jnp.asarray(np.random.default_rng(6).normal(size=(3, 64)), jnp.float32)
    keys = jax.random.split(jax.random.key(2), 3)
    t, p, k = jnp.asarray(temps, jnp.float32), jnp.full(3, 0.9, jnp.float32), jnp.asarray([0, 5, 0], jnp.int32)
    hint = all(x == 0.0 for x in temps)
    want = np.asarray(_sample_rows(logits, keys, t, p, k))
    hinted = jax.jit(sample_rows, static_argnames="all_greedy")
    np.testing.assert_array_equal(np.asarray(hinted(logits, keys, t, p, k, all_greedy=hint)), want)
    if not hint:  # the draw itself also serves an all-greedy batch: its greedy rows take the argmax
        np.testing.assert_array_equal(np.asarray(hinted(logits, keys, jnp.zeros(3), p, k, all_greedy=False)),
                                      np.argmax(np.asarray(logits), axis=-1))
    hlo = hinted.lower(logits, keys, t, p, k, all_greedy=hint).as_text()
    assert "stablehlo.case" not in hlo and "stablehlo.if" not in hlo
    assert ("stablehlo.sort" in hlo) == (not hint)  # the argmax alone sorts nothing
