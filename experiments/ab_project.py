r"""A/B of how ``ftjax.model.project`` hands one-row products to XLA (issue 13, docs/PROFILE.md).

Runs ``profile_step`` with ``project`` replaced as ``AB_PROJECT`` says:
  nobarrier  the shipped ``project``: fewer than FTJAX_MIN_DOT_ROWS rows padded with zero rows;
  barrier    the same padding behind an optimization barrier (the first version of the fix);
  plain      ``x @ w`` as it is (with ``XLA_FLAGS=--xla_disable_hlo_passes=dot-strength-reduction``:
             the pass that lowers matrix-vector products to multiply + reduce switched off).
The 2026-12-01 files ``profile_step_..._b1-{barrier,nobarrier,plain,plain-nopass}_...`` came from

  for v in barrier nobarrier plain; do AB_PROJECT=$v PYTHONPATH=. python3 experiments/ab_project.py \
      --runs=resident_decode --batches=1 --prefill_repeats=0 --hbm_repeats=3 --out_dir=$OUT/$v; done
  AB_PROJECT=plain XLA_FLAGS=--xla_disable_hlo_passes=dot-strength-reduction PYTHONPATH=. python3 \
      experiments/ab_project.py --runs=resident_decode --batches=1 --prefill_repeats=0 --hbm_repeats=3
"""

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app  # noqa: E402

from experiments import profile_step  # noqa: E402
from ftjax import model  # noqa: E402

VARIANTS = ("nobarrier", "barrier", "plain")


def _barrier_project(x, w):
    m = model.min_dot_rows()
    rows = math.prod(x.shape[:-1])
    if rows >= m:
        return x @ w
    padded = jax.lax.optimization_barrier(jnp.pad(x.reshape(rows, x.shape[-1]), ((0, m - rows), (0, 0))))
    return (padded @ w)[:rows].reshape(*x.shape[:-1], w.shape[-1])


def main(argv):
    variant = os.environ.get("AB_PROJECT", "nobarrier")
    if variant not in VARIANTS:
        raise SystemExit(f"AB_PROJECT={variant!r}: expected one of {', '.join(VARIANTS)}")
    if variant == "barrier":
        # model.py looks the name up at trace time (hybrid.py imported it: not patched)
        model.project = _barrier_project
    elif variant == "plain":
        model.project = lambda x, w: x @ w
    print("AB_PROJECT", variant, "XLA_FLAGS", os.environ.get("XLA_FLAGS", ""), flush=True)
    profile_step.main(argv)


if __name__ == "__main__":
    app.run(main)
