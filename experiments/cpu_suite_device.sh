#!/usr/bin/env bash
# The test suite on the CPU cores of a GPU machine, beside the decode A/B on its GPU (one call):
# this tree's default selection and its slow selection, the base tree's whole suite (durations of
# each), and experiments/ab_commits_gpu.sh's decode figures. Output under $OUT.
set -u
out="${OUT:?}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
ln -sfn ../../ftjax/assets .basetree/ftjax/assets; ln -sfn ../../tests/fixtures .basetree/tests/fixtures; cp -r experiments/results .basetree/experiments/results
lim="${SUITE_LIMIT_S:-480}"
(JAX_PLATFORMS=cpu PYTHONPATH=.:/tmp/site taskset -c 0-5 timeout -s INT "$lim" python3 -m pytest -p no:cacheprovider -n 6 -rf --durations=30 > "$out/new_fast.log" 2>&1; echo "rc=$?" >> "$out/new_fast.log") &
(JAX_PLATFORMS=cpu PYTHONPATH=.:/tmp/site taskset -c 6-8 timeout -s INT "$lim" python3 -m pytest -p no:cacheprovider -n 3 -m slow -rf --durations=30 > "$out/new_slow.log" 2>&1; echo "rc=$?" >> "$out/new_slow.log") &
(cd .basetree && JAX_PLATFORMS=cpu taskset -c 9-13 timeout -s INT "$lim" python3 -m pytest -p no:cacheprovider -q -n 5 --durations=30 tests > "$out/base_suite.log" 2>&1; echo "rc=$?" >> "$out/base_suite.log") &
(HERE_COMMIT="${HERE_COMMIT:-unknown}" AB_ARGS=--decode_steps=96 taskset -c 14-15 bash experiments/ab_commits_gpu.sh .basetree a9be64f decode_resident,decode_cached_lookahead > "$out/ab.txt" 2>&1) &
wait
tail -n 2 "$out"/*.log; cat "$out/ab.txt"
