"""Where a result came from: git commit, device, library versions, date (for every metrics and
benchmark JSON, so that figures can be compared across runs and machines)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess

import jax


def git_commit() -> str | None:
    """The checkout's commit (with ``+dirty`` when tracked files changed), or None outside git.

    ``$FTJAX_GIT_COMMIT``, when set, is returned as given instead: for a copy of the tree whose git metadata is
    missing or stale (a GPU machine's copy of the working tree kept an older ``.git``, so its results recorded a
    commit they did not run; experiments/results/README.md), the caller names the commit the copy holds."""
    given = os.environ.get("FTJAX_GIT_COMMIT", "").strip()
    if given:
        return given
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha.stdout.strip() + ("+dirty" if dirty else "")


#: Environment variables that change what XLA compiles or how much host memory it may use: recorded with
#: every result (ftjax's own choices are in the engine config each result also records).
ENV_PREFIXES = ("XLA_FLAGS", "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "XLA_PYTHON_CLIENT_", "JAX_")


def run_env() -> dict:
    """The set variables of :data:`ENV_PREFIXES` (name -> value)."""
    return {"variables": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}}


#: What ``nvidia-smi`` is asked about the GPUs (:func:`gpu_identity`).
GPU_FIELDS = ("uuid", "driver_version", "pci.bus_id")


def gpu_identity() -> list[dict] | None:
    """Per GPU the process may use (``CUDA_VISIBLE_DEVICES``' cards where it is set), its UUID, driver version and PCI
    bus id from ``nvidia-smi`` (which card ran a result: the same commit and flags have given other tokens on other
    machines, docs/PROFILE.md), or None where nvidia-smi is missing or fails."""
    cmd = ["nvidia-smi", f"--query-gpu={','.join(GPU_FIELDS)}", "--format=csv,noheader"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:  # nvidia-smi lists every card of the host; the process sees these (indices or UUIDs)
        cmd.append(f"--id={visible}")
    try:  # a card stuck after a fault can leave nvidia-smi unkillable: the timeout bounds the usual hang only
        r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=10)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    if r.returncode != 0:
        return None
    rows = [[v.strip() for v in line.split(",")] for line in r.stdout.strip().splitlines() if line.strip()]
    return [dict(zip(GPU_FIELDS, row)) for row in rows if len(row) == len(GPU_FIELDS)] or None


def run_meta() -> dict:
    """Device name, backend, jax version, UTC date, host CPU count, Python version, git commit, the
    environment that changes the compiled programs (:func:`run_env`), and on a GPU the cards
    (:func:`gpu_identity`)."""
    d = jax.devices()[0]
    meta = {"device": getattr(d, "device_kind", str(d)), "backend": d.platform, "jax": jax.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "host_cpus": os.cpu_count(), "python": platform.python_version(), "git_commit": git_commit(),
            "env": run_env()}
    if d.platform == "gpu" and (gpus := gpu_identity()):
        meta["gpus"] = gpus
    return meta
