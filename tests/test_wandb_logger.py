"""The W&B sink in offline mode (no network, no account): a short real run writes every round's metrics, with the
keys and values of metrics.jsonl at step = round, and the configured project, name and tags, into
``<run dir>/wandb``; a resumed run continues the same W&B run. The offline ``.wandb`` file is read back here
(LevelDB-log framing of ``wandb_internal_pb2.Record`` protobufs)."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest
import yaml

from hacrl_fed.cli import main

wandb = pytest.importorskip("wandb", reason="the `wandb` extra is not installed")
from google.protobuf.message import DecodeError  # noqa: E402
from wandb.proto import wandb_internal_pb2 as pb  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"
BLOCK, HEADER = 32768, 7  # LevelDB log framing: 32 KiB blocks, records headed by crc32 (4), length (2), type (1)


def read_records(path: Path) -> list[pb.Record]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    out, pos, chunk = [], HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if length == 0 and kind == 0:
            pos += left  # zero padding to the block's end
            continue
        chunk += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


def _finished_records(path: Path) -> list[pb.Record]:
    """The records of a finished offline run: wandb-core writes the file after ``run.finish()`` returns, so wait
    (a bounded number of polls) for its ``exit`` record; a record caught half-written fails to parse, and is polled
    again like a missing one."""
    for _ in range(300):
        try:
            records = read_records(path)
        except DecodeError:  # wandb-core is still writing the record the file ends with
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        time.sleep(0.1)
    raise AssertionError(f"{path} has no exit record")


def _history(run_dir: Path) -> tuple[list[pb.Record], dict[int, dict[str, float]]]:
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert files, list(run_dir.rglob("*"))
    records = [r for f in files for r in _finished_records(f)]
    history: dict[int, dict[str, float]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history.setdefault(r.history.step.num, {}).update(items)
    return records, history


def _config(tmp_path: Path) -> Path:
    data = yaml.safe_load(CONFIG.read_text())
    data["federation"].update(rounds=2, eval_every=1)
    data["wandb"] = {"enabled": True, "mode": "offline", "project": "byo-test", "name": "smoke-wb",
                     "tags": ["ci", "hacpo"]}
    path = tmp_path / "wb.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.timeout(300)
def test_offline_wandb_gets_every_round_with_the_jsonl_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # belt and braces: never a network call from a test
    run_dir = tmp_path / "run"
    assert main(["run", str(_config(tmp_path)), "--run-dir", str(run_dir), "--no-progress"]) == 0
    records, history = _history(run_dir)
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert runs and runs[0].project == "byo-test" and runs[0].display_name == "smoke-wb"
    assert list(runs[0].tags) == ["ci", "hacpo"]
    jsonl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(history) == [r["round"] for r in jsonl] == [0, 1, 2]
    for rec in jsonl:
        want = {k: v for k, v in rec.items() if k not in ("round", "wall_time") and v is not None}
        # samples/...: the run-end W&B table of samples.jsonl (tests/test_report.py checks it), not a metric
        got = {k: v for k, v in history[rec["round"]].items() if not k.startswith(("_", "samples/"))}
        assert set(got) == set(want), set(want) ^ set(got)
        assert got == pytest.approx(want)
    assert "eval/acme/accuracy" in history[2] and "round/globex/accuracy" in history[1]
    first_id = (run_dir / "wandb" / "hacrl_wandb_id").read_text().strip()
    # a resumed run logs to the same W&B run id
    assert main(["run", str(_config(tmp_path)), "--run-dir", str(run_dir), "--no-progress", "--resume",
                 "--set", "federation.rounds=3"]) == 0
    assert (run_dir / "wandb" / "hacrl_wandb_id").read_text().strip() == first_id
    ids = {p.name.rsplit("-", 1)[1] for p in run_dir.glob("wandb/offline-run-*")}
    assert ids == {first_id}
    _, history = _history(run_dir)
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert sorted(history) == [0, 1, 2, 3] and last["round"] == 3
    assert history[3]["eval/acme/accuracy"] == pytest.approx(last["eval/acme/accuracy"])


def test_missing_wandb_package_is_a_one_line_exit_2(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)
    rc = main(["run", str(_config(tmp_path)), "--run-dir", str(tmp_path / "run"), "--no-progress"])
    assert rc == 2
    assert "wandb.enabled: needs the wandb package: pip install 'hacrl-fed[wandb]'" in capsys.readouterr().err


def test_a_failing_log_call_never_stops_the_run(caplog):
    from hacrl_fed.loggers.wandb import WandbSink

    class Broken:
        calls = 0

        def log(self, data, step):
            Broken.calls += 1
            raise ConnectionError("gone")

        def finish(self):
            pass

    sink = WandbSink(Broken())
    sink.log(1, {"a": 1.0, "b": None})
    sink.log(2, {"a": 2.0})
    assert Broken.calls == 2 and sink.failures == 2
    assert sum("wandb: logging round 1 failed" in r.message for r in caplog.records) == 1
    sink.close()
