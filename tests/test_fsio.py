"""hacrl_fed.fsio: the one atomic, durable write (temp file, fsync, os.replace, folder fsync)."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest

from hacrl_fed import fsio


def test_write_atomic_replaces_content_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "state.json"
    fsio.write_json_atomic(path, {"b": 1, "a": [1.5]})
    assert json.loads(path.read_text()) == {"a": [1.5], "b": 1}
    fsio.write_atomic(path, "new")
    fsio.write_atomic(tmp_path / "LATEST", b"round-000003")
    assert path.read_text() == "new" and (tmp_path / "LATEST").read_bytes() == b"round-000003"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "state.json"]


def test_write_atomic_sets_an_exact_mode(tmp_path):
    path = tmp_path / "identity.json"
    fsio.write_atomic(path, "secret", mode=0o600)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    fsio.write_atomic(path, "public", mode=0o644)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_write_atomic_fsyncs_and_keeps_the_old_content_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    path.write_text("old")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    fsio.write_atomic(path, "new")
    assert len(synced) == 2  # the file, then its folder
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        fsio.write_atomic(path, "newer")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["state.json"]
    with pytest.raises(ValueError):
        fsio.write_json_atomic(path, {"x": float("nan")})


def test_one_atomic_write_helper():
    root = Path(__file__).resolve().parents[1] / "hacrl_fed"
    pattern = re.compile(r"^def \w*write\w*atomic\w*\(", re.M)
    defs = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py") if pattern.search(p.read_text()))
    assert defs == ["fsio.py"]
