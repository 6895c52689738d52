"""One ``experiments/train_moe.py --smoke`` checkpoint per test session, shared by the modules
that need a trained checkpoint (test_train_moe, test_policy_study). ~25 s on 2 CPU cores."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile

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
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "experiments", "train_moe.py"), "--smoke",
                           f"--out_dir={out}"], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out
