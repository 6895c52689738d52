# Sourced by the GPU scripts (bench_serve_gpu.sh, gpu_stages.sh) from the repository root: a GPU machine without a
# package index gets the serving dependencies (fastapi, uvicorn, sse-starlette, httpx, openai, ...) as wheels
# carried in .whl/ (pip download them here first); they go to /tmp/site, ahead of the repository on PYTHONPATH.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing the carried wheels in .whl/ failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
