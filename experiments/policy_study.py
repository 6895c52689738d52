r"""Expert-cache policies on real routing: traces of a trained model, replayed offline.

  python experiments/policy_study.py --ckpt=ftjax/assets/stdlib_moe --out_dir=experiments/results/policy
  python experiments/policy_study.py --smoke --ckpt=/tmp/stdlib_moe_smoke --out_dir=/tmp/policy_smoke

Traces. The held-out split of the training corpus (``experiments/train_moe.py``: the stdlib files
whose path hash puts them in the 2% held out, rebuilt deterministically) is encoded with the
checkpoint's tokenizer into one stream; ``--streams`` consecutive windows of ``--stream_len``
tokens from its start are the token streams. Each window runs through the model once (causal,
float32 compute by default); in a causal model the routing of token t does not depend on later
tokens, so the per-layer routed ids of position t are exactly those a batch-1 decode of that
text routes at step t (teacher forcing). The forward is ``train_moe.forward_train`` on the loaded
weights (ftjax's inference pieces; experts computed densely, the same function); the test checks
its routed ids against ``ftjax.Engine``'s. The split is by path hash, so no held-out file
was trained on whatever interpreter runs the study, but the held-out file set and contents are
those of the running interpreter's stdlib (a distribution may ship more or fewer files than the
one that trained; the JSON's ``corpus`` records which).

Replay. Every token is a step; every (step, layer) asks for the token's top-k experts of that
layer (flat ids ``layer * E + expert``), all of which must be resident together (S >= E). A
global cache of S slots serves all layers (DESIGN.md 1.1), cold at the start of each stream; hit
rate = hits / (hits + misses) over all requests of all streams. Policies (victims are always
taken among the resident experts not requested by this same (step, layer)):

* every registered online policy (``ftjax.experts.policies``: one module each, e.g. ``lru``: global
  LRU as FreeToken; ``lookahead``: LRU ordered by the cyclic distance to the layer's next visit;
  ``lfu``: perfect LFU; ``lfru``: LRFU, Lee et al. 2001, whose half-life ``--lfru_half_life_tokens``
  sets): replayed through ftjax's own slot table (``ftjax.experts.slot_table.lookup_layer`` in a
  jitted ``lax.scan``), the one implementation the engine runs. A new policy module is studied with
  no edit here.
* ``belady``: Belady's MIN (Belady 1966, IBM Systems Journal 5(2)): evict the expert whose next
  request is farthest in the future (never again first). Offline: the bound no online policy
  beats (the exchange argument holds with the co-residency constraint, because the victims are
  chosen among the experts not requested now).

Statistics: per layer, share of routings taken by the most popular 10% of experts, normalised
entropy of the routing distribution (1 = uniform), max / mean load; probability that token t+1
reuses an expert of token t at the same layer (mean |R_t+1 & R_t| / k, and P(any)); with the
uniform-routing baselines k/E and 1 - C(E-k, k)/C(E, k).

Next-layer prediction (the signal of speculative prefetch, e.g. Pre-gated MoE, Hwang et al.
2024): layer l+1's router applied to layer l's output residual stream, normed with layer l+1's
``post_attention_layernorm`` weight, predicts layer l+1's top-k; reported as precision and recall
against the experts layer l+1 actually routes, for prefetching k and 2k experts, per layer and
mean (for k predicted experts precision = recall).

Random weights (``--random_preset=NAME``, the benchmarks' case: issue 32's and 33's targets are set on random
weights at a preset's shape): ``ftjax.checkpoint.random_model`` at that preset cut to ``--random_layers`` layers,
and ``--streams`` windows of uniformly random token ids (no corpus, no tokenizer); the same trace, replay and
statistics. Its routing is near uniform, so the hit rates sit near S / (L*E); the next-layer prediction is what it
adds (how well a predicted prefetch would do in the benchmarks).

  JAX_PLATFORMS=cpu python experiments/policy_study.py --random_preset=qwen3-30b-a3b --random_layers=4 --streams=2 \
      --stream_len=96 --policies=lru,belady --out_dir=/tmp/policy   # ~2 min, ~21 GB of host memory on 2 cores

Output (``--out_dir``): ``policy_study.json`` and ``policy_study.png`` (hit rate vs slots per policy;
prediction and reuse per layer); with ``--random_preset``, ``policy_study_random_<preset>_<L>l.{json,png}``.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import common, train_moe  # noqa: E402
from ftjax.checkpoint import load_checkpoint  # noqa: E402
from ftjax.experts.slot_table import LFRU_HALF_LIFE_TOKENS, init_slot_table, lookup_layer  # noqa: E402
from ftjax.checkpoint import CheckpointError  # noqa: E402
from ftjax.experts.slot_table import POLICIES as ONLINE  # noqa: E402
from ftjax.layers.common import rms_norm  # noqa: E402

POLICIES = (*ONLINE, "belady")  # every registered policy (the slot table), then the offline bound (numpy)

FLAGS = flags.FLAGS


class StudyInputError(ValueError):
    """Bad input to :func:`run_study` (a policy, a slot count, a checkpoint without a tokenizer, a stream
    shorter than one window): one line and exit status 1 from the script."""


# ---------------------------------------------------------------------------------------- traces


def heldout_stream(tok, max_files: int) -> tuple[np.ndarray, dict]:
    """The held-out split encoded as train_moe does (int32 [n]) and its corpus stats."""
    texts, stats = train_moe.load_corpus(max_files)
    stream = train_moe.encode_stream(tok, texts["heldout"])
    stats["heldout"]["tokens"] = int(stream.size)
    return stream, stats


def trace(model, windows: np.ndarray, dtype: str, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Routed ids and next-layer predictions of every position of every window.

    windows: int32 [B, T]. Returns (ids int32 [B, T, L, k] in descending routing probability,
    pred int32 [B, T, L-1, 2k]: the top 2k experts that layer l+1's router gives layer l's output
    residual stream (normed by layer l+1's mlp_norm), descending).
    """
    cfg = model.cfg
    params = jax.tree.map(lambda a: a.astype(dtype), train_moe.params_from_loaded(model))
    k2 = min(2 * cfg.top_k, cfg.num_experts)

    @jax.jit
    def run(params, tokens):  # params as an argument: a closure would embed them as constants
        _, _, ids, hs = train_moe.forward_train(params, cfg, tokens)  # ids [L, B*T, k]; hs [L, B, T, D]
        lay = params["layers"]

        def predict(h, norm_w, router_w):
            x = rms_norm(h.reshape(-1, h.shape[-1]), norm_w, cfg.rms_norm_eps)
            probs = jax.nn.softmax((x @ router_w).astype(jnp.float32), axis=-1)
            return jax.lax.top_k(probs, k2)[1]

        pred = jax.vmap(predict)(hs[:-1], lay["mlp_norm"][1:], lay["router"][1:])  # [L-1, B*T, 2k]
        return ids, pred

    all_ids, all_pred = [], []
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch]
        ids, pred = run(params, jnp.asarray(w))
        b, t = w.shape
        all_ids.append(np.asarray(ids).reshape(cfg.num_layers, b, t, -1).transpose(1, 2, 0, 3))
        all_pred.append(np.asarray(pred).reshape(cfg.num_layers - 1, b, t, -1).transpose(1, 2, 0, 3))
    return np.concatenate(all_ids).astype(np.int32), np.concatenate(all_pred).astype(np.int32)


# ---------------------------------------------------------------------------------------- replay


@functools.lru_cache(maxsize=None)
def _slot_table_runner(num_layers: int, num_experts: int, slots: int, policy: str, half_life_tokens: float):
    """Jitted (masks bool [T*L, E]) -> (hits, misses) of one stream from an empty table."""
    @jax.jit
    def run(masks):
        layers = jnp.tile(jnp.arange(num_layers, dtype=jnp.int32), masks.shape[0] // num_layers)

        def body(table, xs):
            layer, m = xs
            out = lookup_layer(table, layer, m, num_experts, policy, half_life_tokens)
            return out.table, (out.n_hit, out.n_miss)
        _, (h, m) = jax.lax.scan(body, init_slot_table(num_layers, num_experts, slots), (layers, masks))
        return h.sum(), m.sum()
    return run


def replay_slot_table(ids: np.ndarray, num_experts: int, slots: int, policy: str,
                      half_life_tokens: float = LFRU_HALF_LIFE_TOKENS) -> tuple[int, int]:
    """(hits, misses) of ftjax's slot table (``lookup_layer`` with ``policy``, a name of
    ``slot_table.POLICIES``) over streams.

    ids: int32 [B, T, L, k]; each stream starts from an empty table. One ``lax.scan`` over the
    T*L (step, layer) lookups of a stream, in decode order. ``half_life_tokens``: for the policies
    that take it (lfru). Raises ValueError for an unknown policy.
    """
    b, t, num_layers, _ = ids.shape
    routed = np.zeros((b, t, num_layers, num_experts), bool)
    np.put_along_axis(routed, ids, True, axis=-1)
    run = _slot_table_runner(num_layers, num_experts, slots, policy, float(half_life_tokens))
    hits = misses = 0
    for s in range(b):
        h, m = run(jnp.asarray(routed[s].reshape(t * num_layers, num_experts)))
        hits, misses = hits + int(h), misses + int(m)
    return hits, misses


def _next_use(flat: np.ndarray) -> np.ndarray:
    """For requests flat int [n_events, k] (event = clock), the clock of each request's next
    request of the same id (int64, a large sentinel when none)."""
    n, k = flat.shape
    nxt = np.full((n, k), np.iinfo(np.int64).max // 4, np.int64)
    last: dict[int, tuple[int, int]] = {}
    for c in range(n - 1, -1, -1):
        for j in range(k):
            x = int(flat[c, j])
            nxt[c, j] = last[x][0] if x in last else nxt[c, j]
        for j in range(k):
            last[int(flat[c, j])] = (c, j)
    return nxt


def replay_belady(ids: np.ndarray, num_experts: int, slots: int) -> tuple[int, int]:
    """(hits, misses) of Belady's MIN over streams (numpy: it reads the future, so it is no slot table policy).

    ids: int32 [B, T, L, k]. Same request model as :func:`replay_slot_table`: event c = t*L + l
    asks for flat ids l*E + ids[b, t, l]; hits are kept; misses fill free slots first, then
    evict, among the resident ids not requested by this event, the ones requested farthest in the
    future (never again first; ties to the lowest flat id). Raises ValueError if slots < num_experts.
    """
    b, t, num_layers, k = ids.shape
    if slots < num_experts:
        raise ValueError(f"slots={slots} < num_experts={num_experts}")
    hits = misses = 0
    for s in range(b):
        flat = (ids[s] + (np.arange(num_layers) * num_experts)[None, :, None]).reshape(t * num_layers, k)
        nxt = _next_use(flat)
        resident = np.zeros(num_layers * num_experts, bool)
        nu = np.zeros(num_layers * num_experts, np.int64)  # next use of resident ids
        used = 0
        for c in range(flat.shape[0]):
            req = flat[c]
            hit = resident[req]
            hits += int(hit.sum())
            new = req[~hit]
            misses += len(new)
            need = used + len(new) - slots
            if need > 0:
                cand = np.flatnonzero(resident)
                cand = cand[~np.isin(cand, req)]
                order = np.lexsort((cand, -nu[cand]))
                resident[cand[order[:need]]] = False
                used -= need
            resident[new] = True
            used += len(new)
            nu[req] = nxt[c]
    return hits, misses


def default_slots(num_layers: int, num_experts: int) -> list[int]:
    """E, 1.25E, 1.5E, 2E, 3E, 4E, 6E, 8E, 12E, ... capped at (and including) L*E/2 (at least E)."""
    top = max(num_experts, num_layers * num_experts // 2)
    mults = [1, 1.25, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    return sorted({int(round(m * num_experts)) for m in mults if m * num_experts <= top} | {top})


# ------------------------------------------------------------------------------------ statistics


def routing_stats(ids: np.ndarray, num_experts: int) -> dict:
    """Popularity skew and token-to-token reuse per layer. ids: int32 [B, T, L, k]."""
    b, t, num_layers, k = ids.shape
    per_layer = []
    top_n = max(1, math.ceil(0.1 * num_experts))
    for layer in range(num_layers):
        counts = np.bincount(ids[:, :, layer].reshape(-1), minlength=num_experts).astype(np.float64)
        p = counts / counts.sum()
        nz = p[p > 0]
        r_prev, r_next = ids[:, :-1, layer], ids[:, 1:, layer]  # [B, T-1, k]
        inter = (r_next[..., :, None] == r_prev[..., None, :]).any(-1).sum(-1)  # [B, T-1]
        per_layer.append({
            "layer": layer, "top10pct_share": float(np.sort(p)[::-1][:top_n].sum()),
            "entropy_norm": float(-(nz * np.log(nz)).sum() / math.log(num_experts)),
            "max_over_mean_load": float(p.max() * num_experts), "unused_experts": int((counts == 0).sum()),
            "reuse_frac": float(inter.mean() / k), "reuse_any": float((inter > 0).mean()),
        })
    mean = {key: float(np.mean([r[key] for r in per_layer])) for key in per_layer[0] if key != "layer"}
    any_baseline = 1.0 - math.comb(num_experts - k, k) / math.comb(num_experts, k) if num_experts >= 2 * k else 1.0
    return {"per_layer": per_layer, "mean": mean, "top10pct_experts": top_n,
            "uniform_baseline": {"top10pct_share": top_n / num_experts, "entropy_norm": 1.0,
                                 "reuse_frac": k / num_experts, "reuse_any": any_baseline}}


def next_layer_prediction(ids: np.ndarray, pred: np.ndarray) -> dict:
    """Precision / recall of predicting layer l+1's routed experts from layer l.

    ids: int32 [B, T, L, k]; pred: int32 [B, T, L-1, 2k] (descending). For prefetch sizes k and
    2k: precision = |predicted & routed| / predicted, recall = |predicted & routed| / k.
    """
    k = ids.shape[-1]
    actual = ids[:, :, 1:]  # [B, T, L-1, k]
    out = {}
    for n in sorted({k, pred.shape[-1]}):
        hit = (pred[..., :n, None] == actual[..., None, :]).any(-2).sum(-1)  # [B, T, L-1]
        per_layer = [{"layer": i + 1, "precision": float(hit[..., i].mean() / n),
                      "recall": float(hit[..., i].mean() / k)} for i in range(actual.shape[2])]
        out[f"prefetch_{n}"] = {"per_layer": per_layer, "mean_precision": float(hit.mean() / n),
                                "mean_recall": float(hit.mean() / k)}
    return out


# ------------------------------------------------------------------------------------------ main


def plot(path: str, results: dict, num_experts: int, nlp: dict, stats: dict, title: str) -> None:
    """Hit rate vs slots per policy (left); next-layer recall and token reuse per layer (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for pol, rows in results.items():
        a.plot([r["slots"] / num_experts for r in rows], [r["hit_rate"] for r in rows], marker="o",
               label=pol, lw=2.5 if pol == "belady" else 1.5, ls="--" if pol == "belady" else "-")
    a.set_xlabel("cache size (slots / E)")
    a.set_ylabel("hit rate")
    a.set_ylim(0, 1)
    a.grid(alpha=0.3)
    a.legend()
    a.set_title("expert cache hit rate (global, decode order)", fontsize=9)
    for key, rows in nlp.items():
        b.plot([r["layer"] for r in rows["per_layer"]], [r["recall"] for r in rows["per_layer"]], "o-",
               label=f"next-layer recall, {key.replace('_', ' ')}")
    lay = stats["per_layer"]
    b.plot([r["layer"] for r in lay], [r["reuse_frac"] for r in lay], "s--", label="reuse by token t+1")
    b.plot([r["layer"] for r in lay], [r["top10pct_share"] for r in lay], "^:", label="share of top 10% experts")
    b.set_xlabel("layer")
    b.set_ylim(0, 1)
    b.grid(alpha=0.3)
    b.legend(fontsize=8)
    b.set_title("routing statistics", fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_study(ckpt: str, streams: int, stream_len: int, max_files: int, slots: list[int] | None,
              policies: list[str], half_life: float, dtype: str, batch: int, random: tuple[str, int] | None = None
              ) -> dict:
    """Traces, replays and statistics; returns the result dict (see the module docstring). ``random``: (preset,
    layers) for random weights at that preset's shape and random token windows instead of ``ckpt`` and its
    held-out corpus (``max_files`` unused).

    Raises:
      ValueError: unknown policy, a slot count outside [E, L*E], or a held-out stream shorter
        than one window.
    """
    for p in policies:
        if p not in POLICIES:
            raise StudyInputError(f"unknown policy {p!r}; expected some of {POLICIES}")
    t0 = time.perf_counter()
    if random is not None:
        from ftjax.checkpoint import random_model
        model = random_model(common.preset_cut(*random), "bfloat16")
    else:
        model = load_checkpoint(ckpt, dtype, progress=False)
    cfg = model.cfg
    L, E, k = cfg.num_layers, cfg.num_experts, cfg.top_k
    slots = slots or default_slots(L, E)
    for s in slots:
        if not E <= s <= L * E:
            raise StudyInputError(f"--slots={s} outside [E={E}, L*E={L * E}]")
    if random is not None:  # uniformly random token ids
        n = streams
        windows = np.random.default_rng(0).integers(0, cfg.vocab_size, (n, stream_len)).astype(np.int32)
        corpus = {"random_tokens": True, "seed": 0}
        ckpt = f"random weights: {random[0]} cut to {L} layers (ftjax.checkpoint.random_model, bfloat16)"
    else:
        if model.tokenizer is None:
            raise StudyInputError(f"{ckpt}: no tokenizer.json")
        stream, corpus = heldout_stream(model.tokenizer, max_files)
        n = min(streams, len(stream) // stream_len)
        if n < 1:
            raise StudyInputError(f"held-out stream has {len(stream)} tokens, fewer than --stream_len={stream_len}")
        windows = stream[: n * stream_len].reshape(n, stream_len)  # ckpt is recorded as given (no machine path)
    ids, pred = trace(model, windows, dtype, batch)
    trace_s = time.perf_counter() - t0
    results: dict[str, list[dict]] = {}
    for p in policies:
        rows = []
        for s in slots:
            t = time.perf_counter()
            h, m = replay_belady(ids, E, s) if p == "belady" else replay_slot_table(ids, E, s, p, half_life)
            rows.append({"slots": s, "slots_over_E": s / E, "hits": h, "misses": m, "hit_rate": h / (h + m),
                         "replay_s": time.perf_counter() - t})
        results[p] = rows
    corpus = {key: v for key, v in corpus.items() if key != "heldout_files"}
    return {
        "meta": common.meta(), "checkpoint": ckpt, "config": {
            "num_layers": L, "num_experts": E, "top_k": k, "hidden_size": cfg.hidden_size,
            "expert_ffn": cfg.expert_ffn, "vocab_size": cfg.vocab_size},
        "flags": {"streams": n, "stream_len": stream_len, "max_files": max_files, "slots": slots,
                  "policies": policies, "lfru_half_life_tokens": half_life, "dtype": dtype},
        "corpus": corpus, "requests": int(ids.size), "trace_s": trace_s,
        "hit_rate": results, "routing_stats": routing_stats(ids, E), "next_layer_prediction":
            next_layer_prediction(ids, pred),
    }


def define_flags() -> None:
    """The command-line flags (defined only when run as a script, so tests can import this module
    beside other scripts)."""
    flags.DEFINE_string("ckpt", os.path.join("ftjax", "assets", "stdlib_moe"), "Trained checkpoint directory.")
    flags.DEFINE_string("out_dir", None, "Where to write policy_study.json and policy_study.png.", required=True)
    flags.DEFINE_boolean("smoke", False, "4 streams of 64 tokens over the smoke corpus subset (24 files): seconds.")
    flags.DEFINE_integer("streams", 8, "Token streams (consecutive held-out windows).")
    flags.DEFINE_integer("stream_len", 512, "Tokens per stream (decode steps).")
    flags.DEFINE_integer("max_files", 0, "Corpus subset as train_moe --max_files (0: all; --smoke: 24).")
    flags.DEFINE_list("slots", None, "Cache sizes S (default: E, 1.25E, 1.5E, 2E, 3E, 4E, 6E, ... up to L*E/2).")
    flags.DEFINE_list("policies", list(POLICIES), f"Policies to replay, of {', '.join(POLICIES)} (default: all).")
    flags.DEFINE_float("lfru_half_life_tokens", LFRU_HALF_LIFE_TOKENS, "lfru: tokens after which a use counts half.")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype of the trace forward.")
    flags.DEFINE_integer("batch", 8, "Streams per forward call.")
    flags.DEFINE_string("random_preset", "", "Random weights at this preset's shape and random token windows instead "
                        "of --ckpt (the benchmarks' case; see the module docstring).")
    flags.DEFINE_integer("random_layers", 3, "Layers of the --random_preset cut (its experts are computed densely "
                         "for every token: ~30 s for 3 qwen3-30b-a3b layers x 2 x 96 tokens on 2 CPU cores).")
    flags.register_validator("random_layers", lambda v: v >= 2, "must be >= 2 (a prediction needs a next layer)")
    common.check_preset("random_preset", allow_empty=True)
    common.check_names("policies", POLICIES)
    common.check_numbers("slots", int, low=1)
    for name in ("streams", "stream_len", "batch"):
        flags.register_validator(name, lambda v: v >= 1, "must be >= 1")
    flags.register_validator("max_files", lambda v: v >= 0, "must be >= 0")
    flags.register_validator("lfru_half_life_tokens", lambda v: v > 0, "must be > 0")


def main(argv):
    del argv
    max_files = FLAGS.max_files or (24 if FLAGS.smoke else 0)
    streams, stream_len = (4, 64) if FLAGS.smoke else (FLAGS.streams, FLAGS.stream_len)
    slots = [int(s) for s in FLAGS.slots] if FLAGS.slots else None
    random = (FLAGS.random_preset, FLAGS.random_layers) if FLAGS.random_preset else None
    if random is not None:
        kinds = sorted(set(common.preset_cut(*random, flag="random_layers").layer_types) - {"full_attention"})
        if kinds:
            raise app.UsageError(f"--random_preset={random[0]}: its {', '.join(kinds)} layers are not in the study's "
                                 "forward (train_moe.forward_train: attention layers only)")
    if random is None and not os.path.isfile(os.path.join(FLAGS.ckpt, "config.json")):
        raise app.UsageError(f"--ckpt={FLAGS.ckpt}: no config.json there (train one: experiments/train_moe.py)")
    if importlib.util.find_spec("matplotlib") is None:  # the figure comes last: say so before the study runs
        raise app.UsageError("the study's figure needs matplotlib: pip install -e '.[train]'")
    try:
        res = run_study(FLAGS.ckpt, streams, stream_len, max_files, slots, FLAGS.policies,
                        FLAGS.lfru_half_life_tokens, FLAGS.dtype, FLAGS.batch, random)
    except (StudyInputError, CheckpointError) as e:
        raise app.UsageError(str(e)) from None
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    stem = f"policy_study_random_{random[0]}_{random[1]}l" if random else "policy_study"
    common.write_json(FLAGS.out_dir, f"{stem}.json", res)
    E = res["config"]["num_experts"]
    nlp = res["next_layer_prediction"]
    source = f"{random[0]} random weights" if random else os.path.basename(os.path.normpath(FLAGS.ckpt))
    plot(os.path.join(FLAGS.out_dir, f"{stem}.png"), res["hit_rate"], E, nlp, res["routing_stats"],
         f"{source}: L={res['config']['num_layers']} E={E} k={res['config']['top_k']}, {res['flags']['streams']} x "
         f"{res['flags']['stream_len']} {'random' if random else 'held-out'} tokens")
    rows = [{"policy": p, **{f"S={r['slots']}": r["hit_rate"] for r in rs}} for p, rs in res["hit_rate"].items()]
    print(common.table(rows, list(rows[0])))
    m = res["routing_stats"]["mean"]
    print(f"top-10% share {m['top10pct_share']:.3f}, entropy {m['entropy_norm']:.3f}, reuse t->t+1 "
          f"{m['reuse_frac']:.3f} (uniform {res['routing_stats']['uniform_baseline']['reuse_frac']:.3f}); "
          + ", ".join(f"next-layer {key}: precision {v['mean_precision']:.3f} recall {v['mean_recall']:.3f}"
                      for key, v in nlp.items()))


if __name__ == "__main__":
    define_flags()
    common.run(main)
