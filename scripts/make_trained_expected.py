"""transformers oracle outputs for a trained checkpoint (``experiments/train_moe.py``): writes
``expected.npz`` beside its weights.

Same method as ``scripts/make_fixtures.py`` (whose helpers it reuses): transformers'
``Qwen3MoeForCausalLM`` on the CPU, weights loaded from the checkpoint (bfloat16 on disk) and
upcast with ``model.float()``, eager attention, eager (per-expert loop) experts, one thread,
deterministic algorithms, fixed zip timestamps (re-running gives byte-identical files). Runs in
the fixtures' environment:

    python3.11 -m venv /tmp/fixenv
    /tmp/fixenv/bin/pip install torch==2.13.0 transformers==5.24.0 safetensors numpy
    /tmp/fixenv/bin/python scripts/make_trained_expected.py --ckpt ftjax/assets/stdlib_moe

The prompt is :data:`PROMPT`, Python written for this script (so held out from the stdlib corpus
by construction), encoded with the checkpoint's ``tokenizer.json`` and preceded by ``<s>``.

expected.npz arrays (T prompt tokens, V vocab, L layers, K top-k):
  prompt_text            unicode scalar    :data:`PROMPT`
  prompt_ids             int32 [T]         <s> + tokenizer.json encoding of the prompt
  prompt_logits          float32 [T, V]    full-sequence logits of the prompt (no cache)
  generated_ids          int32 [16]        greedy continuation (eos not stopping)
  step_logits            float32 [16, V]   logits that produced each generated id (step 0 = last
                                           prompt position; later steps from the KV cache)
  prompt_router_topk     int32 [L, T, K]   routed expert ids, descending routing probability
  prompt_router_weights  float32 [L, T, K] their weights after top-k renormalisation
  diagnostics            unicode scalar    JSON: logit and router margins (how close to ties),
                                           versions, the cached-vs-recompute difference
Raises (exits non-zero): the directory has no loadable checkpoint, or a cross-check fails
(cached decode vs no-cache recompute, ``generate`` vs the manual greedy loop, the routers' own
top-k vs the recomputed one).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer
from transformers import Qwen3MoeForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import greedy, load_for_eval, save_npz_deterministic, top2_margin  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CKPT = REPO_ROOT / "ftjax" / "assets" / "stdlib_moe"
BOS_ID = 1
NEW_TOKENS = 16

PROMPT = '''import os
import sys


def read_lines(path, encoding="utf-8"):
    """Return the lines of the file at *path* without their line endings."""
    with open(path, encoding=encoding) as f:
        return [line.rstrip("\\n") for line in f]


class Counter:
    """Count how often each key was added."""

    def __init__(self):
        self.counts = {}

    def add(self, key):
'''


@torch.no_grad()
def routing(model, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """(top-k ids int32 [L, T, K], weights float32 [L, T, K], smallest k-th vs (k+1)-th prob gap),
    checked against what each router module returns."""
    cfg = model.config
    captured: list = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, o: captured.append(o)) for layer in model.model.layers]
    out = model(input_ids=torch.from_numpy(ids.astype(np.int64))[None], use_cache=False, output_router_logits=True)
    for h in hooks:
        h.remove()
    n, e, k = len(ids), cfg.num_experts, cfg.num_experts_per_tok
    rl = torch.stack([r.reshape(n, e) for r in out.router_logits]).float()  # [L, T, E]
    probs = torch.softmax(rl, dim=-1)
    topv, topi = torch.topk(probs, k, dim=-1)
    if cfg.norm_topk_prob:
        topv = topv / topv.sum(-1, keepdim=True)
    assert torch.equal(torch.stack([c[2] for c in captured]).to(topi.dtype), topi)
    assert torch.equal(torch.stack([c[1] for c in captured]).float(), topv)
    s = torch.sort(probs, dim=-1, descending=True).values
    return topi.numpy().astype(np.int32), topv.numpy().astype(np.float32), float((s[..., k - 1] - s[..., k]).min())


@torch.no_grad()
def oracle(ckpt: Path) -> tuple[dict, dict]:
    """The expected.npz arrays and diagnostics for the checkpoint at ``ckpt``."""
    model = load_for_eval(Qwen3MoeForCausalLM, ckpt)
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    ids = np.asarray([BOS_ID] + tok.encode(PROMPT, add_special_tokens=False).ids, np.int32)
    arrays = {"prompt_text": np.array(PROMPT), "prompt_ids": ids}
    full = model(input_ids=torch.from_numpy(ids.astype(np.int64))[None], use_cache=False)
    arrays["prompt_logits"] = full.logits[0].float().numpy().astype(np.float32)
    gen, step_logits, recompute_diff = greedy(model, ids, NEW_TOKENS)
    arrays["generated_ids"], arrays["step_logits"] = gen, step_logits
    np.testing.assert_allclose(arrays["prompt_logits"][-1], step_logits[0], rtol=1e-5, atol=1e-5)
    arrays["prompt_router_topk"], arrays["prompt_router_weights"], gap = routing(model, ids)
    diag = {
        "checkpoint": ckpt.name, "prompt_tokens": int(len(ids)), "generated_ids": gen.tolist(),
        "generated_text": tok.decode(gen.tolist()),
        "min_top1_top2_logit_margin_steps": round(top2_margin(step_logits), 6),
        "min_router_prob_gap_k_vs_k+1_prompt": round(gap, 8),
        "max_abs_diff_cached_vs_recompute_step_logits": float(f"{recompute_diff:.3g}"),
        "max_abs_prompt_logit": float(np.abs(arrays["prompt_logits"]).max()),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "attn_implementation": model.config._attn_implementation,
        "experts_implementation": model.config._experts_implementation,
    }
    arrays["diagnostics"] = np.array(json.dumps(diag, sort_keys=True))
    return arrays, diag


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, default=DEFAULT_CKPT, help="checkpoint directory (written beside)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    arrays, diag = oracle(args.ckpt)
    save_npz_deterministic(args.ckpt / "expected.npz", arrays)
    print(json.dumps(diag, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
