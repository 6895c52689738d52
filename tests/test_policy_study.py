"""experiments/policy_study.py on the smoke checkpoint (tests/train_smoke.py): every registered policy
(``ftjax.experts.policies``) is studied, invariants of the replayed hit rates, Belady's optimality
against exhaustive search, the slot-table replay against replay_policies' per-step replay, and the
traced routing against ftjax's engine."""

from __future__ import annotations

import functools
import itertools
import json
import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from experiments import policy_study, replay_policies  # noqa: E402
from ftjax.checkpoint import load_checkpoint  # noqa: E402
from ftjax.config import EngineConfig  # noqa: E402
from ftjax import Engine  # noqa: E402
from cli_helpers import run_module_app  # noqa: E402
from ftjax.experts import policies  # noqa: E402
from train_smoke import smoke_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow  # a long end-to-end run: .ci/run runs it after the README's test command

ONLINE = policies.names()  # every registered policy; belady is the study's offline bound


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    ckpt = smoke_checkpoint()
    out = str(tmp_path_factory.mktemp("policy"))
    proc = run_module_app("experiments.policy_study", ["--smoke", f"--ckpt={ckpt}", f"--out_dir={out}"],
                          program=os.path.join(REPO, "experiments", "policy_study.py"),
                          define=lambda m: m.define_flags())
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(out, "policy_study.json")) as f:
        return json.load(f), out


def test_outputs_and_sizes(study):
    res, out = study
    with open(os.path.join(out, "policy_study.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert list(res["hit_rate"]) == list(policy_study.POLICIES) == [*ONLINE, "belady"]
    assert res["flags"]["policies"] == list(policy_study.POLICIES)
    assert res["flags"]["slots"] == [8, 10, 12, 16]  # E .. L*E/2 for L=4, E=8
    assert res["requests"] == 4 * 64 * 4 * 2  # streams x tokens x layers x top-k


def test_hit_rate_invariants(study):
    res, _ = study
    hr = res["hit_rate"]
    for pol, rows in hr.items():
        for r in rows:
            assert r["hits"] + r["misses"] == res["requests"]
            assert 0.0 <= r["hit_rate"] <= 1.0
            assert r["hit_rate"] == pytest.approx(r["hits"] / res["requests"])
    for i, bel in enumerate(hr["belady"]):
        for pol in ONLINE:
            assert bel["hits"] >= hr[pol][i]["hits"], (pol, bel["slots"])
    for pol in ("belady", "lru"):
        h = [r["hits"] for r in hr[pol]]
        assert h == sorted(h), pol
    # Real routing has reuse: Belady strictly beats LRU at E slots, and no policy is all-miss.
    assert hr["belady"][0]["hits"] > hr["lru"][0]["hits"] > 0
    for pol in ONLINE:
        assert all(r["hits"] > 0 for r in hr[pol]), pol


def test_routing_statistics(study):
    res, _ = study
    rs = res["routing_stats"]
    assert len(rs["per_layer"]) == 4 and rs["top10pct_experts"] == 1
    for r in rs["per_layer"]:
        assert 1 / 8 <= r["top10pct_share"] <= 1.0
        assert 0.0 < r["entropy_norm"] <= 1.0 + 1e-12
        assert 0.0 <= r["reuse_frac"] <= r["reuse_any"] <= 1.0
    assert rs["uniform_baseline"]["reuse_frac"] == 2 / 8
    nlp = res["next_layer_prediction"]
    assert set(nlp) == {"prefetch_2", "prefetch_4"}
    assert len(nlp["prefetch_2"]["per_layer"]) == 3
    for key in nlp:
        assert 0.0 <= nlp[key]["mean_precision"] <= 1.0 and 0.0 <= nlp[key]["mean_recall"] <= 1.0
    assert nlp["prefetch_2"]["mean_precision"] == pytest.approx(nlp["prefetch_2"]["mean_recall"])
    assert nlp["prefetch_4"]["mean_recall"] >= nlp["prefetch_2"]["mean_recall"]
    assert nlp["prefetch_2"]["mean_recall"] > 2 / 8  # better than guessing on a trained model


def _optimal_misses(ids: np.ndarray, num_experts: int, slots: int) -> int:
    """Fewest misses of any eviction schedule (exhaustive search), ids int [1, T, L, k]."""
    _, t, num_layers, _ = ids.shape
    events = [tuple(int(layer * num_experts + e) for e in ids[0, s, layer])
              for s in range(t) for layer in range(num_layers)]

    @functools.lru_cache(maxsize=None)
    def best(c: int, resident: frozenset) -> int:
        if c == len(events):
            return 0
        req = events[c]
        new = [x for x in req if x not in resident]
        need = len(resident) + len(new) - slots
        cand = sorted(resident - set(req))
        choices = itertools.combinations(cand, need) if need > 0 else [()]
        return len(new) + min(best(c + 1, (resident - set(v)) | set(new)) for v in choices)

    return best(0, frozenset())


def test_belady_is_optimal_on_random_tiny_traces():
    rng = np.random.default_rng(0)
    for trial in range(8):
        num_layers, num_experts, k, slots = 2, 3, 1 + trial % 2, 3 + trial % 3
        ids = np.stack([np.stack([rng.choice(num_experts, k, replace=False) for _ in range(num_layers)])
                        for _ in range(7)])[None].astype(np.int32)  # [1, 7, L, k]
        h, m = policy_study.replay_belady(ids, num_experts, slots)
        assert h + m == ids.size and m == _optimal_misses(ids, num_experts, slots), trial
        for pol in ONLINE:
            oh, om = policy_study.replay_slot_table(ids, num_experts, slots, pol)
            assert oh + om == ids.size and om >= m, (trial, pol)


@pytest.mark.parametrize("policy", ONLINE)
def test_slot_table_replay_matches_replay_policies(policy):
    """The scanned replay equals experiments/replay_policies.replay (one jitted call per step)."""
    rng = np.random.default_rng(1)
    ids = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(4)]) for _ in range(20)])[None]
    masks = []
    for s in range(20):
        m = np.zeros((4, 8), bool)
        np.put_along_axis(m, ids[0, s], True, axis=-1)
        masks.append(m)
    for slots in (8, 13):
        want = replay_policies.replay(masks, 8, slots, policy, skip_first=False)
        assert want["hits"] + want["misses"] == 20 * 4 * 2 and want["hits"] > 0
        assert policy_study.replay_slot_table(ids.astype(np.int32), 8, slots, policy) == (want["hits"], want["misses"])


def test_traced_routing_matches_engine():
    ckpt = smoke_checkpoint()
    model = load_checkpoint(ckpt, "float32", progress=False)
    stream, _ = policy_study.heldout_stream(model.tokenizer, 24)
    window = stream[:64][None]
    ids, pred = policy_study.trace(model, window, "float32", 1)
    assert ids.shape == (1, 64, 4, 2) and pred.shape == (1, 64, 3, 4)
    engine = Engine(model, EngineConfig("resident", max_seq_len=64))
    _, _, _, stats = engine.prefill([window[0].tolist()], engine.new_cache(1))
    want = np.concatenate([np.asarray(s.routed_ids) for s in stats], axis=1)[:, :64]  # [L, T, k]
    np.testing.assert_array_equal(np.sort(ids[0].transpose(1, 0, 2), -1), np.sort(want, -1))


def test_random_weights_study(tmp_path):
    """--random_preset: random weights at the tiny preset cut to 2 layers, random token windows; the JSON and figure
    take the preset's name, the requests count every (token, layer, k), and the 2k prefetch's precision is its
    recall at k scaled by k / 2k (the same hits)."""
    proc = run_module_app("experiments.policy_study", ["--random_preset=tiny", "--random_layers=2", "--streams=2",
                                                       "--stream_len=32", "--policies=lru,belady",
                                                       f"--out_dir={tmp_path}"],
                          program=os.path.join(REPO, "experiments", "policy_study.py"),
                          define=lambda m: m.define_flags())
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "policy_study_random_tiny_2l.json").read_text())
    assert (tmp_path / "policy_study_random_tiny_2l.png").read_bytes()[:4] == b"\x89PNG"
    cfg = res["config"]
    assert cfg["num_layers"] == 2 and res["corpus"] == {"random_tokens": True, "seed": 0}
    assert res["checkpoint"].startswith("random weights: tiny cut to 2 layers")
    assert res["requests"] == 2 * 32 * 2 * cfg["top_k"] and list(res["hit_rate"]) == ["lru", "belady"]
    k = cfg["top_k"]
    nlp = res["next_layer_prediction"]
    assert nlp[f"prefetch_{2 * k}"]["mean_precision"] == pytest.approx(nlp[f"prefetch_{2 * k}"]["mean_recall"] / 2)
    assert 0 < nlp[f"prefetch_{k}"]["mean_recall"] <= nlp[f"prefetch_{2 * k}"]["mean_recall"] <= 1
