r"""A/B of how ``ftjax.layers.common.project`` hands one-row products to XLA (issue 13, docs/PROFILE.md).

Runs ``profile_step`` (its flags) with ``project`` replaced as ``AB_PROJECT`` says:
  nobarrier  the shipped ``project``: fewer than ``KernelConfig.min_dot_rows`` rows (``--min_dot_rows``;
             default 4 on a GPU) padded with zero rows;
  barrier    the same padding behind an optimization barrier (the first version of the fix);
  plain      ``x @ w`` as it is (with ``XLA_FLAGS=--xla_disable_hlo_passes=dot-strength-reduction``:
             the pass that lowers matrix-vector products to multiply + reduce switched off).
A stacked weight that the kernel config hands to ``dense_decode`` still goes to the kernel in every
variant (as in the shipped ``project``); ``--kernels=xla`` keeps every projection on ``project``'s path.
The 2026-12-01 files ``profile_step_..._b1-{barrier,nobarrier,plain,plain-nopass}_...`` came from

  for v in barrier nobarrier plain; do AB_PROJECT=$v PYTHONPATH=. python3 experiments/ab_project.py \
      --runs=resident_decode --batches=1 --prefill_repeats=0 --hbm_repeats=3 --out_dir=$OUT/$v; done
  AB_PROJECT=plain XLA_FLAGS=--xla_disable_hlo_passes=dot-strength-reduction PYTHONPATH=. python3 \
      experiments/ab_project.py --runs=resident_decode --batches=1 --prefill_repeats=0 --hbm_repeats=3

CPU smoke:

  AB_PROJECT=barrier PYTHONPATH=. JAX_PLATFORMS=cpu .venv/bin/python experiments/ab_project.py --preset=tiny \
      --dtype=float32 --vram_budget_gb=1.02 --runs=resident_decode --batches=1 --prompt_len=32 --warm_steps=1 \
      --timed_steps=2 --pipelined_steps=2 --trace_steps=1 --hbm_gb=0.0625 --min_dot_rows=4 --out_dir=/tmp/abp
"""

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402

from experiments import common, profile_step  # noqa: E402
from ftjax.kernels import dense_decode, registry  # noqa: E402
from ftjax.layers import attention, gated_deltanet, moe  # noqa: E402
from ftjax.layers import common as layers_common  # noqa: E402

VARIANTS = ("nobarrier", "barrier", "plain")
#: The modules that call ``project`` by a name of their own (imported from ``ftjax.layers.common``).
PROJECT_USERS = (layers_common, attention, moe, gated_deltanet)

flags.adopt_module_key_flags(profile_step)  # profile_step's flags are this script's (the JSON's "flags")


def _layer_matrix(x, w):
    """The shipped ``project``'s first step: a stacked weight goes to ``dense_decode`` where the kernel
    config selects it (its result, and None), else the layer's matrix (None, the matrix)."""
    if isinstance(w, layers_common.StackedWeight):
        y = dense_decode.maybe(x, w.w, w.layer)
        return (y, None) if y is not None else (None, w.w[w.layer])
    return None, w


def _barrier_project(x, w):
    y, w = _layer_matrix(x, w)
    if y is not None:
        return y
    m = registry.active().dot_rows()
    rows = math.prod(x.shape[:-1])
    if rows >= m:
        return x @ w
    padded = jax.lax.optimization_barrier(jnp.pad(x.reshape(rows, x.shape[-1]), ((0, m - rows), (0, 0))))
    return (padded @ w)[:rows].reshape(*x.shape[:-1], w.shape[-1])


def _plain_project(x, w):
    y, w = _layer_matrix(x, w)
    return y if y is not None else x @ w


def main(argv):
    variant = os.environ.get("AB_PROJECT", "nobarrier")
    if variant not in VARIANTS:
        raise app.UsageError(f"AB_PROJECT={variant!r}: expected one of {', '.join(VARIANTS)}")
    if variant != "nobarrier":  # each module looks its own name up at trace time
        for mod in PROJECT_USERS:
            mod.project = _barrier_project if variant == "barrier" else _plain_project
    print("AB_PROJECT", variant, "XLA_FLAGS", os.environ.get("XLA_FLAGS", ""), flush=True)
    profile_step.main(argv)


if __name__ == "__main__":
    common.run(main)
