"""Build tiny random MoE checkpoints + Hugging Face transformers oracle outputs.

The fixtures under ``tests/fixtures/`` are the reference ("oracle") against which
the ftjax JAX implementation is tested.  Everything here is produced by
Hugging Face transformers on CPU in float32 with eager attention and the eager
(per-expert loop) experts implementation.

Regenerate (from the repository root):

    python3.11 -m venv /tmp/fixenv
    /tmp/fixenv/bin/pip install torch==2.13.0 transformers==5.24.0 safetensors numpy
    /tmp/fixenv/bin/python scripts/make_fixtures.py

(``tokenizers`` is installed as a transformers dependency; the script was last run
with tokenizers 0.23.3 and safetensors 0.8.0.)  The script is deterministic:
fixed torch / numpy seeds, one CPU thread, fixed zip timestamps in the ``.npz``
files, so re-running it reproduces byte-identical files.  Pass ``--out DIR`` to
write somewhere other than ``tests/fixtures``.

Fixtures written (``tests/fixtures/<name>/``):

* ``qwen3_moe_fp32``     Qwen3MoeConfig, float32, norm_topk_prob=False
* ``qwen3_moe_bf16``     Qwen3MoeConfig, weights stored in bfloat16, norm_topk_prob=True
                         (expected outputs: bf16 weights loaded then upcast with
                         ``model.float()``, i.e. float32 compute)
* ``olmoe_fp32``         OlmoeConfig, float32 (q_norm over full q width, k_norm over kv width)
* ``mixtral_fp32``       MixtralConfig, float32, sliding_window=None, tie_word_embeddings=True
* ``qwen3_moe_sharded``  the exact qwen3_moe_fp32 weights saved with max_shard_size="200KB"
                         (model.safetensors.index.json + several shards)
* ``qwen3_5_moe_fp32``   Qwen3_5MoeTextConfig (Qwen3_5MoeForCausalLM), float32: the hybrid
                         family, 8 layers = 2 blocks of (3 Gated DeltaNet, 1 gated attention),
                         shared expert, partial RoPE; its own smaller sizes (QWEN35_DIMS)
* ``qwen3_5_moe_bf16``   the same family stored in bfloat16 (expected: bf16 weights, model.float())

The qwen3_5_moe fixtures' long prompt (300 tokens) spans several 64-token chunks of the chunked
gated delta rule, which transformers' torch path (no flash-linear-attention installed) runs.

Each folder holds: config.json, generation_config.json, model*.safetensors
(+ index), tokenizer.json, tokenizer_config.json and expected.npz.
``tests/fixtures/manifest.json`` summarises all fixtures.

expected.npz arrays (V = vocab 384, L = 3 layers, K = top-k 2):
  short_prompt_ids   int32 [12]        random ids in [3, V)
  long_prompt_ids    int32 [300]       random ids in [3, V)
  short_prompt_logits float32 [12, V]  full-sequence logits of the short prompt
  short_generated_ids int32 [16]       greedy continuation (no eos stopping)
  short_step_logits  float32 [16, V]   logits that produced each generated token
                                       (step 0 = last prompt position)
  long_generated_ids / long_step_logits  same for the long prompt
  long_router_logits float32 [L, 300, E] raw router logits per layer (long prompt)
  long_router_topk   int32 [L, 300, K] top-k expert ids per layer/token, in
                                       descending routing-probability order
  long_router_weights float32 [L, 300, K] the routing weights applied to those experts
                                       (after norm_topk_prob renormalisation where it applies)
  text_prompt        unicode scalar     a short English text
  text_prompt_ids    int32 [n]          tokenizer.json encoding of text_prompt (no special tokens)
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import torch

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures"

VOCAB = 384
HIDDEN = 64
LAYERS = 3
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
EXPERTS = 8
TOP_K = 2
FFN = 32
MAX_POS = 1024
ROPE_THETA = 10000.0
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

SHORT_LEN = 12
LONG_LEN = 300
NEW_TOKENS = 16
PROMPT_SEED = 1234
# Weight re-randomisation (HF's default init, std 0.02, gives near-flat routing/logits and greedy
# decodes that repeat one token).  Embedding rows ~ N(0, EMBED_STD); every other matrix
# (incl. router, experts, lm_head) ~ N(0, (WEIGHT_GAIN / sqrt(fan_in))^2); norm weights ~ 1 + N(0, NORM_STD).
EMBED_STD = 1.0
WEIGHT_GAIN = 2.0
NORM_STD = 0.1

TEXT_PROMPT = "The quick brown fox jumps over the lazy dog. Experts route tokens"

# Small embedded corpus for training the byte-level BPE tokenizer.
CORPUS = """
The quick brown fox jumps over the lazy dog. A mixture of experts model routes
each token to a small number of experts. The router picks the top experts for
every token, and the outputs of the chosen experts are mixed with the routing
weights. Serving a large model on a small device needs care: the expert weights
can be kept in host memory and copied to the accelerator when they are needed.
This is called expert offload. A cache keeps the most used experts close to the
compute, while the rest stay in slower memory. The attention layers keep a key
and value cache for every token that has been seen, so that decoding one new
token does not need to recompute the whole prompt. Greedy decoding picks the most
likely next token at every step. Tests compare the outputs of a new program with
the outputs of a trusted reference, token by token and logit by logit.
Once upon a time there was a small model that wanted to learn to speak. It read
many books about the sea, the mountains, the rivers and the stars. Every day it
learned a few new words, and every night it dreamed about the words it had read.
One, two, three, four, five, six, seven, eight, nine, ten. Hello world!
"""

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2


# --------------------------------------------------------------------------- utils


def save_npz_deterministic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Like np.savez (uncompressed) but with fixed zip timestamps, so bytes are reproducible."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for name in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asarray(arrays[name]), allow_pickle=False)
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_STORED
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([line for line in CORPUS.strip().splitlines()], trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=MAX_POS,
    )


def common_config_kwargs() -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        initializer_range=0.02,  # irrelevant: randomize_() re-draws every parameter
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        num_experts_per_tok=TOP_K,
    )


def make_qwen3(norm_topk_prob: bool):
    cfg = Qwen3MoeConfig(
        **common_config_kwargs(),
        head_dim=HEAD_DIM,
        num_experts=EXPERTS,
        moe_intermediate_size=FFN,
        intermediate_size=FFN,
        norm_topk_prob=norm_topk_prob,
        tie_word_embeddings=False,
        use_sliding_window=False,
    )
    return cfg, Qwen3MoeForCausalLM


def make_olmoe():
    cfg = OlmoeConfig(
        **common_config_kwargs(),
        num_experts=EXPERTS,
        intermediate_size=FFN,
        norm_topk_prob=False,
        tie_word_embeddings=False,
    )
    return cfg, OlmoeForCausalLM


def make_mixtral():
    cfg = MixtralConfig(
        **common_config_kwargs(),
        head_dim=HEAD_DIM,
        num_local_experts=EXPERTS,
        intermediate_size=FFN,
        sliding_window=None,
        tie_word_embeddings=True,
    )
    return cfg, MixtralForCausalLM


# The hybrid fixtures' sizes: smaller than the others (8 layers instead of 3, so the files stay
# under ~1 MB), with the Gated DeltaNet shape of their own.
QWEN35_DIMS = dict(
    hidden_size=32,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=EXPERTS,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)


def make_qwen3_5():
    kw = common_config_kwargs()
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        kw.pop(k)
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": ROPE_THETA, "partial_rotary_factor": 0.25,
                             "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    cfg = Qwen3_5MoeTextConfig(**kw, **QWEN35_DIMS, full_attention_interval=4, tie_word_embeddings=False)
    return cfg, Qwen3_5MoeForCausalLM


def randomize_qwen3_5_(model: torch.nn.Module, seed: int) -> None:
    """After randomize_: zero-centred RMSNorm weights (scale 1 + w) ~ N(0, NORM_STD); per-head
    decay rates exp(A_log) ~ U(0.02, 0.3) and dt_bias ~ N(0, 0.5), so the recurrent state keeps
    information across several 64-token chunks (with randomize_'s ~1 they decay within a token)."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name == "model.norm.weight":
                p.copy_(NORM_STD * torch.randn(p.shape, generator=gen))
            elif name.endswith("A_log"):
                p.copy_(torch.log(0.02 + 0.28 * torch.rand(p.shape, generator=gen)))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter (see EMBED_STD / WEIGHT_GAIN / NORM_STD)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # named_parameters() de-duplicates tied params, so a tied lm_head follows embed_tokens.
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim == 1:
                p.copy_(1.0 + NORM_STD * noise)
            elif "embed_tokens" in name:
                p.copy_(EMBED_STD * noise)
            else:  # [out, in] linears and [E, out, in] fused experts: fan_in is the last dim
                p.copy_((WEIGHT_GAIN / p.shape[-1] ** 0.5) * noise)


def build_model(cfg, cls, seed: int):
    torch.manual_seed(seed)
    model = cls(cfg)
    randomize_(model, seed)
    if cfg.model_type == "qwen3_5_moe_text":
        randomize_qwen3_5_(model, seed)
    return model.eval()


def load_for_eval(cls, path: Path) -> torch.nn.Module:
    model = cls.from_pretrained(path, attn_implementation="eager", experts_implementation="eager")
    model = model.float().eval()  # bf16 checkpoints: upcast, compute in float32
    assert model.config._attn_implementation == "eager"
    assert model.config._experts_implementation == "eager"
    return model


# --------------------------------------------------------------------------- oracle


@torch.no_grad()
def greedy(model, prompt: np.ndarray, n_new: int):
    ids = torch.from_numpy(prompt.astype(np.int64))[None]
    out = model(input_ids=ids, use_cache=True)
    cache = out.cache
    logits = out.logits[0, -1].float()
    gen, step_logits = [], []
    for step in range(n_new):
        tok = int(torch.argmax(logits))
        gen.append(tok)
        step_logits.append(logits.numpy().copy())
        if step == n_new - 1:
            break
        out = model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True)
        cache = out.cache
        logits = out.logits[0, -1].float()
    gen = np.asarray(gen, dtype=np.int32)
    step_logits = np.stack(step_logits).astype(np.float32)

    # Cross-check 1: no-cache recompute of the whole sequence gives the same logits.
    full = torch.from_numpy(np.concatenate([prompt, gen[:-1]]).astype(np.int64))[None]
    ref = model(input_ids=full, use_cache=False).logits[0, len(prompt) - 1 :].float().numpy()
    np.testing.assert_allclose(ref, step_logits, rtol=1e-3, atol=1e-3)
    recompute_diff = float(np.abs(ref - step_logits).max())
    # Cross-check 2: model.generate (greedy, eos disabled) agrees.
    g = model.generate(
        input_ids=torch.from_numpy(prompt.astype(np.int64))[None],
        do_sample=False,
        max_new_tokens=n_new,
        eos_token_id=None,
        pad_token_id=PAD_ID,
    )
    assert np.array_equal(g[0, len(prompt) :].numpy(), gen), (g, gen)
    return gen, step_logits, recompute_diff


def top2_margin(logits: np.ndarray) -> float:
    s = np.sort(logits, axis=-1)
    return float(np.min(s[..., -1] - s[..., -2]))


@torch.no_grad()
def oracle(model, short_ids, long_ids, tokenizer) -> tuple[dict, dict]:
    cfg = model.config
    arrays: dict[str, np.ndarray] = {}
    arrays["short_prompt_ids"] = short_ids.astype(np.int32)
    arrays["long_prompt_ids"] = long_ids.astype(np.int32)

    short_full = model(input_ids=torch.from_numpy(short_ids.astype(np.int64))[None], use_cache=False)
    arrays["short_prompt_logits"] = short_full.logits[0].float().numpy().astype(np.float32)

    recompute_diff = {}
    for tag, prompt in (("short", short_ids), ("long", long_ids)):
        gen, step_logits, recompute_diff[tag] = greedy(model, prompt, NEW_TOKENS)
        arrays[f"{tag}_generated_ids"] = gen
        arrays[f"{tag}_step_logits"] = step_logits
    np.testing.assert_allclose(
        arrays["short_prompt_logits"][-1], arrays["short_step_logits"][0], rtol=1e-5, atol=1e-5
    )

    # Capture what each router module itself returns: (router_logits, router_scores, router_indices).
    captured: list = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, o: captured.append(o)) for layer in model.model.layers
    ]
    out = model(
        input_ids=torch.from_numpy(long_ids.astype(np.int64))[None], use_cache=False, output_router_logits=True
    )
    for h in hooks:
        h.remove()
    n_layers = cfg.num_hidden_layers
    assert len(captured) == n_layers
    rl = out.router_logits
    assert isinstance(rl, tuple) and len(rl) == n_layers, type(rl)
    rl = torch.stack([r.reshape(len(long_ids), EXPERTS) for r in rl]).float()  # [L, T, E]
    probs = torch.softmax(rl, dim=-1)
    topv, topi = torch.topk(probs, TOP_K, dim=-1)
    # Mixtral and Qwen3.5-MoE always renormalise (neither config has norm_topk_prob)
    norm = bool(getattr(cfg, "norm_topk_prob", False)) or cfg.model_type in ("mixtral", "qwen3_5_moe_text")
    if norm:
        topv = topv / topv.sum(-1, keepdim=True)
    # Our recomputation must match the routers' own top-k ids and routing weights exactly.
    assert torch.equal(torch.stack([c[2] for c in captured]).to(topi.dtype), topi)
    assert torch.equal(torch.stack([c[1] for c in captured]).float(), topv)
    arrays["long_router_logits"] = rl.numpy().astype(np.float32)
    arrays["long_router_topk"] = topi.numpy().astype(np.int32)
    arrays["long_router_weights"] = topv.numpy().astype(np.float32)

    arrays["text_prompt"] = np.array(TEXT_PROMPT)
    arrays["text_prompt_ids"] = np.asarray(
        tokenizer(TEXT_PROMPT, add_special_tokens=False)["input_ids"], dtype=np.int32
    )

    # Diagnostics: how close are argmax / routing decisions to ties (for choosing test tolerances).
    sorted_p = torch.sort(probs, dim=-1, descending=True).values
    diag = {
        "short_generated_ids": arrays["short_generated_ids"].tolist(),
        "long_generated_ids": arrays["long_generated_ids"].tolist(),
        "min_top1_top2_logit_margin_short_steps": round(top2_margin(arrays["short_step_logits"]), 6),
        "min_top1_top2_logit_margin_long_steps": round(top2_margin(arrays["long_step_logits"]), 6),
        "min_router_prob_gap_k_vs_k+1_long": round(
            float((sorted_p[..., TOP_K - 1] - sorted_p[..., TOP_K]).min()), 6
        ),
        # HF's own float32 noise: cached decode vs. full no-cache recompute of the same positions
        "max_abs_diff_cached_vs_recompute_step_logits": {k: float(f"{v:.3g}") for k, v in recompute_diff.items()},
        "experts_used_per_layer_long": [int(len(np.unique(t))) for t in arrays["long_router_topk"]],
        "logit_std_short_prompt": round(float(arrays["short_prompt_logits"].std()), 4),
        "expert_implementation": cfg._experts_implementation,
        "attn_implementation": cfg._attn_implementation,
        "router_weights_renormalised": norm,
    }
    return arrays, diag


# --------------------------------------------------------------------------- main


# Weight seeds were picked once (search over seeds 100..124) to maximise the smallest
# top1-top2 logit margin over all 32 greedy steps and keep the smallest router k-th vs
# (k+1)-th probability gap >= ~1e-4, so tiny numeric differences in a re-implementation are
# unlikely to flip a greedy token or an expert choice.  See manifest.json "diagnostics".
QWEN35_FP32_SEED, QWEN35_BF16_SEED = 200, 201
FIXTURES = [
    # name, builder, seed, stored dtype, save kwargs
    ("qwen3_moe_fp32", lambda: make_qwen3(norm_topk_prob=False), 121, torch.float32, {}),
    ("qwen3_moe_bf16", lambda: make_qwen3(norm_topk_prob=True), 100, torch.bfloat16, {}),
    ("olmoe_fp32", make_olmoe, 114, torch.float32, {}),
    ("mixtral_fp32", make_mixtral, 122, torch.float32, {}),
    # same builder + seed as qwen3_moe_fp32 -> identical weights, only sharded on disk
    ("qwen3_moe_sharded", lambda: make_qwen3(norm_topk_prob=False), 121, torch.float32, {"max_shard_size": "200KB"}),
    ("qwen3_5_moe_fp32", make_qwen3_5, QWEN35_FP32_SEED, torch.float32, {}),
    ("qwen3_5_moe_bf16", make_qwen3_5, QWEN35_BF16_SEED, torch.bfloat16, {}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", default="", help="comma-separated fixture names: write only these and update their "
                    "manifest entries, leaving the other fixtures and entries as they are")
    args = ap.parse_args()
    only = [n for n in args.only.split(",") if n]
    unknown = sorted(set(only) - {f[0] for f in FIXTURES})
    if unknown:
        ap.error(f"unknown fixture(s) {unknown}; known: {[f[0] for f in FIXTURES]}")
    out_root: Path = args.out
    out_root.mkdir(parents=True, exist_ok=True)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    tokenizer = build_tokenizer()
    rng = np.random.default_rng(PROMPT_SEED)
    short_ids = rng.integers(3, VOCAB, size=SHORT_LEN).astype(np.int32)
    long_ids = rng.integers(3, VOCAB, size=LONG_LEN).astype(np.int32)

    manifest = {
        "generator": "scripts/make_fixtures.py",
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "tokenizers": __import__("tokenizers").__version__,
            "safetensors": __import__("safetensors").__version__,
        },
        "dims": {
            "vocab_size": VOCAB,
            "hidden_size": HIDDEN,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "num_experts": EXPERTS,
            "top_k": TOP_K,
            "expert_intermediate_size": FFN,
            "max_position_embeddings": MAX_POS,
            "rope_theta": ROPE_THETA,
        },
        "prompts": {"short_len": SHORT_LEN, "long_len": LONG_LEN, "new_tokens": NEW_TOKENS, "text_prompt": TEXT_PROMPT},
        "expected_compute_dtype": "float32",
        "fixtures": {},
    }

    if only:  # keep the manifest's other entries (and its versions) as they are
        versions = manifest["versions"]
        manifest = json.loads((out_root / "manifest.json").read_text())
    for name, builder, seed, dtype, save_kwargs in FIXTURES:
        if only and name not in only:
            continue
        cfg, cls = builder()
        model = build_model(cfg, cls, seed)
        if dtype != torch.float32:
            model = model.to(dtype)
            model.config.dtype = dtype
        d = out_root / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        model.save_pretrained(d, safe_serialization=True, **save_kwargs)
        tokenizer.save_pretrained(d)
        for f in d.iterdir():  # transformers writes *.safetensors with mode 0600
            f.chmod(0o644)
        # The saved tokenizer must load both ways and agree.
        tok_auto = AutoTokenizer.from_pretrained(d)
        tok_raw = Tokenizer.from_file(str(d / "tokenizer.json"))
        assert tok_auto(TEXT_PROMPT, add_special_tokens=False)["input_ids"] == tok_raw.encode(
            TEXT_PROMPT, add_special_tokens=False
        ).ids
        assert tok_raw.decode(tok_raw.encode(TEXT_PROMPT).ids) == TEXT_PROMPT

        # Reload from disk: the oracle is computed from what the checkpoint holds.
        ref_state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
        del model
        model = load_for_eval(cls, d)
        for k, v in model.state_dict().items():
            assert k in ref_state, k
            assert torch.equal(v, ref_state[k]), f"{name}: reload mismatch for {k}"

        arrays, diag = oracle(model, short_ids, long_ids, tokenizer)
        save_npz_deterministic(d / "expected.npz", arrays)

        c = model.config
        files = sorted(p.name for p in d.iterdir())
        manifest["fixtures"][name] = {
            "family": c.model_type,
            "architecture": c.architectures[0],
            "stored_dtype": str(dtype).replace("torch.", ""),
            "tie_word_embeddings": bool(c.tie_word_embeddings),
            "norm_topk_prob": bool(getattr(c, "norm_topk_prob", True)) if c.model_type != "mixtral" else None,
            "router_weights_renormalised": diag.pop("router_weights_renormalised"),
            "sharded": bool(save_kwargs.get("max_shard_size")),
            "weight_seed": seed,
            "files": files,
            "diagnostics": diag,
        }
        if c.model_type == "mixtral":
            manifest["fixtures"][name]["note"] = "Mixtral always renormalises top-k weights (no norm_topk_prob key)"
        if name == "qwen3_moe_sharded":
            manifest["fixtures"][name]["same_weights_as"] = "qwen3_moe_fp32"
        if dtype == torch.bfloat16:
            manifest["fixtures"][name]["expected_from"] = "bf16 weights loaded, model.float(), float32 compute"
        if c.model_type == "qwen3_5_moe_text":
            manifest["fixtures"][name]["dims"] = {**QWEN35_DIMS, "layer_types": list(c.layer_types),
                                                  "rope_parameters": c.rope_parameters}
            manifest["fixtures"][name]["note"] = ("hybrid family: own dims; router always renormalises "
                                                  "(no norm_topk_prob key)")
        if only and versions != manifest["versions"]:
            manifest["fixtures"][name]["versions"] = versions
        print(f"{name}: short gen {diag['short_generated_ids']}\n"
              f"{' ' * len(name)}  long gen {diag['long_generated_ids']}")

    # Sharded copy must reproduce the unsharded fixture exactly.
    if only and not {"qwen3_moe_fp32", "qwen3_moe_sharded"} <= set(only):
        (out_root / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
        print(f"wrote {', '.join(only)} in {out_root}")
        return
    a = np.load(out_root / "qwen3_moe_fp32" / "expected.npz")
    b = np.load(out_root / "qwen3_moe_sharded" / "expected.npz")
    for k in a.files:
        if a[k].dtype.kind == "f":  # cached-decode logits may differ at the 1e-7 level
            np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-5, err_msg=k)
            print(f"  sharded vs fp32 {k}: max |diff| = {np.abs(a[k] - b[k]).max():.3g}")
        else:
            assert np.array_equal(a[k], b[k]), f"sharded fixture differs in {k}"

    (out_root / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    print(f"wrote {out_root}")


if __name__ == "__main__":
    main()
