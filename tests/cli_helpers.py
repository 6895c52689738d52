"""absl command-line apps run inside the test process: ``python -m ftjax.generate``,
``python -m ftjax.calibrate`` and the ``experiments/*.py`` scripts, without a child process each
(a child pays the interpreter, the JAX import and a backend start: 3-7 s on CI's 2 cores).

The entry points::

    r = run_generate("--preset=tiny", "--prompt_len=0")     # as `python -m ftjax.generate --noprogress ...`
    assert r.returncode == 1 and "--prompt_len must be >= 1" in r.stderr

    r = run_module_app("ftjax.calibrate", ["--impls=torch"], define=lambda m: setattr(m, "FLAGS", m._flags()))
    r = run_module_app("experiments.bench_prefill", [f"--out_dir={tmp_path}", "--repeats=0"])

Each returns a :class:`CliResult` (``returncode``, ``stdout``, ``stderr``, as a
``subprocess.CompletedProcess`` with ``text=True`` has them). The run is what ``app.run`` does:
the argv is parsed into absl's ``FLAGS`` (a flag error prints absl's ``FATAL Flags parsing error:``
lines and gives status 1), ``main(argv)`` is called, an ``app.UsageError`` prints the short usage,
and ``SystemExit`` becomes the exit status (None: 0, an int: itself, anything else: printed, 1).
Any other exception propagates to the test, with its traceback (where the child process printed a
``Traceback`` and exited 1). stdout and stderr are what Python code writes to ``sys.stdout`` /
``sys.stderr`` and absl's log handler, captured; C++ output written straight to file descriptors
1 and 2 (XLA's own logging) is not.

Flags. Every app defines its flags in absl's one global ``FLAGS``, and several of them use the same
names (``--preset``, ``--dtype``, ``--out_dir``): importing two of them in one process raises
``DuplicateFlagError``, and one script's required flags (experiments/replay_policies.py) would fail
every other app's parse. So each app runs in a flag namespace of its own: :func:`flag_namespace`
swaps the registry of the global ``FLAGS`` object (absl's flags, shared, plus that app's) in for
the run and back after it. A module is imported at most once; a module that defines its flags at
import is imported inside its namespace the first time (or, when the test process imported it
already, its flags are moved from the global registry into the namespace); a script that defines
them in a function when run as ``__main__`` (train_moe, policy_study, calibrate) gets that function
as ``define``, called once inside the namespace. Flags are reset to their defaults before and after
each run, and ``sys.modules['__main__']`` is the app's module during the run (absl's usage text and
``experiments.common.script_flags`` read it).

What stays a child process: a run that needs JAX configured before its backend starts
(``use_sync_cpu_dispatch`` for the CPU-callback miss mechanisms: the test process's CPU client is
asynchronous; in-process, that call is made a no-op so such a run fails loudly instead of
deadlocking), a run that must see a fresh interpreter, and the one end-to-end run of the real
entry point (tests/test_cli.py). Scripts that change process-wide state (``os.environ`` knobs read
at trace time, JAX config) also keep their real smoke runs in a child: see tests/test_experiments.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import os
import sys
import textwrap
from typing import Callable

from absl import app, flags
from absl import logging as absl_logging

FLAGS = flags.FLAGS

# The parts of a FlagValues that hold its registry and parse state (absl-py 1.x and 2.x keep them
# under these names in the object's __dict__; checked below so that a change fails loudly).
_STATE_KEYS = ("__flags", "__hiddenflags", "__flags_by_module", "__flags_by_module_id", "__key_flags_by_module",
               "__flags_parsed", "__unparse_flags_called")
assert all(k in FLAGS.__dict__ for k in _STATE_KEYS), "absl FlagValues internals changed: see tests/cli_helpers.py"

_namespaces: dict[str, dict] = {}


@dataclasses.dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def _snapshot() -> dict:
    return {k: FLAGS.__dict__[k] for k in _STATE_KEYS}


def _is_absl(module_name: str) -> bool:
    return module_name == "absl" or module_name.startswith("absl.")


def _state_with(module_names: Callable[[str], bool]) -> dict:
    """A registry holding the flags (with their names and modules) that the modules
    ``module_names`` accepts defined in the current one; the Flag objects are shared."""
    by_module = {m: list(fl) for m, fl in FLAGS.flags_by_module_dict().items() if module_names(m)}
    keep = {id(f) for fl in by_module.values() for f in fl}
    return {
        "__flags": {name: f for name, f in FLAGS._flags().items() if id(f) in keep},
        "__hiddenflags": set(),
        "__flags_by_module": by_module,
        "__flags_by_module_id": {m: list(fl) for m, fl in FLAGS.flags_by_module_id_dict().items()
                                 if all(id(f) in keep for f in fl)},
        "__key_flags_by_module": {m: list(fl) for m, fl in FLAGS.key_flags_by_module_dict().items()
                                  if module_names(m)},
        "__flags_parsed": False, "__unparse_flags_called": False,
    }


def _take_module_flags(module_name: str) -> dict:
    """absl's flags plus ``module_name``'s, which leave the global registry (the module was imported
    there; its flags, e.g. --preset, would otherwise clash with other apps' imported later)."""
    state = _state_with(lambda m: _is_absl(m) or m == module_name)
    for name in [n for n, f in FLAGS._flags().items() if FLAGS.find_module_defining_flag(n) == module_name]:
        delattr(FLAGS, name)
    return state


@contextlib.contextmanager
def flag_namespace(key: str, module_name: str | None = None, define: Callable | None = None):
    """Runs the body with the global ``FLAGS`` holding namespace ``key``'s flags: absl's own and
    those of ``module_name`` (imported here, once) or those ``define(module)`` defines (called
    once). Yields the module (None without ``module_name``). Flags are unparsed before and after;
    the absl flags' values (verbosity, which sets Python logging levels) are put back after."""
    outer = _snapshot()
    absl_flags = {id(f): f for n, f in FLAGS._flags().items() if _is_absl(FLAGS.find_module_defining_flag(n) or "")}
    saved = {i: (f.value, f.present, f.using_default_value) for i, f in absl_flags.items()}
    module = sys.modules.get(module_name) if module_name else None
    new = key not in _namespaces
    if new:
        if module is not None and any(FLAGS.find_module_defining_flag(n) == module_name for n in FLAGS._flags()):
            _namespaces[key] = _take_module_flags(module_name)
        else:
            _namespaces[key] = _state_with(_is_absl)
    FLAGS.__dict__.update(_namespaces[key])
    try:
        if module_name and module is None:
            module = importlib.import_module(module_name)  # its module-level flags land in this namespace
        if new and define is not None:
            define(module)
        FLAGS.unparse_flags()
        yield module
    finally:
        for f in {id(f): f for f in FLAGS._flags().values()}.values():
            f.unparse()
        _namespaces[key] = dict(_snapshot(), __flags_parsed=False, __unparse_flags_called=False)
        FLAGS.__dict__.update(outer)
        for i, f in absl_flags.items():
            f.value, f.present, f.using_default_value = saved[i]


def _exit_status(code) -> int:
    """``SystemExit.code`` as the interpreter turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _app_run(main: Callable, argv: list[str]) -> int:
    """What ``absl.app.run(main, argv)`` does, minus its process-wide setup (signal handlers,
    exception handlers, --run_with_pdb), returning the exit status."""
    try:
        try:
            args = FLAGS(argv)
        except flags.Error as error:  # app.parse_flags_with_usage
            message = str(error)
            if "\n" in message:
                sys.stderr.write(f"FATAL Flags parsing error:\n{textwrap.indent(message, '  ')}\n")
            else:
                sys.stderr.write(f"FATAL Flags parsing error: {message}\n")
            sys.stderr.write("Pass --helpshort or --helpfull to see help on flags.\n")
            return 1
        try:
            return _exit_status(main(args))
        except app.UsageError as error:
            app.usage(shorthelp=True, detailed_error=error, exitcode=error.exitcode)
            return error.exitcode  # usage() exits; not reached
    except SystemExit as e:
        return _exit_status(e.code)


@contextlib.contextmanager
def _captured():
    """stdout and stderr of Python code and of absl's log handler, into two StringIO."""
    out, err = io.StringIO(), io.StringIO()
    handler = absl_logging.get_absl_handler().python_handler
    stream = handler.setStream(err)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield out, err
    finally:
        handler.setStream(stream)


@contextlib.contextmanager
def _as_main(module):
    """``sys.modules['__main__']`` is ``module`` (as under ``python script.py`` / ``-m``)."""
    if module is None:
        yield
        return
    main = sys.modules["__main__"]
    sys.modules["__main__"] = module
    try:
        yield
    finally:
        sys.modules["__main__"] = main


@contextlib.contextmanager
def _no_late_sync_dispatch():
    """``use_sync_cpu_dispatch`` made a no-op: in the test process JAX's CPU backend is already
    up (asynchronous), so the call could only change the config value, not the client (and
    tests/test_miss_policy.py checks that value). A run that needs synchronous dispatch then fails
    on the mechanism's own check (``ValueError``) rather than deadlocking; give it a child process."""
    from ftjax.experts import cpu_experts
    real = cpu_experts.use_sync_cpu_dispatch
    cpu_experts.use_sync_cpu_dispatch = lambda: None
    try:
        yield
    finally:
        cpu_experts.use_sync_cpu_dispatch = real


@contextlib.contextmanager
def _process_state(cwd: str | None, env: dict | None):
    """The working directory and os.environ as a child process given ``cwd`` and ``env`` (added to
    the current environment) would have them; both put back after, with whatever the app changed."""
    old_cwd, old_env = os.getcwd(), dict(os.environ)
    try:
        if cwd is not None:
            os.chdir(cwd)
        os.environ.update(env or {})
        yield
    finally:
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(old_env)


def import_app(module_name: str, define: Callable | None = None):
    """``module_name`` imported in its flag namespace (see :func:`run_module_app`), e.g. to patch
    one of its functions before running it."""
    with flag_namespace(module_name, module_name, define) as module:
        return module


def run_module_app(module_name: str, args, *, main: str = "main", program: str | None = None,
                   define: Callable | None = None, argv_filter: Callable | None = None,
                   cwd: str | None = None, env: dict | None = None, wrap: Callable | None = None) -> CliResult:
    """Runs ``module_name``'s absl ``main`` on ``args`` as ``python -m module_name *args`` (or
    ``python path/to/script.py``) would, in this process: see the module docstring.

    Args:
      module_name: e.g. "ftjax.generate", "experiments.bench_prefill".
      args: the command-line arguments after the program name.
      main: the name of the module's main function.
      program: argv[0] (default ``module_name``).
      define: called once with the module inside its flag namespace, for a module that defines its
        flags when run as a script (``define_flags`` of experiments/train_moe.py).
      argv_filter: applied to the whole argv before parsing (``engine_flags.alias_no_flags``).
      cwd: the working directory during the run (put back after).
      env: variables added to ``os.environ`` during the run; the environment as it was before the
        run is put back after it (with any variable the app set itself removed).
      wrap: applied to the main function before the run, e.g. ``experiments.common.guard`` (what a script's
        ``common.run(main)`` adds: an ``app.UsageError`` as one ``error:`` line and status 1).
    """
    argv = [program or module_name, *args]
    with flag_namespace(module_name, module_name, define) as module, _captured() as (out, err), \
            _as_main(module), _no_late_sync_dispatch(), _process_state(cwd, env):
        if argv_filter is not None:
            argv = argv_filter(argv)
        fn = getattr(module, main)
        code = _app_run(wrap(fn) if wrap is not None else fn, argv)
    return CliResult(code, out.getvalue(), err.getvalue())


def run_generate(*args: str, progress: bool = False) -> CliResult:
    """``python -m ftjax.generate --noprogress *args`` in this process (``progress=True``: without
    ``--noprogress``)."""
    return run_module_app("ftjax.generate", ([] if progress else ["--noprogress"]) + list(args),
                          argv_filter=lambda argv: importlib.import_module("ftjax.engine_flags").alias_no_flags(argv))
