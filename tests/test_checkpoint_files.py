"""What a worker checkpoint keeps by link (hacrl_fed/worker/checkpoint_files.py) and writes once: the outcome
guard's reference and shadow files linked into ``files/``, never serialized again in ``trainer.pt``, taken back
exactly on resume and checked by the manifest like any other file; tied embeddings written once."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hacrl_fed.worker.checkpoint import (
    CheckpointRefused,
    checkpoint_weights,
    good_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from hacrl_fed.worker.checkpoint_files import LinkedFile, resolve_files
from hacrl_fed.worker.checkpoint_manifest import MANIFEST, checkpoint_problem, weight_file
from hacrl_fed.worker.stash import Stash

GUARD_FILE = "files/outcome_guard.reference.pt"


def _saved(value: float) -> tuple[dict[str, torch.Tensor], dict]:
    """Weights and an optimizer-like state, every number ``value``."""
    params = {"w": torch.full((256, 256), value)}
    return params, {"optimizer": {"state": {0: {"exp_avg": torch.full((256, 256), value / 2)}}, "step": int(value)}}


def _checkpoint(root: Path, round: int, model: torch.nn.Module, stash: Stash, keep: int = 3) -> Path:
    state = {"step": round, "outcome_guard": {"run_id": "r", "guard": {"strikes": {}}, "reference": stash.file()}}
    return save_checkpoint(root, round, model, state, {"last_round": round}, keep=keep)


def _damage(path: Path) -> None:
    """Flip one byte in the middle of ``path``, in place (every name of the file sees it)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    with path.open("r+b") as f:
        f.write(data)


def test_a_guard_file_is_linked_in_and_a_resume_takes_back_its_exact_bytes(tmp_path):
    model, stash = torch.nn.Linear(3, 2), Stash(tmp_path / "guard" / "reference.pt")
    stash.put(_saved(1.0))
    ckpt = _checkpoint(tmp_path / "ck", 1, model, stash)
    assert os.path.samefile(ckpt / GUARD_FILE, stash.path)  # a second name of the file, no bytes written
    assert (ckpt / "trainer.pt").stat().st_size < stash.path.stat().st_size / 4  # no copy of the tensors inside
    assert GUARD_FILE in json.loads((ckpt / MANIFEST).read_text())["files"]
    stash.put(_saved(2.0))  # the guard moves on: a new file renamed over the old name
    assert checkpoint_problem(ckpt) is None
    trainer, _ = load_checkpoint(ckpt, model)
    linked = trainer["outcome_guard"]["reference"]
    assert linked == LinkedFile(ckpt / GUARD_FILE) and trainer["outcome_guard"]["run_id"] == "r"
    back = Stash(tmp_path / "resumed" / "reference.pt")
    back.take(linked)
    params, state = back.get()
    assert torch.equal(params["w"], torch.full((256, 256), 1.0)) and state["optimizer"]["step"] == 1
    assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], torch.full((256, 256), 0.5))
    assert (ckpt / GUARD_FILE).read_bytes() == back.path.read_bytes()


def test_a_corrupt_guard_file_makes_its_checkpoint_not_whole(tmp_path, caplog):
    model, stash = torch.nn.Linear(3, 2), Stash(tmp_path / "guard" / "reference.pt")
    stash.put(_saved(1.0))
    _checkpoint(tmp_path, 1, model, stash)
    stash.put(_saved(2.0))  # a new reference: round 2 links another file
    two = _checkpoint(tmp_path, 2, model, stash)
    _damage(two / GUARD_FILE)
    assert checkpoint_problem(two) == f"{GUARD_FILE} does not match its SHA-256"
    with caplog.at_level(logging.WARNING):
        assert good_checkpoint(tmp_path) == tmp_path / "round-000001"
    assert any(GUARD_FILE in r.getMessage() and "round-000002" in r.getMessage() for r in caplog.records)
    # an export reads the weights alone: it checks those (and the round's state.json), not the guard's GBs
    assert good_checkpoint(tmp_path, weight_file) == two
    _damage(two / "model.safetensors")
    assert good_checkpoint(tmp_path, weight_file) == tmp_path / "round-000001"


def test_checkpoints_sharing_a_corrupt_guard_file_are_all_refused_naming_it(tmp_path):
    # the reference unchanged over rounds 1-3: one file, three names; a later checkpoint re-lists the hash it
    # remembers, so a corruption that kept the file's size and time is still caught by the resume's check
    model, stash = torch.nn.Linear(3, 2), Stash(tmp_path / "guard" / "reference.pt")
    stash.put(_saved(1.0))
    for r in (1, 2):
        _checkpoint(tmp_path, r, model, stash)
    before = stash.path.stat()
    _damage(stash.path)
    os.utime(stash.path, ns=(before.st_atime_ns, before.st_mtime_ns))
    _checkpoint(tmp_path, 3, model, stash)
    for r in (1, 2, 3):
        assert checkpoint_problem(tmp_path / f"round-00000{r}") == f"{GUARD_FILE} does not match its SHA-256"
    with pytest.raises(CheckpointRefused, match=f"no whole checkpoint.*{GUARD_FILE} does not match its SHA-256"):
        good_checkpoint(tmp_path)


@pytest.mark.parametrize("name", ["../x.pt", "/etc/passwd", "files/../trainer.pt", "files/.x", "other/x.pt", 3])
def test_a_marker_naming_anything_but_a_file_of_files_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match="not a file of its files/"):
        resolve_files({"outcome_guard": {"reference": {"checkpoint_file": name}}}, tmp_path)


class Tied(torch.nn.Module):
    """An embedding and a head sharing one weight (as Gemma 3's and SmolLM2's)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.head = torch.nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight


def test_tied_weights_are_written_once_and_read_back_under_both_names(tmp_path):
    model = Tied()
    ckpt = save_checkpoint(tmp_path, 1, model, {"step": 1}, {"last_round": 1})
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == ["embed.weight"]
        assert json.loads(f.metadata()["tied"]) == {"head.weight": "embed.weight"}
    weights = checkpoint_weights(ckpt)
    assert sorted(weights) == ["embed.weight", "head.weight"] and torch.equal(
        weights["head.weight"], weights["embed.weight"]
    )
    fresh = Tied()
    load_checkpoint(ckpt, fresh)
    assert torch.equal(fresh.head.weight, model.embed.weight) and fresh.head.weight is fresh.embed.weight


def test_a_tensor_sharing_storage_but_not_the_same_view_gets_its_own_copy(tmp_path):
    model = torch.nn.Module()
    base = torch.arange(12.0)
    model.register_buffer("a", base[:6])
    model.register_buffer("b", base[6:])
    ckpt = save_checkpoint(tmp_path, 1, model, {"step": 1}, {"last_round": 1})
    weights = checkpoint_weights(ckpt)
    assert torch.equal(weights["a"], base[:6]) and torch.equal(weights["b"], base[6:])
