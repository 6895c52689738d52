r"""Trains a ``qwen3_moe`` model from scratch on the Python standard library's own sources.

GPU (one H200; about 2 minutes wall including tokenizer training, compile, evaluations and export,
less when early stopping ends it: at most 550 steps at ~0.12 s a step, the rate of the earlier
2448-step run in 330 s described below; ``--time_budget_s`` = 240 s of total wall time is only a
safety net):

  python experiments/train_moe.py --size=small --out_dir=$OUT/stdlib_moe

A bigger model for GPU studies (not committed; 239M params; at most ~9.5 minutes wall: it stops at
its 1100 steps, by early stopping, or at --time_budget_s=540, whichever comes first):

  python experiments/train_moe.py --size=large --out_dir=$OUT/stdlib_moe_large

CPU smoke (seconds; a tiny model on a tiny subset of the corpus, as the tests run it):

  python experiments/train_moe.py --smoke --out_dir=/tmp/stdlib_moe_smoke

Corpus: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` of the running interpreter
(site-packages / dist-packages excluded; files that are not valid UTF-8 skipped and counted),
sorted by relative path. A file is held out when the first 8 bytes of SHA-256 of its relative
path, read as a big-endian integer, are < 2% of 2**64 (stable across machines and runs); the
rest is the train split. The Python version, file, byte and token counts of both splits are in
``train_metrics.json``. The stdlib is under the PSF licence, which allows this use.

Tokenizer: byte-level BPE (GPT-2 style pre-tokenisation, Radford et al. 2019) trained with the
``tokenizers`` library on the train split; specials ``<pad>`` 0, ``<s>`` 1 (bos), ``</s>`` 2
(eos). Each file is encoded as ``<s> text </s>`` and the files are concatenated into one stream.

Model: the transformers ``Qwen3MoeForCausalLM`` architecture (every layer a routed MoE, SwiGLU
experts, per-head q/k RMSNorm, RoPE, GQA), written with ``ftjax.layers``' pieces (``common.rms_norm``,
``attention.qk``/``rope``, ``attention.attention``, ``moe.route``) so the math is ftjax's inference math. Training
computes the experts densely: every token goes through all E experts as two dense matmuls
(``[N, D] @ [D, E*2F]`` and ``[N, E*F] @ [E*F, D]``) and a combine weight that is the token's
renormalised top-k router weight for its routed experts and 0 elsewhere, i.e.
``y = sum_k w_k * down_k(silu(gate_k x) * up_k x)``, the same function as inference (no
capacity, no token dropping). Load balancing: the Switch Transformer auxiliary loss (Fedus et al.
2021, eq. 4) as transformers' ``load_balancing_loss_func`` writes it,
``aux = E * sum_e f_e * P_e`` with ``f_e`` the fraction of (token, k) routings sent to expert e
(summing to k) and ``P_e`` the mean router probability; its value is top_k under perfect balance.
It is computed per layer and averaged over layers, weighted by ``router_aux_loss_coef``.

Optimisation: AdamW (Loshchilov & Hutter 2019; b1 0.9, b2 0.95, weight decay 0.1 on matrices
only), global-norm clipping at 1.0, linear warmup over ``--warmup`` steps then cosine decay to
10% of ``--lr`` at the planned ``--steps`` (a function of the step only; a run that stops earlier
simply ends part-way down the cosine). float32 master weights, bfloat16 compute (loss and
softmaxes in float32). Batches are random windows of ``seq_len + 1`` tokens sampled on the device
from the train stream (the whole stream lives on the device).

Early stopping; the exported weights are the best held-out ones, not the last. The stdlib corpus
is small: on the H200 machine (Debian's /usr/lib/python3.12, which has no test suite) it is 561
train files, 3.0M tokens, and a run that trained for its whole 330 s time budget (2448 steps x
65,536 tokens = 160M tokens, ~53 epochs) memorised it: train cross entropy fell to 0.094 nats
while held-out loss went 2.87 (step 500) -> 3.65 (1000) -> 4.60 (1500) -> 5.16 (2000) -> 5.39
(end), and the last parameters were the ones exported. So now: held-out loss is evaluated every
``--eval_every`` steps (and at the end) on the weights as exported (rounded to bfloat16); a device
copy of the parameters with the lowest held-out loss so far is kept; training stops when that loss
has not improved for ``--patience`` evaluations, at ``--steps`` or at ``--time_budget_s``
(whichever comes first; ``stopped_by`` in ``train_metrics.json``), and the best copy is exported.
The small size's 550 steps x 65,536 tokens are 36M tokens, ~12 epochs of a 3.0M-token train split
at most. ``train_metrics.json`` holds ``best_step``, ``best_heldout_loss`` (= ``heldout_loss``,
the exported weights'), ``heldout_perplexity``, the whole held-out curve (``heldout_curve``),
``last_heldout_loss``, ``train_tokens_seen`` and ``epochs`` (tokens seen / train-split tokens);
``loss.png`` shows both curves and marks the best step.

Output (``--out_dir``): ``config.json`` (transformers Qwen3MoeConfig layout), ``generation_config.json``,
``model.safetensors`` (bfloat16, HF tensor names; split into ``model-0000i-of-0000n.safetensors``
+ ``model.safetensors.index.json`` when larger than ``--max_shard_mib``), ``tokenizer.json``,
``tokenizer_config.json``, ``train_metrics.json`` and ``loss.png``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import platform
import sys
import sysconfig
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from experiments import common  # noqa: E402
from ftjax.config import ModelConfig  # noqa: E402
from ftjax.layers.attention import attention, qk  # noqa: E402
from ftjax.layers.common import rms_norm  # noqa: E402
from ftjax.layers.moe import route  # noqa: E402
from ftjax.runtime.planner import non_expert_params  # noqa: E402

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
HELDOUT_FRACTION = 0.02


@dataclasses.dataclass(frozen=True)
class Size:
    """Model shape and default run settings of one ``--size``."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    ffn: int
    vocab: int
    seq_len: int
    batch: int
    steps: int
    lr: float
    warmup: int
    time_budget_s: float
    eval_every: int = 100  # held-out evaluation (and early-stopping check) every N steps
    max_files: int = 0  # 0: the whole corpus
    remat: bool = False  # recompute each layer in the backward pass (jax.checkpoint): bounds activations


SIZES = {
    # The committed artefact (ftjax/assets/stdlib_moe): 16.6M params, 33 MB in bfloat16.
    # 550 steps x 65,536 tokens = 36M tokens: ~12 epochs of a 3.0M-token train split at most.
    "small": Size(hidden=192, layers=8, heads=6, kv_heads=2, head_dim=32, experts=32, top_k=4, ffn=96,
                  vocab=4096, seq_len=512, batch=128, steps=550, lr=2e-3, warmup=100, time_budget_s=240),
    # For GPU studies (not committed): 16 layers x 64 experts, top-8, 239M params (478 MB bf16);
    # activations bounded by rematerialisation; fits one 10-minute device command.
    # 1100 steps x 32,768 tokens = 36M tokens, the small size's ~12 epochs at most.
    "large": Size(hidden=384, layers=16, heads=6, kv_heads=2, head_dim=64, experts=64, top_k=8, ffn=192,
                  vocab=8192, seq_len=1024, batch=32, steps=1100, lr=1e-3, warmup=100, time_budget_s=540,
                  remat=True),
    # --smoke: seconds on a CPU. 4 layers x 8 experts so a policy study has sizes E..2E to replay.
    "smoke": Size(hidden=32, layers=4, heads=2, kv_heads=1, head_dim=16, experts=8, top_k=2, ffn=32,
                  vocab=320, seq_len=64, batch=8, steps=60, lr=1e-2, warmup=5, time_budget_s=60, eval_every=10,
                  max_files=24),
}

FLAGS = flags.FLAGS
# Reserved at the end of --time_budget_s for the final evaluation, export and plot (seconds).
EXPORT_RESERVE_S = 20.0


# ---------------------------------------------------------------------------------------- corpus


def stdlib_files(max_files: int = 0) -> tuple[pathlib.Path, list[pathlib.Path]]:
    """(stdlib root, sorted ``*.py`` files under it), site-/dist-packages excluded; first ``max_files`` if > 0."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted((p for p in root.rglob("*.py")
                    if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)),
                   key=lambda p: p.relative_to(root).as_posix())
    return root, files[:max_files] if max_files > 0 else files


def is_heldout(rel_path: str) -> bool:
    """Stable split: SHA-256 of the relative posix path; held out when its first 8 bytes < 2% of 2**64."""
    h = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big")
    return h < HELDOUT_FRACTION * 2**64


def load_corpus(max_files: int = 0) -> tuple[dict[str, list[str]], dict]:
    """Reads the stdlib sources and splits them.

    Returns ({"train": [text, ...], "heldout": [...]}, stats) with stats holding the Python
    version, stdlib path, and per split the file and byte (UTF-8) counts, plus files skipped as
    non-UTF-8. The ``max_files`` subset is taken before the split, but if it leaves a split empty
    its first file is moved to the empty split (smoke runs need both).
    Raises:
      RuntimeError: no ``.py`` files found under the stdlib path.
    """
    root, files = stdlib_files(max_files)
    if not files:
        raise RuntimeError(f"no .py files under {root}")
    texts: dict[str, list[str]] = {"train": [], "heldout": []}
    names: dict[str, list[str]] = {"train": [], "heldout": []}
    skipped = 0
    for p in files:
        rel = p.relative_to(root).as_posix()
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        split = "heldout" if is_heldout(rel) else "train"
        texts[split].append(text)
        names[split].append(rel)
    for a, b in (("train", "heldout"), ("heldout", "train")):
        if not texts[a] and len(texts[b]) > 1:
            texts[a].append(texts[b].pop(0))
            names[a].append(names[b].pop(0))
    stats = {"python": platform.python_version(), "stdlib": str(root), "files_skipped_not_utf8": skipped,
             "split_rule": "sha256(relative path)[:8] < 0.02 * 2**64 -> heldout"}
    for s in texts:
        stats[s] = {"files": len(texts[s]), "bytes": sum(len(t.encode()) for t in texts[s])}
    stats["heldout_files"] = names["heldout"]
    return texts, stats


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (``tokenizers``) trained on ``texts``; specials <pad> 0, <s> 1, </s> 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def encode_stream(tok, texts: list[str]) -> np.ndarray:
    """int32 [n]: ``<s> text </s>`` of every text, concatenated."""
    parts = [np.asarray([BOS_ID] + e.ids + [EOS_ID], np.int32)
             for e in tok.encode_batch(texts, add_special_tokens=False)]
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


# ----------------------------------------------------------------------------------------- model


def model_config(size: Size, vocab: int, max_pos: int) -> ModelConfig:
    """The ftjax ModelConfig of a training size (qwen3_moe, per-head qk norm, top-k renormalised)."""
    return ModelConfig(model_type="qwen3_moe", vocab_size=vocab, hidden_size=size.hidden, num_layers=size.layers,
                       num_heads=size.heads, num_kv_heads=size.kv_heads, head_dim=size.head_dim,
                       num_experts=size.experts, top_k=size.top_k, expert_ffn=size.ffn, norm_topk_prob=True,
                       qk_norm="per_head", rms_norm_eps=1e-6, rope_theta=1e4, tie_word_embeddings=False,
                       max_position_embeddings=max_pos, dtype="bfloat16")


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """float32 params in ftjax's layout (``ftjax.model``), plus the experts stacked per layer:
    ``gate_up`` [L, E, D, 2F] (gate columns first) and ``down`` [L, E, F, D].

    Matrices ~ N(0, 0.02^2) (transformers' ``initializer_range``), output projections (wo, down)
    scaled by 1/sqrt(2L) (GPT-2); norms are ones.
    """
    L, E, D, F, hd = cfg.num_layers, cfg.num_experts, cfg.hidden_size, cfg.expert_ffn, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    keys = iter(jax.random.split(key, 16))
    std, out_std = 0.02, 0.02 / math.sqrt(2 * L)

    def w(shape, s=std):
        return jax.random.normal(next(keys), shape, jnp.float32) * s

    layers = {"attn_norm": jnp.ones((L, D)), "mlp_norm": jnp.ones((L, D)), "wq": w((L, D, q)),
              "wk": w((L, D, kv)), "wv": w((L, D, kv)), "wo": w((L, q, D), out_std), "router": w((L, D, E)),
              "q_norm": jnp.ones((L, hd)), "k_norm": jnp.ones((L, hd)),
              "gate_up": w((L, E, D, 2 * F)), "down": w((L, E, F, D), out_std)}
    return {"embed": w((cfg.vocab_size, D)), "final_norm": jnp.ones((D,)), "lm_head": w((D, cfg.vocab_size)),
            "layers": layers}


def params_from_loaded(model) -> dict:
    """The :func:`init_params` layout from a ``ftjax.checkpoint.LoadedModel`` (its host expert
    banks [L*E, D, 2F] / [L*E, F, D] copied to the default device as [L, E, D, 2F] / [L, E, F, D])."""
    cfg = model.cfg
    L, E, D, F = cfg.num_layers, cfg.num_experts, cfg.hidden_size, cfg.expert_ffn
    layers = dict(model.params["layers"])
    layers["gate_up"] = jnp.asarray(np.asarray(model.host_gate_up).reshape(L, E, D, 2 * F))
    layers["down"] = jnp.asarray(np.asarray(model.host_down).reshape(L, E, F, D))
    head = model.params["embed"].T if cfg.tie_word_embeddings else model.params["lm_head"]
    return {"embed": model.params["embed"], "final_norm": model.params["final_norm"], "lm_head": head,
            "layers": layers}


def moe_dense(cfg: ModelConfig, x: jax.Array, lp: dict) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Routed SwiGLU experts of one layer, computed densely over all E experts.

    x: [N, D] normed MLP input (compute dtype); lp: the layer's params with ``router`` [D, E],
    ``gate_up`` [E, D, 2F], ``down`` [E, F, D]. Returns (y [N, D] in x's dtype, ids int32 [N, k],
    aux float32 scalar: the Switch load-balancing loss of this layer, top_k at perfect balance).
    """
    n, d = x.shape
    e, _, f2 = lp["gate_up"].shape
    f = f2 // 2
    ids, w = route(cfg, x, lp["router"])  # the inference router: softmax f32, top-k, renormalised
    combine = jnp.einsum("nk,nke->ne", w, jax.nn.one_hot(ids, e, dtype=w.dtype))  # [N, E]
    h = (x @ lp["gate_up"].transpose(1, 0, 2).reshape(d, e * f2)).reshape(n, e, f2)
    act = jax.nn.silu(h[..., :f]) * h[..., f:]  # [N, E, F]
    y = (act * combine[..., None]).reshape(n, e * f) @ lp["down"].reshape(e * f, d)
    probs = jax.nn.softmax((x @ lp["router"]).astype(jnp.float32), axis=-1)
    frac = jnp.mean(jax.nn.one_hot(ids, e, dtype=jnp.float32).sum(1), axis=0)  # [E], sums to k
    aux = e * jnp.sum(frac * jnp.mean(probs, axis=0))
    return y.astype(x.dtype), ids, aux


def forward_train(params: dict, cfg: ModelConfig, tokens: jax.Array, remat: bool = False
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Full-sequence causal forward for training (no KV cache).

    params: as :func:`init_params` (any float dtype; computed in params' dtype); tokens: int32
    [B, T]. Returns (logits float32 [B, T, V], mean aux loss over layers (float32 scalar),
    routed ids int32 [L, B*T, k], each layer's output residual stream [L, B, T, D]); outputs
    a caller does not use are dropped by XLA under ``jit``. ``remat``: wrap each layer in
    ``jax.checkpoint`` (recomputed in the backward pass; same values).
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    h = params["embed"][tokens]

    def layer(h, lp):
        x = rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
        q, k, v = qk(cfg, lp, x, positions)
        h = h + attention(q, k, v, positions).reshape(b, t, -1) @ lp["wo"]
        x = rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps).reshape(b * t, -1)
        y, ids, aux = moe_dense(cfg, x, lp)
        h = h + y.reshape(b, t, -1)
        return h, (aux, ids, h)

    h, (aux, ids, hs) = jax.lax.scan(jax.checkpoint(layer) if remat else layer, h, params["layers"])
    h = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    return (h @ params["lm_head"]).astype(jnp.float32), jnp.mean(aux), ids, hs


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross entropy (nats). logits float32 [B, T, V]; targets int32 [B, T]."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    gold = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - gold)


def make_loss(cfg: ModelConfig, aux_coef: float, compute_dtype, remat: bool = False):
    """loss(params, windows int32 [B, T+1]) -> (total, (ce, aux)); params cast to ``compute_dtype``."""
    def loss(params, windows):
        p = jax.tree.map(lambda a: a.astype(compute_dtype), params)
        logits, aux, _, _ = forward_train(p, cfg, windows[:, :-1], remat)
        ce = cross_entropy(logits, windows[:, 1:])
        return ce + aux_coef * aux, (ce, aux)
    return loss


def make_optimizer(lr: float):
    """AdamW (b2 0.95, wd 0.1 on >= 2-D params) after global-norm clipping at 1.0; the learning
    rate is an injected hyperparameter set by the host each step."""
    import optax

    def opt(learning_rate):
        return optax.chain(optax.clip_by_global_norm(1.0),
                           optax.adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=0.1,
                                       mask=lambda p: jax.tree.map(lambda a: a.ndim >= 2, p)))
    return optax.inject_hyperparams(opt)(learning_rate=lr)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Learning rate of 0-based ``step``: linear warmup to ``peak`` over ``warmup`` steps, then cosine
    from ``peak`` to 0.1 * ``peak`` at ``steps`` (a function of the step alone, so stopping early
    only cuts the schedule)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(max(progress, 0.0), 1.0))))


def sample_windows(stream: jax.Array, key: jax.Array, batch: int, length: int) -> jax.Array:
    """int32 [batch, length]: windows of ``stream`` (int32 [n], n > length) at uniform random starts."""
    starts = jax.random.randint(key, (batch,), 0, stream.shape[0] - length + 1)
    return stream[starts[:, None] + jnp.arange(length)[None, :]]


def eval_windows(stream: np.ndarray, length: int, max_windows: int) -> np.ndarray:
    """int32 [n, length]: consecutive non-overlapping windows from the start of ``stream`` (deterministic)."""
    n = min(max_windows, len(stream) // length)
    return stream[: n * length].reshape(n, length)


# ---------------------------------------------------------------------------------------- export


def hf_tensors(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Transformers' tensor names and [out, in] layouts for the trained params, in bfloat16,
    as ``ftjax.checkpoint`` reads them (``_hf_names``, ``_expert_names``). Every array is
    C-contiguous: ``safetensors.numpy.save_file`` writes an array's memory as it lies, so a
    transposed view (``astype`` keeps its Fortran order) would be stored scrambled."""
    bf = lambda a: np.ascontiguousarray(np.asarray(a, np.float32).astype(ml_dtypes.bfloat16))  # noqa: E731
    lay = jax.tree.map(np.asarray, params["layers"])
    out = {"model.embed_tokens.weight": bf(params["embed"]), "model.norm.weight": bf(params["final_norm"]),
           "lm_head.weight": bf(np.asarray(params["lm_head"]).T)}
    F = cfg.expert_ffn
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = bf(lay["attn_norm"][i])
        out[p + "post_attention_layernorm.weight"] = bf(lay["mlp_norm"][i])
        for name, key in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"), ("o_proj", "wo")):
            out[p + f"self_attn.{name}.weight"] = bf(lay[key][i].T)
        out[p + "self_attn.q_norm.weight"] = bf(lay["q_norm"][i])
        out[p + "self_attn.k_norm.weight"] = bf(lay["k_norm"][i])
        out[p + "mlp.gate.weight"] = bf(lay["router"][i].T)
        for j in range(cfg.num_experts):
            q = p + f"mlp.experts.{j}."
            out[q + "gate_proj.weight"] = bf(lay["gate_up"][i, j, :, :F].T)
            out[q + "up_proj.weight"] = bf(lay["gate_up"][i, j, :, F:].T)
            out[q + "down_proj.weight"] = bf(lay["down"][i, j].T)
    return out


def save_safetensors(tensors: dict[str, np.ndarray], out_dir: str, max_shard_bytes: int) -> list[str]:
    """Writes ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` plus
    ``model.safetensors.index.json`` (transformers' layout) when the total exceeds
    ``max_shard_bytes``. Returns the file names written."""
    from safetensors.numpy import save_file
    names = sorted(tensors)
    total = sum(tensors[k].nbytes for k in names)
    meta = {"format": "pt"}
    if total <= max_shard_bytes:
        save_file({k: tensors[k] for k in names}, os.path.join(out_dir, "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    shards, cur, cur_bytes = [], [], 0
    for k in names:
        if cur and cur_bytes + tensors[k].nbytes > max_shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(k)
        cur_bytes += tensors[k].nbytes
    shards.append(cur)
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k] for k in shard}, os.path.join(out_dir, fname), metadata=meta)
        files.append(fname)
        weight_map.update({k: fname for k in shard})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return files + ["model.safetensors.index.json"]


def hf_config(cfg: ModelConfig, aux_coef: float) -> dict:
    """config.json in the layout transformers 5.24 writes for ``Qwen3MoeConfig``."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": BOS_ID, "decoder_sparse_step": 1, "dtype": "bfloat16", "eos_token_id": EOS_ID,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "hidden_size": cfg.hidden_size, "initializer_range": 0.02,
        "intermediate_size": cfg.expert_ffn, "max_position_embeddings": cfg.max_position_embeddings,
        "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": cfg.expert_ffn,
        "norm_topk_prob": True, "num_attention_heads": cfg.num_heads, "num_experts_per_tok": cfg.top_k,
        "num_hidden_layers": cfg.num_layers, "num_key_value_heads": cfg.num_kv_heads,
        "num_local_experts": cfg.num_experts, "output_router_logits": False, "pad_token_id": PAD_ID,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "router_aux_loss_coef": aux_coef, "sliding_window": None, "tie_word_embeddings": False,
        "transformers_version": "5.24.0", "use_cache": True, "use_sliding_window": False,
        "vocab_size": cfg.vocab_size,
    }


def export(out_dir: str, params: dict, cfg: ModelConfig, tok, aux_coef: float, max_shard_bytes: int) -> dict:
    """Writes config.json, generation_config.json, safetensors, tokenizer.json and
    tokenizer_config.json; returns {file name: bytes}."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config(cfg, aux_coef), f, indent=2, sort_keys=True)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"_from_model_config": True, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
                   "pad_token_id": PAD_ID, "transformers_version": "5.24.0", "use_cache": True}, f, indent=2)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"backend": "tokenizers", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
                   "model_max_length": cfg.max_position_embeddings, "tokenizer_class": "TokenizersBackend"},
                  f, indent=2)
    save_safetensors(hf_tensors(params, cfg), out_dir, max_shard_bytes)
    for n in os.listdir(out_dir):  # safetensors creates its files 0600
        os.chmod(os.path.join(out_dir, n), 0o644)
    return {n: os.path.getsize(os.path.join(out_dir, n)) for n in sorted(os.listdir(out_dir))}


def plot_loss(path: str, curve: list[dict], evals: list[dict], title: str, best_step: int | None = None) -> None:
    """Train loss (cross entropy, nats) and held-out loss vs step, as a PNG; ``best_step`` (the
    exported parameters' step) marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([c["step"] for c in curve], [c["ce"] for c in curve], label="train cross entropy")
    ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", label="held-out cross entropy")
    best = [e for e in evals if e["step"] == best_step]
    if best:
        ax.axvline(best_step, color="k", ls=":", lw=1)
        ax.plot([best_step], [best[0]["loss"]], "r*", ms=12, zorder=3,
                label=f"best held-out (exported): step {best_step}, {best[0]['loss']:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ main


def param_counts(cfg: ModelConfig) -> dict:
    """Total, routed-expert, and active-per-token parameter counts."""
    expert = cfg.num_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.expert_ffn
    other = non_expert_params(cfg)
    active = other + cfg.num_layers * cfg.top_k * 3 * cfg.hidden_size * cfg.expert_ffn
    return {"total": expert + other, "routed_experts": expert, "non_expert": other, "active_per_token": active}


def train(size: Size, opts: dict, out_dir: str, t0: float) -> dict:
    """Runs corpus -> tokenizer -> training -> eval -> export; returns the metrics dict."""
    import optax
    texts, corpus = load_corpus(opts["max_files"])
    t = time.perf_counter()
    tok = train_tokenizer(texts["train"], opts["vocab_size"])
    train_stream, held_stream = encode_stream(tok, texts["train"]), encode_stream(tok, texts["heldout"])
    corpus["tokenizer_s"] = time.perf_counter() - t
    corpus["train"]["tokens"], corpus["heldout"]["tokens"] = int(train_stream.size), int(held_stream.size)
    seq_len, batch = opts["seq_len"], opts["batch"]
    cfg = model_config(size, tok.get_vocab_size(), max_pos=max(2048, seq_len))
    counts = param_counts(cfg)
    print(f"corpus: python {corpus['python']}, train {corpus['train']}, heldout {corpus['heldout']['files']} files "
          f"{corpus['heldout']['tokens']} tokens; vocab {cfg.vocab_size}; params {counts['total'] / 1e6:.2f}M "
          f"({counts['active_per_token'] / 1e6:.2f}M active); tokenizer {corpus['tokenizer_s']:.1f} s", flush=True)
    if train_stream.size <= seq_len + 1 or held_stream.size < seq_len + 1:
        raise app.UsageError(f"corpus too small for --seq_len={seq_len}: {train_stream.size} train / "
                             f"{held_stream.size} held-out tokens (more --max_files, or a shorter --seq_len)")

    on_gpu = jax.default_backend() != "cpu"
    compute_dtype = jnp.bfloat16 if on_gpu else jnp.float32
    loss_fn = make_loss(cfg, opts["router_aux_loss_coef"], compute_dtype, size.remat)
    opt = make_optimizer(opts["lr"])
    key = jax.random.key(opts["seed"])
    params = init_params(cfg, jax.random.fold_in(key, 0))
    opt_state = opt.init(params)
    stream = jnp.asarray(train_stream)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step_fn(params, opt_state, stream, step, lr):  # stream is an argument: a closure would embed it as a constant
        windows = sample_windows(stream, jax.random.fold_in(jax.random.fold_in(key, 1), step), batch, seq_len + 1)
        (_, (ce, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, windows)
        opt_state.hyperparams["learning_rate"] = lr
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ce, aux

    @jax.jit
    def eval_rows(params, windows):  # mean cross entropy of each row, float32 [B]
        # The weights as exported: rounded to bfloat16 (export's rounding), then computed in compute_dtype.
        p = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(compute_dtype), params)
        logits, _, _, _ = forward_train(p, cfg, windows[:, :-1])
        logz = jax.nn.logsumexp(logits, axis=-1)
        gold = jnp.take_along_axis(logits, windows[:, 1:, None], axis=-1)[..., 0]
        return jnp.mean(logz - gold, axis=-1)

    held = eval_windows(held_stream, seq_len + 1, opts["eval_windows"])

    def evaluate(params) -> float:
        """Mean held-out cross entropy (nats/token) over ``held``, in fixed-shape batches."""
        rows = []
        for i in range(0, len(held), batch):
            w = held[i:i + batch]
            pad = np.repeat(w[:1], batch - len(w), 0)  # fixed shape (one compile); padded rows dropped
            rows.append(np.asarray(eval_rows(params, jnp.asarray(np.concatenate([w, pad]))))[: len(w)])
        return float(np.mean(np.concatenate(rows)))

    steps, warmup, patience = opts["steps"], opts["warmup"], opts["patience"]
    budget = opts["time_budget_s"]
    train_start = time.perf_counter()
    train_budget = budget - (train_start - t0) - EXPORT_RESERVE_S
    curve, evals = [], []
    best_params, best_step, best_loss, since_best = None, 0, math.inf, 0
    step, compile_s, ce, aux, lr, stopped_by = 0, None, jnp.nan, jnp.nan, 0.0, "steps"
    loop_start, loop_step0 = train_start, 0

    def record_eval() -> None:
        """Evaluates ``params`` at ``step``; keeps a device copy when it is the best so far."""
        nonlocal best_params, best_step, best_loss, since_best
        loss = evaluate(params)
        evals.append({"step": step, "loss": loss, "s": time.perf_counter() - train_start})
        if loss < best_loss:
            best_params = jax.tree.map(jnp.copy, params)  # params are donated to the next step: copy
            best_step, best_loss, since_best = step, loss, 0
        else:
            since_best += 1
        print(f"step {step:6d}  held-out {loss:.4f}  best {best_loss:.4f} @ {best_step}"
              f"{'' if since_best == 0 else f'  ({since_best}/{patience} without improvement)'}", flush=True)

    while step < steps:
        if time.perf_counter() - train_start >= train_budget:
            stopped_by = "time_budget_s"
            break
        lr = lr_at(step, steps, opts["lr"], warmup)
        params, opt_state, ce, aux = step_fn(params, opt_state, stream, jnp.int32(step), jnp.float32(lr))
        step += 1
        if compile_s is None:
            ce.block_until_ready()
            compile_s = time.perf_counter() - train_start
            loop_start, loop_step0 = time.perf_counter(), step
        if step % opts["log_every"] == 0 or step == 1:
            curve.append({"step": step, "ce": float(ce), "aux": float(aux), "lr": lr,
                          "s": time.perf_counter() - train_start})
            print(f"step {step:6d}  ce {float(ce):.4f}  aux {float(aux):.3f}  lr {lr:.2e}  "
                  f"{time.perf_counter() - train_start:.0f} s", flush=True)
        if step % opts["eval_every"] == 0:
            record_eval()
            if since_best >= patience:
                stopped_by = "patience"
                break
    jax.block_until_ready(params)
    loop_s = time.perf_counter() - loop_start if compile_s is not None else 0.0
    trained_tokens = (step - loop_step0) * batch * seq_len if compile_s is not None else 0
    if not curve or curve[-1]["step"] != step:
        curve.append({"step": step, "ce": float(ce), "aux": float(aux), "lr": lr,
                      "s": time.perf_counter() - train_start})
    if not evals or evals[-1]["step"] != step:
        record_eval()  # the end state is a candidate too
    last_loss = evals[-1]["loss"]
    train_s = time.perf_counter() - train_start
    tokens_seen = step * batch * seq_len
    print(f"stopped by {stopped_by} at step {step} ({tokens_seen / train_stream.size:.2f} epochs); exporting "
          f"step {best_step}: held-out {best_loss:.4f} (last {last_loss:.4f})", flush=True)

    t = time.perf_counter()
    files = export(out_dir, best_params, cfg, tok, opts["router_aux_loss_coef"],
                   int(opts["max_shard_mib"] * 2**20))
    export_s = time.perf_counter() - t
    weights = {k: v for k, v in files.items() if k.endswith(".safetensors")}
    print(f"exported {out_dir}: {sum(weights.values()) / 2**20:.2f} MiB of weights in {len(weights)} file(s), "
          f"largest {max(weights.values()) / 2**20:.2f} MiB, {sum(files.values()) / 2**20:.2f} MiB in all", flush=True)
    corpus_out = {k: v for k, v in corpus.items() if k != "heldout_files"}
    corpus_out["heldout_files_first"] = corpus["heldout_files"][:20]
    return {
        "meta": common.meta(), "flags": opts, "config": dataclasses.asdict(cfg), "params": counts,
        "corpus": corpus_out, "compute_dtype": jnp.dtype(compute_dtype).name,
        "steps_done": step, "stopped_by": stopped_by,
        "exported": "the best held-out parameters (best_step), not the last",
        "best_step": best_step, "best_heldout_loss": best_loss,
        "heldout_loss": best_loss, "heldout_perplexity": math.exp(best_loss),
        "last_heldout_loss": last_loss, "last_heldout_perplexity": math.exp(last_loss),
        "train_tokens_seen": tokens_seen, "epochs": tokens_seen / train_stream.size,
        "loss_curve": curve, "heldout_curve": evals,
        "heldout_tokens_evaluated": int(len(held) * seq_len), "initial_loss_uniform": math.log(cfg.vocab_size),
        "tokens_per_s": trained_tokens / loop_s if loop_s > 0 else None, "compile_s": compile_s,
        "train_s": train_s, "export_s": export_s, "files": files,
    }


def define_flags() -> None:
    """The command-line flags (defined only when run as a script, so other scripts can import
    this module without flag clashes)."""
    flags.DEFINE_enum("size", "small", ["small", "large"], "Model size (small = the committed artefact).")
    flags.DEFINE_boolean("smoke", False, "Tiny model on a tiny corpus subset, seconds on a CPU (overrides --size).")
    flags.DEFINE_integer("steps", None, "Optimizer steps (default: the size's).")
    flags.DEFINE_integer("batch", None, "Sequences per step (default: the size's).")
    flags.DEFINE_integer("seq_len", None, "Tokens per training sequence (default: the size's).")
    flags.DEFINE_float("lr", None, "Peak learning rate (default: the size's).")
    flags.DEFINE_integer("warmup", None, "Linear warmup steps (default: the size's).")
    flags.DEFINE_float("time_budget_s", None, "Wall seconds for the whole run, tokenizer to export; a safety net: "
                       "training stops early (and still evaluates and exports the best parameters) to stay "
                       "within it (default: the size's).")
    flags.DEFINE_float("router_aux_loss_coef", 0.01, "Weight of the load-balancing loss (Switch Transformer: 0.01).")
    flags.DEFINE_integer("vocab_size", None, "BPE vocabulary size (default: the size's).")
    flags.DEFINE_integer("max_files", None, "Use only the first N corpus files (0: all; default: the size's).")
    flags.DEFINE_integer("eval_every", None, "Evaluate held-out loss every N steps (and at the end); the early-"
                         "stopping check (default: the size's: 100 for small and large, 10 for --smoke).")
    flags.DEFINE_integer("patience", 5, "Stop when held-out loss has not improved for this many evaluations.")
    flags.DEFINE_integer("eval_windows", 256, "Held-out windows of seq_len tokens per evaluation (at most).")
    flags.DEFINE_integer("log_every", 50, "Record the train loss every N steps.")
    flags.DEFINE_float("max_shard_mib", 12.0, "Largest safetensors file (MiB); bigger checkpoints are sharded.")
    flags.DEFINE_integer("seed", 0, "Seed of init and batch sampling.")
    flags.DEFINE_string("out_dir", None, "Where to write the checkpoint and metrics.", required=True)


def resolve_opts() -> tuple[Size, dict]:
    """The Size and the effective settings: flags override the size's defaults."""
    size = SIZES["smoke" if FLAGS.smoke else FLAGS.size]
    pick = lambda flag, default: default if flag is None else flag  # noqa: E731
    opts = {
        "size": "smoke" if FLAGS.smoke else FLAGS.size, "steps": pick(FLAGS.steps, size.steps),
        "batch": pick(FLAGS.batch, size.batch), "seq_len": pick(FLAGS.seq_len, size.seq_len),
        "lr": pick(FLAGS.lr, size.lr), "warmup": pick(FLAGS.warmup, size.warmup),
        "time_budget_s": pick(FLAGS.time_budget_s, size.time_budget_s),
        "router_aux_loss_coef": FLAGS.router_aux_loss_coef, "vocab_size": pick(FLAGS.vocab_size, size.vocab),
        "max_files": pick(FLAGS.max_files, size.max_files), "eval_every": pick(FLAGS.eval_every, size.eval_every),
        "patience": FLAGS.patience,
        "eval_windows": FLAGS.eval_windows, "log_every": FLAGS.log_every, "max_shard_mib": FLAGS.max_shard_mib,
        "seed": FLAGS.seed, "out_dir": FLAGS.out_dir,
    }
    for k in ("steps", "batch", "seq_len", "warmup", "vocab_size", "eval_every", "patience", "eval_windows",
              "log_every"):
        if opts[k] < 1:
            raise app.UsageError(f"--{k} must be >= 1, got {opts[k]}")
    if opts["vocab_size"] < 260:
        raise app.UsageError(f"--vocab_size must be >= 260 (256 bytes + 3 specials), got {opts['vocab_size']}")
    for k in ("lr", "time_budget_s", "max_shard_mib"):
        if not opts[k] > 0:
            raise app.UsageError(f"--{k} must be > 0, got {opts[k]}")
    if opts["router_aux_loss_coef"] < 0 or opts["max_files"] < 0:
        raise app.UsageError("--router_aux_loss_coef and --max_files must be >= 0")
    return size, opts


def main(argv):
    del argv
    t0 = time.perf_counter()
    size, opts = resolve_opts()
    metrics = train(size, opts, FLAGS.out_dir, t0)
    metrics["wall_s"] = time.perf_counter() - t0
    plot_loss(os.path.join(FLAGS.out_dir, "loss.png"), metrics["loss_curve"], metrics["heldout_curve"],
              f"qwen3_moe {opts['size']}: {metrics['params']['total'] / 1e6:.1f}M params; exported step "
              f"{metrics['best_step']}, held-out ppl {metrics['heldout_perplexity']:.2f}\n"
              f"{metrics['steps_done']} steps, {metrics['epochs']:.2f} epochs, stopped by {metrics['stopped_by']}",
              metrics["best_step"])
    common.write_json(FLAGS.out_dir, "train_metrics.json", metrics)
    print(f"exported step {metrics['best_step']}: held-out loss {metrics['heldout_loss']:.4f} "
          f"(ppl {metrics['heldout_perplexity']:.2f}); {metrics['steps_done']} steps "
          f"({metrics['epochs']:.2f} epochs), stopped by {metrics['stopped_by']}; "
          f"{metrics['tokens_per_s'] or 0:.0f} tokens/s; wall {metrics['wall_s']:.1f} s", flush=True)


if __name__ == "__main__":
    define_flags()
    common.run(main)
