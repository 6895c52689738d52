"""One ``experiments/train_moe.py --smoke`` checkpoint per test session, shared by the modules
that need a trained checkpoint (test_train_moe, test_policy_study). ~25 s on 2 CPU cores.
The script's ``main`` runs in the test process (tests/cli_helpers.py), as its command line would."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile

from cli_helpers import run_module_app

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=None)
def smoke_checkpoint() -> str:
    """Path of a freshly trained smoke checkpoint (removed at interpreter exit).

    Raises:
      AssertionError: the training command failed (its stderr tail is in the message).
    """
    root = tempfile.mkdtemp(prefix="ftjax_train_smoke_")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    out = os.path.join(root, "ckpt")
    proc = run_train_moe("--smoke", f"--out_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def run_train_moe(*args: str):
    """``experiments/train_moe.py *args`` in this process (its flags are defined by its
    ``define_flags``, as under ``__main__``): a :class:`cli_helpers.CliResult`."""
    return run_module_app("experiments.train_moe", args, program=os.path.join(REPO, "experiments", "train_moe.py"),
                          define=lambda m: m.define_flags())
