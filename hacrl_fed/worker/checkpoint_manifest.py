"""A checkpoint's ``manifest.json``: the size and SHA-256 of every file in it, so a resume can tell a whole
checkpoint from a truncated or corrupt one (docs/ARCHITECTURE.md "Checkpoints").

:func:`write_manifest` runs last, in the staging directory, after every file of the checkpoint is written: it
fsyncs each file, hashes it, writes ``manifest.json`` (fsynced) and fsyncs the directories, so the checkpoint that
:func:`hacrl_fed.worker.checkpoint.commit_checkpoint` then renames into place is on disk whole.
:func:`checkpoint_problem` re-reads a checkpoint and names what is wrong with it (None when nothing is):
no manifest, a manifest that does not parse, a listed file missing, of another size or another hash.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from hacrl_fed.fsio import fsync_dir, write_atomic

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
_CHUNK = 1 << 20
_KNOWN: dict[tuple[int, int, int, int], str] = {}  # (device, inode, size, mtime ns) -> SHA-256, of files linked in
_KNOWN_MAX = 64


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of ``path``'s content, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> list[Path]:
    """Every regular file under ``folder`` (recursively; a sharded checkpoint's ``dcp/`` too) but the manifest."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).as_posix() != MANIFEST)


def write_manifest(folder: Path) -> dict[str, dict[str, int | str]]:
    """fsync every file under ``folder``, then write its ``manifest.json`` (``{"version", "files": {relative path:
    {"size", "sha256"}}}``) and fsync every directory under it; returns the ``files`` table."""
    files: dict[str, dict[str, int | str]] = {}
    for path in _files(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        files[path.relative_to(folder).as_posix()] = {"size": path.stat().st_size, "sha256": _linked_sha256(path)}
    write_atomic(folder / MANIFEST, json.dumps({"version": MANIFEST_VERSION, "files": files}, indent=1, sort_keys=True))
    for sub in sorted({p.parent for p in _files(folder)} | {folder}, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(sub)
    return files


def weight_file(name: str) -> bool:
    """The files of a checkpoint that hold its weights and round (``hacrl-fed export`` reads only these: not the
    optimizer state, nor the outcome guard's files, GBs it would hash for nothing)."""
    return name in ("model.safetensors", "state.json") or name.startswith("dcp/")


def _linked_sha256(path: Path) -> str:
    """:func:`file_sha256`, remembered for a file with other names (a hard link: the outcome guard's reference,
    which a run's checkpoints share while it stays the reference, :mod:`.checkpoint_files`) by its device, inode,
    size and modification time, so the next checkpoint linking the same file in does not read it again. Only
    writing a manifest takes a remembered hash; :func:`checkpoint_problem` always reads the file."""
    st = path.stat()
    if st.st_nlink < 2:
        return file_sha256(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _KNOWN:
        if len(_KNOWN) >= _KNOWN_MAX:
            _KNOWN.pop(next(iter(_KNOWN)))
        _KNOWN[key] = file_sha256(path)
    return _KNOWN[key]


def checkpoint_problem(folder: Path, needed: Callable[[str], bool] | None = None) -> str | None:
    """What makes checkpoint ``folder`` unusable, in a few words, or None when every file its manifest lists is
    there with its size and hash (the manifest itself is checked for shape: a dict of sizes and hex digests).
    ``needed``: check only the listed files it accepts (a reader that opens only those: :func:`weight_file`)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
        assert manifest["version"] == MANIFEST_VERSION and isinstance(files, dict) and files
    except FileNotFoundError:
        return f"no {MANIFEST}"
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return f"{MANIFEST} does not parse"
    for name, entry in sorted(files.items()):
        if needed is not None and not needed(name):
            continue
        path = folder / name
        if not isinstance(entry, dict) or ".." in Path(name).parts or Path(name).is_absolute():
            return f"{MANIFEST} entry {name[:80]!r} is malformed"
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry.get("size"):
            return f"{name} has {path.stat().st_size} bytes, the manifest says {entry.get('size')}"
        if file_sha256(path) != entry.get("sha256"):
            return f"{name} does not match its SHA-256"
    return None
