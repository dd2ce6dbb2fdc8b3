"""How dtrain's launcher starts a rank: `python -m dtrain.launch.bootstrap SCRIPT ARGS...`
(or `-m MODULE ARGS...`), which runs the program as `python SCRIPT ARGS...` would.

Before the program starts, the rank is made to die with the process that started it:
the launcher stops its ranks when it can; killed itself (SIGKILL, a lost machine's
agent), it cannot, and torch starts each rank in a session of its own, so nothing else
would: the rank would train on alone. The kernel SIGKILLs it instead (PR_SET_PDEATHSIG,
Linux). The parent is `dtrain run`'s agent, or the parameter-server role process of a
worker (dtrain.launch.roles, which starts its worker through here too).

When the program ends, the rank notes the time for the launcher, which blames the failed
rank that ended first (dtrain.launch.exits).

The program sees what it would if started directly: `__main__` is a module of its own,
`sys.argv` is SCRIPT ARGS (for a module, its file and ARGS), `sys.path[0]` the script's
folder, and an uncaught exception prints its traceback without this module's frames and
exits with status 1. Ranks started by torchrun, SLURM or mpirun run their script without
any of this.
"""

from __future__ import annotations

import builtins
import os
import runpy
import signal
import sys
import types
from importlib.machinery import SourceFileLoader
from pkgutil import get_importer

from dtrain.launch import exits

MODULE = "dtrain.launch.bootstrap"
_VALUED = ("-W", "-X", "--check-hash-based-pycs")  # interpreter options that take a value


def split(argv: list[str]) -> tuple[list[str], list[str]] | None:
    """A Python command `python [options] SCRIPT|-m MODULE ARGS...` as (the interpreter and
    its options, the target: SCRIPT|-m MODULE ARGS...); None for any other command (not
    Python, `-c`, stdin, or already started through this module)."""
    if not argv or not os.path.basename(argv[0]).startswith("python"):
        return None
    k = 1
    while k < len(argv) and argv[k].startswith("-") and argv[k] not in ("-", "-c", "-m"):
        k += 2 if argv[k] in _VALUED else 1
    if k >= len(argv) or argv[k] in ("-", "-c") or argv[k:k + 2] == ["-m", MODULE]:
        return None
    return argv[:k], argv[k:]


def command(argv: list[str]) -> list[str]:
    """`argv` started through this module: `[python, *options, -m, MODULE, target...]` for a
    Python command (`python [options] SCRIPT|-m MODULE ...`); any other command unchanged."""
    parts = split(argv)
    if parts is None:
        return argv
    interpreter, target = parts
    return [*interpreter, "-m", MODULE, *target]


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the one that started it dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)


def main(target: list[str]) -> None:
    """Run `target` (SCRIPT ARGS... or -m MODULE ARGS...) as this rank's program."""
    die_with_parent()
    rank = os.environ.get("RANK", "")
    try:
        if target[0] == "-m":
            sys.argv = ["-m", *target[2:]]  # the module's file, once found
            _new_main()
            # runpy's own runner of `python -m` (private: not in typeshed)
            runpy._run_module_as_main(target[1], alter_argv=True)  # type: ignore[attr-defined]
        else:
            sys.argv = list(target)
            _run_script(target[0])
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # as the interpreter reports it, without our frames
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        raise SystemExit(1) from None
    finally:
        exits.note_exit_time(rank)


def _run_script(path: str) -> None:
    """Run the file `path` (or the `__main__` of a folder or zip) as `python path` would."""
    package = get_importer(path) is not None  # a folder or a zip file: runs its __main__
    entry = path if package else os.path.dirname(os.path.realpath(path))
    if not sys.flags.safe_path:  # in place of the folder `-m` put first
        sys.path[0] = entry
    elif package:  # python -P leaves out a script's folder, not the package it runs
        sys.path.insert(0, entry)
    if package:
        _new_main()
        runpy._run_module_as_main("__main__", alter_argv=False)  # type: ignore[attr-defined]
        return
    where = os.path.abspath(path)
    try:
        with open(path, "rb") as file:
            source = file.read()
    except OSError as exc:
        print(f"{sys.executable}: can't open file {where!r}: [Errno {exc.errno}] "
              f"{exc.strerror}", file=sys.stderr)
        raise SystemExit(2) from None
    code = compile(source, where, "exec", dont_inherit=True)
    main = _new_main()
    main.__file__ = where
    main.__cached__ = None  # type: ignore[attr-defined]  # a module attribute typeshed omits
    main.__loader__ = SourceFileLoader("__main__", main.__file__)
    exec(code, main.__dict__)


def _new_main() -> types.ModuleType:
    """A fresh `__main__` module, in place of this one, for the program to run in."""
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins  # type: ignore[attr-defined]  # as for __cached__
    main.__annotations__ = {}
    sys.modules["__main__"] = main
    return main


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1:] == ["-m"]:
        sys.exit(f"usage: python -m {MODULE} SCRIPT|-m MODULE [ARGS...]")
    main(sys.argv[1:])
