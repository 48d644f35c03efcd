"""Files a checkpoint keeps by link, not by value: the outcome guard's reference and shadow
(:class:`~hacrl_fed.worker.stash.Stash` files, each the weights and optimizer state of the model: 3.2 GB for Gemma 3
270M in float32) are already on disk when a checkpoint is written, so ``trainer.pt`` does not serialize them again.

A trainer state handed to :func:`hacrl_fed.worker.checkpoint.commit_checkpoint` may hold :class:`LinkedFile` values
anywhere in its nested dicts. :func:`place_files` hard-links each file into the staging directory as
``files/<dotted key>.<suffix>`` (a copy where the file system refuses a link) and puts a marker, ``{"checkpoint_file":
"files/..."}``, in its place; the manifest then lists and hashes the file like every other one, so a corrupt or
truncated guard file makes the checkpoint not whole. The checkpoint stays self-contained: a link is a second name of
the file's content, not a pointer to the guard's folder, and a stash is never written in place (a new version is
renamed over the old name, :meth:`~hacrl_fed.worker.stash.Stash.put`), so the checkpoint keeps the bytes it was
written with whatever the guard does next. :func:`resolve_files` turns the markers of a loaded ``trainer.pt`` back
into :class:`LinkedFile` values naming the checkpoint's own files.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILES_DIR = "files"
MARKER = "checkpoint_file"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}$")  # a plain file name: no separator, no leading dot


@dataclass(frozen=True)
class LinkedFile:
    """A file whose content a checkpoint keeps under its own name (module doc); ``path`` is where it is now."""

    path: Path


def link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` as a hard link to ``src`` (the same content, no bytes written), a copy where links are refused."""
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:  # another file system, or one without hard links
        shutil.copyfile(src, dst)


def place_files(state: dict[str, Any], folder: Path, prefix: str = "") -> dict[str, Any]:
    """``state`` with every :class:`LinkedFile` linked into ``folder/files/`` and replaced by its marker."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, LinkedFile):
            rel = f"{FILES_DIR}/{name}{value.path.suffix}"
            if not _NAME.match(Path(rel).name):
                raise ValueError(f"checkpoint file name {rel!r} is not a plain name")
            (folder / FILES_DIR).mkdir(exist_ok=True)
            link_or_copy(value.path, folder / rel)
            out[key] = {MARKER: rel}
        elif isinstance(value, dict):
            out[key] = place_files(value, folder, f"{name}.")
        else:
            out[key] = value
    return out


def resolve_files(state: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``state`` (a loaded ``trainer.pt``'s) with every marker replaced by the :class:`LinkedFile` of ``folder``'s
    file it names; ValueError for a marker that names anything but a file directly in ``folder/files/``."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict) and set(value) == {MARKER}:
            rel = value[MARKER]
            parts = rel.split("/") if isinstance(rel, str) else []
            if len(parts) != 2 or parts[0] != FILES_DIR or not _NAME.match(parts[1]):
                raise ValueError(f"{folder}: trainer.pt names {str(rel)[:80]!r}, not a file of its {FILES_DIR}/")
            out[key] = LinkedFile(folder / FILES_DIR / parts[1])
        elif isinstance(value, dict):
            out[key] = resolve_files(value, folder)
        else:
            out[key] = value
    return out
