"""Running an absl app as users expect of a command-line program: asked for its help (``--help``,
``--helpshort``, ``--helpfull``, ``--helpxml``, ``-?``), it prints the usage and exits with status 0.
absl's ``app.run`` exits with 1 there, which scripts and shells read as a failure. Everything else --
flag errors (status 1), ``main``'s own exit status -- is ``app.run``'s.
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

#: The flags with which absl prints the usage and exits before ``main`` runs.
HELP_FLAGS = ("--help", "--helpshort", "--helpfull", "--helpxml", "-help", "-helpshort", "-helpfull", "-helpxml", "-?")


def asks_for_help(argv: Sequence[str]) -> bool:
    """Whether the command line ``argv`` (program name first) names one of :data:`HELP_FLAGS` (``--help=false``
    does not count)."""
    for a in argv[1:]:
        if a == "--":
            break
        name, _, value = a.partition("=")
        if name in HELP_FLAGS and value.lower() not in ("false", "0"):
            return True
    return False


def run(main: Callable, argv: Sequence[str] | None = None, **kwargs) -> None:
    """``absl.app.run(main, argv, **kwargs)``, with the exit status of a help request 0 instead of absl's 1.

    Raises:
      SystemExit: always, as ``app.run`` does (status 0 after a help request).
    """
    from absl import app
    argv = list(sys.argv if argv is None else argv)
    try:
        app.run(main, argv=argv, **kwargs)
    except SystemExit as e:
        if e.code == 1 and asks_for_help(argv):
            raise SystemExit(0) from None
        raise
