"""JAX's persistent compilation cache for the command lines and the experiment scripts.

A compiled program is written to disk and loaded by the next process that compiles the same program
(JAX keys each entry by the program, the compile options, the device and the jax/jaxlib versions), so
a second run of ``python -m ftjax.generate`` or of an ``experiments/`` script starts without most of
its compiles. On by default in the command lines (``ftjax.generate``, ``ftjax.serve``, through
``engine_flags.run_command``) and the scripts (``experiments.common.run``), in :func:`default_dir`;
``--compilation_cache_dir=DIR`` puts it elsewhere and ``--compilation_cache_dir=`` (empty) turns it
off. A cache directory already set in JAX's config (``JAX_COMPILATION_CACHE_DIR``, or the test suite's
own: tests/conftest.py) is kept when the flag is not given.
"""

from __future__ import annotations

import os

#: Environment variable naming the default cache directory; empty or "off": no cache by default.
ENV = "FTJAX_COMPILATION_CACHE"
#: Programs whose backend compile took less than this many seconds are not written (JAX's own default).
MIN_COMPILE_TIME_S = 1.0
_OFF = ("", "off", "0", "no", "false")
#: The help text of ``--compilation_cache_dir``.
FLAG_HELP = ("JAX's persistent compilation cache: compiled programs are kept in this directory for later runs. "
             f"Unset: ${ENV}, else $XDG_CACHE_HOME/ftjax/jax or ~/.cache/ftjax/jax (a directory JAX's config "
             "already names is kept); empty: off.")


#: The variable naming the folder of the native CPU expert kernel's builds (``ftjax.experts.cpu_native``).
NATIVE_ENV = "FTJAX_NATIVE_CACHE"


def user_cache_dir(*parts: str) -> str:
    """``$XDG_CACHE_HOME/ftjax/<parts>``, else ``~/.cache/ftjax/<parts>``: where ftjax keeps what it builds or
    measures for later runs (compiled programs, native kernels, the calibration profile)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ftjax", *parts)


def cuda_home() -> str | None:
    """``$CUDA_HOME`` (where ``ftjax.experts.slot_copy`` looks for nvcc after PATH), or None where unset or empty."""
    return os.environ.get("CUDA_HOME", "").strip() or None


def build_native(path: str, command, timeout_s: float) -> str | None:
    """Builds a native library at ``path`` (``ftjax.experts.cpu_native``'s and ``ftjax.experts.slot_copy``'s
    kernels): ``command(tmp)`` is the compiler's argument list writing to a temporary file in ``path``'s folder,
    renamed to ``path`` on success, so a concurrent build never sees half a file; the temporary is removed
    whatever happens. Returns None on success, else the error (the command, and the compiler's exit status and
    the end of its stderr, or the OS error)."""
    import subprocess
    import tempfile
    tmp, cmd = None, None
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=os.path.basename(path) + ".", suffix=".tmp")
        os.close(fd)
        cmd = list(command(tmp))
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if p.returncode != 0:
            return f"`{' '.join(cmd)}` exited {p.returncode}: {p.stderr.strip()[-1500:]}"
        os.replace(tmp, path)
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"`{' '.join(cmd)}`: {e}" if cmd else f"cannot create a temporary file beside {path}: {e}"
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def native_dir() -> str:
    """The folder of the native CPU expert kernel's builds: ``$FTJAX_NATIVE_CACHE`` when set, else
    :func:`user_cache_dir` ``("native")``."""
    value = os.environ.get(NATIVE_ENV, "").strip()
    return os.path.expanduser(value) if value else user_cache_dir("native")


def default_dir() -> str | None:
    """The cache directory used when the flag is not given: ``$FTJAX_COMPILATION_CACHE`` when set (None,
    off, when it is empty or "off"), else ``$XDG_CACHE_HOME/ftjax/jax``, else ``~/.cache/ftjax/jax``."""
    if ENV in os.environ:
        value = os.environ[ENV].strip()
        return None if value.lower() in _OFF else os.path.expanduser(value)
    return user_cache_dir("jax")


def define_flag(flag_values=None, module_name: str | None = None) -> None:
    """Defines ``--compilation_cache_dir`` (a string, default unset) in ``flag_values`` (default absl's
    FLAGS) as a flag of ``module_name`` (default: absl's choice, the calling module); already defined
    there: nothing. :func:`configure` reads its value."""
    from absl import flags
    flag_values = flags.FLAGS if flag_values is None else flag_values
    if "compilation_cache_dir" in flag_values:
        return
    kw = {"module_name": module_name} if module_name else {}
    flags.DEFINE_string("compilation_cache_dir", None, FLAG_HELP, flag_values=flag_values, **kw)


def configure(flag_value: str | None) -> str | None:
    """Sets JAX's persistent compilation cache from the flag's value; call it before the first compile.

    Args:
      flag_value: None (the flag not given): the directory JAX's config already names if any, else
        :func:`default_dir`; "" (empty): off (``jax_compilation_cache_dir`` cleared); else that directory
        (``~`` expanded). A directory set here gets ``jax_persistent_cache_min_compile_time_secs`` =
        :data:`MIN_COMPILE_TIME_S` unless ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` is set.
    Returns:
      The directory in use, or None when the cache is off. The directory is created on the first write
      (by JAX); one that cannot be written only costs the cache (JAX warns and compiles).
    """
    import jax
    current = jax.config.jax_compilation_cache_dir
    if flag_value is None:
        if current:
            return current
        path = default_dir()
    else:
        path = os.path.expanduser(flag_value.strip()) or None
    if path != current:
        from jax.experimental.compilation_cache import compilation_cache
        jax.config.update("jax_compilation_cache_dir", path)
        if path and "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
        compilation_cache.reset_cache()  # JAX reads the directory once, at its first compile
    return path
