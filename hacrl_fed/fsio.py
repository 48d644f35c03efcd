"""The one atomic, durable file write of the project.

:func:`write_atomic` replaces a file's content so that a reader (another process, or this one after a crash or a
power cut) sees either the old content or the new one, never a mix or a truncated file: the data goes to a
uniquely named temporary file in the same folder, is flushed and fsynced, renamed over the target with
``os.replace`` (atomic on POSIX and Windows), and the folder is fsynced so the rename itself is durable.
Used for the coordinator's state, ``run_info.json``, a worker's ``LATEST`` checkpoint pointer and checkpoint
``manifest.json``, and key files rewritten with ``overwrite``.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any


def fsync_dir(folder: Path) -> None:
    """fsync a folder, so the renames and new entries in it are durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows: folders cannot be opened; the rename is as durable as the OS makes it
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | Path, data: str | bytes, *, mode: int | None = None) -> Path:
    """Replace ``path`` with ``data`` (text is written as UTF-8) atomically and durably; returns the path.

    ``mode``: the file's permission bits, set exactly (umask not applied); None gives a new file the default
    ``0o666 & ~umask``. The temporary file is removed if anything fails.
    """
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else bytes(data)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666 if mode is None else mode)
    try:
        try:
            if mode is not None:
                os.fchmod(fd, mode)
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_json_atomic(path: str | Path, data: Any) -> Path:
    """``data`` as JSON (sorted keys, indent 1, no NaN or infinity) via :func:`write_atomic`."""
    return write_atomic(path, json.dumps(data, indent=1, sort_keys=True, allow_nan=False))
