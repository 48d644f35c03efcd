"""What every ``hacrl-fed`` command shares: the ``--set`` flag, the exit-code rules, loading the tools package.

Exit codes, in every command: 0 success; 1 the run (or the command's work) failed; 2 bad usage, a configuration or
build-time error (:class:`~hacrl_fed.config.ConfigError`, :class:`~hacrl_fed.config.BuildError`), or a missing
tools package: one line on stderr naming the bad field or file, the traceback in a log file
(:func:`hacrl_fed.config.report_error`).
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

OK, FAILED, USAGE = 0, 1, 2
CLOSED_PIPE = 141  # what a shell reports for a command ended by SIGPIPE (`hacrl-fed config --describe | head`)
TOOLS = "hacrl_tools"


class UsageError(Exception):
    """Bad arguments or configuration found by a command: exit code 2, one line."""


def add_set_flag(
    p: argparse.ArgumentParser,
    *names: str,
    help: str | None = None,
    flag: str = "--set",
    dest: str = "overrides",
) -> None:
    """``--set KEY=VALUE ...``, repeatable, several values per flag: ``--set a=1 b=2 --set c=3`` gives
    ``args.overrides == ["a=1", "b=2", "c=3"]`` (the one meaning of ``--set`` in every command and script; a
    script with two sets of overrides names the second ``flag`` and ``dest``)."""
    p.add_argument(
        flag,
        *names,
        dest=dest,
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help=help or "override a config field, e.g. --set federation.rounds=3 trainer.lr=1e-5 (repeatable)",
    )


def say_line(text: str) -> None:
    """Write ``text`` and its newline to stdout in one write, then flush.

    ``print`` writes the text and the newline separately; with ``PYTHONUNBUFFERED`` (the launcher sets it) those are
    two writes to a pipe that other ranks of the same org also write to, so another rank's output can land between
    them and split the line a reader parses (the ready line, the link-secret path)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def run_command(
    prog: str,
    work: Callable[[], int | None],
    *,
    log_dir: Callable[[], Path | None] | None = None,
    failure_detail: Callable[[], str] | None = None,
    interrupted: str = "",
    bad_input: tuple[type[BaseException], ...] = (),
) -> int:
    """``work()``'s exit code under the rules of the module docstring.

    ``UsageError`` → one line, 2; ``ConfigError`` / ``BuildError`` → :func:`~hacrl_fed.config.report_error`, 2 (the
    traceback in ``log_dir()``'s ``error.log`` when given and that folder exists, else in a temp file);
    ``bad_input`` (the command's own bad-input errors) are reported like a ``ConfigError``;
    ``KeyboardInterrupt`` → ``<prog>: interrupted<interrupted>``, 1; ``BrokenPipeError`` (stdout's reader went
    away) → nothing printed, :data:`CLOSED_PIPE`; any other exception → one line, 1, with
    ``failure_detail()`` appended (where the traceback went; default: the traceback is printed first).
    """
    from hacrl_fed.config import ConfigError, report_error

    reported: tuple[type[BaseException], ...] = (ConfigError, *bad_input)
    try:
        return int(work() or 0)
    except UsageError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return USAGE
    except reported as err:
        return report_error(prog, err, log_dir=log_dir() if log_dir is not None else None)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted{interrupted}", file=sys.stderr)
        return FAILED
    except BrokenPipeError:  # the reader of stdout went away: stop quietly, as `git log | head` does
        _stdout_to_devnull()
        return CLOSED_PIPE
    except Exception as err:
        detail = failure_detail() if failure_detail is not None else _print_traceback()
        print(f"{prog}: failed: {type(err).__name__}: {err}{detail}", file=sys.stderr)
        return FAILED


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null, so the interpreter's flush at exit does not fail on the closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):  # no file descriptor (captured in tests)
        pass


def _print_traceback() -> str:
    traceback.print_exc()
    return ""


def load_tools(module: str, prog: str) -> ModuleType:
    """Import ``hacrl_tools.<module>`` (the benchmarks, the GPU check, the local deployment harness).

    The tools are a package of their own beside :mod:`hacrl_fed`; an install from a checkout carries both. When
    it is not importable but the working directory is a checkout (``./hacrl_tools/__init__.py``), the working
    directory is put on ``sys.path`` first. Raises :class:`UsageError` (one line) when it is absent.
    """
    name = f"{TOOLS}.{module}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name not in (TOOLS, name):
            raise
    here = Path.cwd()
    if (here / TOOLS / "__init__.py").is_file() and str(here) not in sys.path:
        sys.path.insert(0, str(here))
        importlib.invalidate_caches()
        return importlib.import_module(name)
    raise UsageError(
        f"the tools package {TOOLS!r} is not installed (run {prog} from a hacrl-fed checkout, or install the "
        "checkout: pip install -e .)"
    )


def parser(prog: str, description: str | None = None, **kwargs: Any) -> argparse.ArgumentParser:
    """An ``argparse`` parser named ``hacrl-fed <command>``."""
    return argparse.ArgumentParser(prog=f"hacrl-fed {prog}", description=description, **kwargs)
