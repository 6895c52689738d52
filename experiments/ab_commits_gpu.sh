#!/usr/bin/env bash
# Compares the held figures of a base tree and this tree in one run on one machine
# (experiments/ab_commits.py, one process per tree, the base first), then writes both into one JSON.
#   bash experiments/ab_commits_gpu.sh BASE_DIR BASE_COMMIT [MEASURES]
# BASE_DIR holds the base commit's ftjax/ package (e.g. `git archive BASE ftjax | tar -x -C .base`);
# MEASURES is ab_commits.py's --measure list (default: all); AB_ARGS go to both runs. Output: $OUT (or experiments/results/ab)/ab_commits.json
set -uo pipefail
cd "$(dirname "$0")/.."
base="$1"; base_commit="$2"; measures="${3:-decode_resident,decode_cached_lookahead,prefill_stream,prefill_resident,hybrid_prefill}"
out="${OUT:-experiments/results/ab}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_FLAGS="${XLA_FLAGS:---xla_gpu_autotune_level=0}"
# HERE_COMMIT first: a copied work tree can carry the .git of an older checkout
here_commit="${HERE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
PYTHONPATH="$base" python3 experiments/ab_commits.py --label=base --commit="$base_commit" --measure="$measures" ${AB_ARGS:-} \
  --out="$out/ab_base.json" 2>&1 | grep --line-buffered -v -E "libtpu|TPU" > "$out/ab_base.log"
PYTHONPATH=. python3 experiments/ab_commits.py --label=new --commit="$here_commit" --measure="$measures" ${AB_ARGS:-} \
  --out="$out/ab_new.json" 2>&1 | grep --line-buffered -v -E "libtpu|TPU" > "$out/ab_new.log"
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
runs = {}
for label in ("base", "new"):
    try:
        runs[label] = json.load(open(f"{out}/ab_{label}.json"))
    except (OSError, ValueError) as e:
        runs[label] = {"error": str(e)}
ratio = {}
b, n = runs["base"].get("figures", {}), runs["new"].get("figures", {})
for key in n:
    for field in ("tpot_ms_median", "ttft_s_median"):
        if field in n[key] and field in b.get(key, {}):
            ratio[key] = n[key][field] / b[key][field]
json.dump({"runs": runs, "new_over_base": ratio}, open(f"{out}/ab_commits.json", "w"), indent=1)
print(json.dumps(ratio, indent=1))
PY
