"""Converts a bf16 / fp32 HF MoE checkpoint into an fp8 block-wise checkpoint in the layout of the
official fp8 Qwen3 MoE checkpoints (e.g. Qwen/Qwen3-30B-A3B-FP8):

* each quantized linear ``X.weight`` [out, in] is stored as float8_e4m3fn, with
  ``X.weight_scale_inv`` float32 [ceil(out/128), ceil(in/128)] beside it; dequantized,
  ``w = w_fp8 * weight_scale_inv`` per 128 x 128 block (a partial block at the edge is a block);
* config.json gains ``quantization_config = {"quant_method": "fp8", "weight_block_size":
  [128, 128], "fmt": "e4m3", "activation_scheme": "dynamic", "modules_to_not_convert": [...]}``.

Quantized: the routed experts (gate, up, down), and with ``--attention`` also the attention
projections (q, k, v, o), as the official checkpoints do. Embeddings, norms, routers and the LM
head stay in the source dtype. The quantization is ``ftjax.experts.quant.quantize("fp8", ...)``
(scale = block amax / 448, weight / scale cast to e4m3fn), the same arithmetic as
``--expert_dtype=fp8`` on the source checkpoint, so without ``--attention`` the fp8 checkpoint
loads into banks identical to the source's quantized at load.

    .venv/bin/python scripts/make_fp8_checkpoint.py SRC_DIR OUT_DIR [--attention]

Writes OUT_DIR/model.safetensors and config.json, and copies the tokenizer and generation
config files (not the source's expected.npz oracle outputs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXPERT_RE = re.compile(r"\.(mlp|block_sparse_moe)\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
ATTN_RE = re.compile(r"\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight$")
COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


def quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float weight -> (float8_e4m3fn [out, in], float32 scale_inv [ceil(out/128), ceil(in/128)])."""
    import jax.numpy as jnp

    from ftjax.experts import quant
    q, s = quant.quantize("fp8", jnp.asarray(w.astype(np.float32)).T)  # ftjax's [in, out] orientation
    return np.asarray(q).T.copy(), np.asarray(s).T.copy()


def read_tensors(src: str) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory (one file or a sharded index) as numpy arrays."""
    import ml_dtypes  # noqa: F401 -- registers bfloat16 with numpy: safetensors' numpy reader needs it
    from safetensors import safe_open
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for name in files:
        with safe_open(os.path.join(src, name), framework="np") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def convert(src: str, dst: str, attention: bool = False) -> dict:
    """Writes the fp8 checkpoint; returns a summary (tensors quantized, bytes before / after)."""
    from safetensors.numpy import save_file
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if "quantization_config" in config:
        raise SystemExit(f"{src}: already quantized ({config['quantization_config'].get('quant_method')})")
    tensors = read_tensors(src)
    out, quantized, keep = {}, 0, []
    for name, w in sorted(tensors.items()):
        if EXPERT_RE.search(name) or (attention and ATTN_RE.search(name)):
            out[name], out[name + "_scale_inv"] = quantize_fp8(w)
            quantized += 1
        else:
            out[name] = np.ascontiguousarray(w)
            if name.endswith(".weight") and w.ndim == 2:
                keep.append(name[: -len(".weight")])
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [128, 128], "modules_to_not_convert": keep}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    for name in COPY_FILES:
        if os.path.exists(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    nbytes = lambda d: sum(v.nbytes for v in d.values())  # noqa: E731
    return {"quantized_tensors": quantized, "bytes_in": nbytes(tensors), "bytes_out": nbytes(out)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="bf16 / fp32 HF checkpoint directory")
    ap.add_argument("dst", help="output directory")
    ap.add_argument("--attention", action="store_true", help="also quantize the attention projections")
    args = ap.parse_args(argv)
    summary = convert(args.src, args.dst, args.attention)
    print(f"wrote {args.dst}: {summary['quantized_tensors']} tensors in fp8, "
          f"{summary['bytes_in'] / 1e6:.2f} MB -> {summary['bytes_out'] / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
