"""Checkpoints that cannot be half-written: a manifest of sizes and SHA-256 per checkpoint, at least two kept, and a
resume that finds the newest one truncated or corrupt takes the one before, with one warning line.

Every kind of file of a checkpoint (weights, trainer state, ``state.json``, the manifest itself, the ``LATEST``
marker) is truncated or overwritten in turn; the coordinator's state file likewise (its checksum and the copy of
the previous state)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from hacrl_fed.coordinator.state_file import read_state, write_state
from hacrl_fed.worker.checkpoint import (
    CheckpointRefused,
    checkpoint_round,
    good_checkpoint,
    latest_run,
    load_checkpoint,
    save_checkpoint,
    stage_checkpoint,
)
from hacrl_fed.worker.checkpoint_manifest import MANIFEST, checkpoint_problem

FILES = ("model.safetensors", "trainer.pt", "state.json", MANIFEST)


def three_checkpoints(root: Path) -> torch.nn.Module:
    """Rounds 1-3 of a small model (weights = the round number), ``keep=3``; returns the model."""
    model = torch.nn.Linear(3, 2)
    for t in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(t))
        save_checkpoint(root, t, model, {"step": t}, {"last_round": t}, keep=3)
    return model


def damage(path: Path, how: str) -> None:
    """``truncate``: cut the file to half its size; ``flip``: overwrite one byte in its middle."""
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        mid = len(data) // 2
        path.write_bytes(data[:mid] + bytes([data[mid] ^ 0x5A]) + data[mid + 1 :])


def test_a_checkpoint_lists_every_file_with_its_size_and_hash(tmp_path):
    three_checkpoints(tmp_path)
    manifest = json.loads((tmp_path / "round-000003" / MANIFEST).read_text())
    assert sorted(manifest["files"]) == sorted(FILES[:3])
    for name, entry in manifest["files"].items():
        assert entry["size"] == (tmp_path / "round-000003" / name).stat().st_size and len(entry["sha256"]) == 64
    assert checkpoint_problem(tmp_path / "round-000003") is None
    assert good_checkpoint(tmp_path) == tmp_path / "round-000003"


@pytest.mark.parametrize("how", ["truncate", "flip"])
@pytest.mark.parametrize("name", FILES)
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before_with_one_line(tmp_path, caplog, name, how):
    model = three_checkpoints(tmp_path)
    damage(tmp_path / "round-000003" / name, how)
    assert checkpoint_problem(tmp_path / "round-000003") is not None
    with caplog.at_level(logging.WARNING):
        good = good_checkpoint(tmp_path)
    assert good == tmp_path / "round-000002"
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "round-000003" in lines[0] and "resuming from round-000002" in lines[0]
    trainer, state = load_checkpoint(good, model)
    assert trainer == {"step": 2} and state["last_round"] == 2
    assert all(torch.all(p == 2.0) for p in model.parameters())


@pytest.mark.parametrize("latest", ["", "round-0", "\x00\x17garbage", None])
def test_a_damaged_or_lost_latest_marker_falls_back_to_the_newest_whole_checkpoint(tmp_path, caplog, latest):
    three_checkpoints(tmp_path)
    damage(tmp_path / "round-000003" / "trainer.pt", "truncate")
    if latest is None:
        (tmp_path / "LATEST").unlink()
    else:
        (tmp_path / "LATEST").write_text(latest)
    with caplog.at_level(logging.WARNING):
        assert good_checkpoint(tmp_path) == tmp_path / "round-000002"
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_latest_naming_a_round_that_is_gone_falls_back(tmp_path):
    three_checkpoints(tmp_path)
    (tmp_path / "LATEST").write_text("round-000007")
    assert good_checkpoint(tmp_path) == tmp_path / "round-000003"


def test_every_checkpoint_damaged_refuses_to_resume_rather_than_starting_afresh(tmp_path):
    three_checkpoints(tmp_path)
    for t in (1, 2, 3):
        damage(tmp_path / f"round-{t:06d}" / "model.safetensors", "flip")
    with pytest.raises(CheckpointRefused, match="no whole checkpoint under"):
        good_checkpoint(tmp_path)


def test_a_kill_mid_write_leaves_only_the_staging_directory_and_the_last_checkpoint_stays(tmp_path):
    model = three_checkpoints(tmp_path)
    tmp = stage_checkpoint(tmp_path, 4)  # weights staged, then the process died
    (tmp / "model.safetensors").write_bytes(b"half")
    assert good_checkpoint(tmp_path) == tmp_path / "round-000003"
    save_checkpoint(tmp_path, 4, model, {"step": 4}, {"last_round": 4})  # the next attempt replaces the staging
    assert not tmp.exists() and good_checkpoint(tmp_path) == tmp_path / "round-000004"


def test_at_least_two_checkpoints_are_kept_whatever_keep_says(tmp_path):
    model = torch.nn.Linear(2, 2)
    for t in (1, 2, 3):
        save_checkpoint(tmp_path, t, model, {}, {"last_round": t}, keep=1)
    assert sorted(p.name for p in tmp_path.glob("round-*")) == ["round-000002", "round-000003"]


def test_a_latest_pointing_out_of_the_root_is_still_refused_not_repaired(tmp_path):
    three_checkpoints(tmp_path)
    (tmp_path / "LATEST").write_text("../elsewhere/round-000009")
    with pytest.raises(CheckpointRefused, match="not a round-NNNNNN checkpoint inside"):
        good_checkpoint(tmp_path)


def test_the_run_checkpointed_last_resumes_from_its_newest_whole_checkpoint(tmp_path):
    three_checkpoints(tmp_path / "run-1")
    damage(tmp_path / "run-1" / "round-000003" / "state.json", "flip")
    found = latest_run(tmp_path)
    assert found is not None and found[0] == "run-1" and checkpoint_round(found[1]) == 2


# ------------------------------------------------------------------------------------ the coordinator's state


def states(path: Path) -> None:
    for t in (1, 2, 3):
        write_state(path, {"run_id": "r", "config_hash": "h", "round": t})


def test_the_state_file_carries_its_checksum_and_keeps_the_previous_state(tmp_path):
    path = tmp_path / "coordinator_state.json"
    states(path)
    assert read_state(path, "h")["round"] == 3
    assert json.loads(path.with_name(path.name + ".prev").read_text())["round"] == 2
    assert len(json.loads(path.read_text())["sha256"]) == 64


@pytest.mark.parametrize("how", ["truncate", "flip", "edit", "empty"])
def test_a_damaged_state_file_falls_back_to_the_previous_state_with_one_line(tmp_path, caplog, how):
    path = tmp_path / "coordinator_state.json"
    states(path)
    if how == "edit":  # valid JSON, another round: the checksum no longer matches
        path.write_text(path.read_text().replace('"round": 3', '"round": 4'))
    elif how == "empty":
        path.write_bytes(b"")
    else:
        damage(path, how)
    with caplog.at_level(logging.WARNING):
        assert read_state(path, "h")["round"] == 2
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "previous state" in lines[0]


def test_both_state_files_damaged_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "coordinator_state.json"
    states(path)
    damage(path, "flip")
    damage(path.with_name(path.name + ".prev"), "truncate")
    with pytest.raises(ValueError, match="coordinator_state.json"):
        read_state(path, "h")


def test_a_state_lost_between_the_copy_and_the_write_resumes_from_the_copy(tmp_path):
    path = tmp_path / "coordinator_state.json"
    states(path)
    os.replace(path.with_name(path.name + ".prev"), path.with_name("x"))  # only the newest, as written
    assert read_state(path, "h")["round"] == 3
    path.unlink()
    os.replace(path.with_name("x"), path.with_name(path.name + ".prev"))
    assert read_state(path, "h")["round"] == 2


def test_the_state_after_each_round_every_org_checkpointed_is_kept_for_forks_the_last_four(tmp_path):
    from hacrl_fed.coordinator.state_file import read_snapshot

    path = tmp_path / "coordinator_state.json"
    for t in range(1, 8):  # every org checkpointed the odd rounds
        write_state(path, {"run_id": "r", "round": t, "worker_checkpoint_round": t - (t % 2 == 0)})
    assert sorted(p.name for p in (tmp_path / "states").iterdir()) == [f"round-00000{t}.json" for t in (1, 3, 5, 7)]
    write_state(path, {"run_id": "r", "round": 9, "worker_checkpoint_round": 9})
    assert read_snapshot(tmp_path, 9)["round"] == 9
    with pytest.raises(ValueError, match=r"no state of round 1 \(kept: \[3, 5, 7, 9\]\)"):
        read_snapshot(tmp_path, 1)


def test_a_resume_drops_the_metric_rows_logged_after_the_states_round_and_a_half_written_line(tmp_path):
    from hacrl_fed.metrics import drop_rows_after, read_metrics

    rows = [json.dumps({"round": t, "x": float(t)}) + "\n" for t in range(4)]
    (tmp_path / "metrics.jsonl").write_text("".join(rows) + '{"round": 4, "x"')  # killed mid-append
    assert drop_rows_after(tmp_path, 2) == 2
    assert [r["round"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    assert drop_rows_after(tmp_path, 2) == 0 and (tmp_path / "metrics.jsonl").read_text() == "".join(rows[:3])


def test_checkpoints_from_before_manifests_still_resume_unverified_with_one_line(tmp_path, caplog):
    three_checkpoints(tmp_path)
    for t in (1, 2, 3):
        (tmp_path / f"round-{t:06d}" / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING):
        assert good_checkpoint(tmp_path) == tmp_path / "round-000003"
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "predate manifests" in lines[0]


def test_a_lost_manifest_beside_checkpoints_that_have_one_is_a_damaged_checkpoint(tmp_path):
    three_checkpoints(tmp_path)
    (tmp_path / "round-000003" / MANIFEST).unlink()
    assert good_checkpoint(tmp_path) == tmp_path / "round-000002"
