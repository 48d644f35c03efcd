"""The config's errors and how every command reports them: :class:`ConfigError` (a field that does not validate),
:class:`BuildError` (what a valid config names cannot be built) and :func:`report_error` (one line, exit code 2).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import traceback
from pathlib import Path

from pydantic import ValidationError

from hacrl_fed.run_files import ERROR_LOG


class ConfigError(ValueError):
    """A configuration problem; the message names the offending field(s)."""


class BuildError(ConfigError):
    """A problem found while building what a valid config names: a model or tokenizer that cannot be loaded, a
    task that cannot be built (unknown name, bad params, an unreadable or malformed data file), a zoo agent whose
    shipped weights are stale, prompts that do not fit a model's context. The message names the field or the file
    (and line). Entry points treat it like any :class:`ConfigError`: one line, exit code 2."""


def _format_errors(err: ValidationError, prefix: str = "", header: str = "invalid config: ") -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if prefix:
            loc = f"{prefix}.{loc}" if loc else prefix
        cause = (e.get("ctx") or {}).get("error")
        msg = str(cause) if e["type"] == "value_error" and cause is not None else e["msg"]
        lines.append(f"{loc}: {msg}" if loc else msg)  # cross-field checks name their fields themselves
    return header + "; ".join(lines)


def report_error(prog: str, err: BaseException, *, log_dir: str | Path | None = None) -> int:
    """Report a configuration or build-time error the way every command does; returns the exit code, 2.

    One line on stderr, ``<prog>: error: <message> (traceback in <file>)``: the message names the field or the
    file (and line). The traceback goes to ``<log_dir>/error.log`` when ``log_dir`` is an existing folder (a run
    dir), else to a new file in the temp folder.
    """
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    path: Path | None = None
    try:
        if log_dir is not None and Path(log_dir).is_dir():
            path = Path(log_dir) / ERROR_LOG
            path.write_text(text)
        else:
            slug = re.sub(r"[^A-Za-z0-9]+", "-", prog).strip("-") or "hacrl-fed"
            fd, name = tempfile.mkstemp(prefix=f"{slug}-error-", suffix=".log")
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            path = Path(name)
    except OSError:  # nowhere to keep it: the one line still says what is wrong
        path = None
    message = " ".join(str(err).split()) or type(err).__name__
    where = f" (traceback in {path})" if path is not None else ""
    print(f"{prog}: error: {message}{where}", file=sys.stderr, flush=True)
    return 2
