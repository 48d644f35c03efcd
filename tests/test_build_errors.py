"""Configuration and build-time errors in every command: one line naming the field or file (and line), exit code 2,
the traceback kept in a log file (the run dir's error.log, or a temp file the line names)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import yaml

from hacrl_fed.cli import main

ORG = {"id": "acme", "model": {"zoo": "micro-qwen-char"}}
GPT2 = {"id": "globex", "model": {"zoo": "micro-gpt2-bpe"}}  # a GPT-2-style agent: 256 positions
LONG = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. " * 4


def _config(tmp_path: Path, orgs=(ORG,), task=None, **extra) -> Path:
    data = {"name": "errs", "seed": 0, "run_dir": str(tmp_path / "runs"), "orgs": list(orgs),
            "task": task or {"name": "arithmetic", "eval_size": 4},
            "generation": {"num_samples": 2, "max_new_tokens": 8, "eval_max_new_tokens": 64},
            "federation": {"rounds": 1, "prompts_per_round": 2}, **extra}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _jsonl(tmp_path: Path, lines: list[bytes]) -> dict:
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return {"name": "jsonl", "params": {"path": str(path), "test_fraction": 0.5}, "eval_size": 4}


def _one_line(capsys, prog: str) -> tuple[str, Path]:
    err = capsys.readouterr().err.strip().splitlines()
    line = err[-1]
    assert line.startswith(f"hacrl-fed {prog}: error: "), err
    assert "Traceback" not in "\n".join(err)
    log = Path(line.rsplit("(traceback in ", 1)[1].rstrip(")"))
    assert "Traceback (most recent call last)" in log.read_text()
    return line, log


ROWS = [json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}).encode() for i in range(40)]
CASES = {
    "bad model path": ({"model": {"path": str(Path("/nonexistent/model"))}}, None,
                       "org 'acme': model.path='/nonexistent/model': no such file or directory"),
    "unknown task": ({}, {"name": "nope"}, "task.name: unknown task 'nope'"),
    "invalid UTF-8": ({}, "utf8", "data.jsonl:3: not valid UTF-8"),
    "malformed JSON": ({}, "json", "data.jsonl:2: not valid JSON"),
}


def _case(tmp_path, name):
    org_extra, task, message = CASES[name]
    if task == "utf8":
        task = _jsonl(tmp_path, ROWS[:2] + [b'{"question": "caf\xe9", "answer": "#### 1"}'] + ROWS[2:])
    elif task == "json":
        task = _jsonl(tmp_path, ROWS[:1] + [b"{oops"] + ROWS[1:])
    return _config(tmp_path, orgs=[{**ORG, **org_extra}], task=task), message


@pytest.mark.parametrize("name", sorted(CASES))
def test_worker_build_errors_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch, name):
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # main_worker installs stop handlers
    config, message = _case(tmp_path, name)
    assert main(["worker", "--config", str(config), "--org", "acme", "--listen", "127.0.0.1:0", "--insecure"]) == 2
    line, log = _one_line(capsys, "worker")
    assert message in line, line
    log.unlink()


def test_worker_refuses_prompts_beyond_the_context_at_start_up(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    task = _jsonl(tmp_path, ROWS + [json.dumps({"question": LONG, "answer": "#### 72"}).encode()] * 4)
    config = _config(tmp_path, orgs=[GPT2], task=task)
    assert main(["worker", "--config", str(config), "--org", "globex", "--listen", "127.0.0.1:0", "--insecure"]) == 2
    line, log = _one_line(capsys, "worker")
    assert "org 'globex': " in line and "of task 'jsonl' is " in line
    assert "> the model's context of 256 tokens (max_position_embeddings)" in line
    log.unlink()


def test_run_build_error_exits_2_with_error_log_in_the_run_dir(tmp_path, capsys):
    config, message = _case(tmp_path, "bad model path")
    run_dir = tmp_path / "the-run"
    assert main(["run", str(config), "--run-dir", str(run_dir), "--no-progress"]) == 2
    line, log = _one_line(capsys, "run")
    assert message in line and log == run_dir / "error.log"


def test_simulate_and_deploy_local_check_before_starting_anything(tmp_path, capsys, monkeypatch):
    import hacrl_tools.deploy_local as harness

    monkeypatch.setattr(harness, "Deployment", lambda *a, **k: pytest.fail("started a deployment"))
    config, message = _case(tmp_path, "invalid UTF-8")
    assert main(["simulate", str(config), "--run-dir", str(tmp_path / "sim"), "--no-progress"]) == 2
    line, log = _one_line(capsys, "simulate")
    assert message in line and not (tmp_path / "sim").exists()
    log.unlink()
    config, message = _case(tmp_path, "bad model path")
    assert main(["deploy-local", "--config", str(config), "--workdir", str(tmp_path / "dep")]) == 2
    line, log = _one_line(capsys, "deploy-local")
    assert message in line
    log.unlink()


def test_zoo_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["zoo", "build", "gpt5"])
    assert exc.value.code == 2 and "not a zoo agent" in capsys.readouterr().err


def test_run_over_grpc_reports_a_worker_that_refused_its_config(tmp_path, capsys):
    config, message = _case(tmp_path, "malformed JSON")
    run_dir = tmp_path / "grpc-run"
    assert main(["run", str(config), "--transport", "grpc", "--run-dir", str(run_dir), "--no-progress"]) == 2
    line, log = _one_line(capsys, "run")
    assert "worker 'acme' refused to start: hacrl-fed worker: error: " in line and message in line, line
    assert log == run_dir / "error.log"


def test_keys_bad_input_is_one_line_exit_2_with_a_log(tmp_path, capsys):
    assert main(["keys", "--out", str(tmp_path / "k"), "--orgs", "acme,acme"]) == 2
    line, log = _one_line(capsys, "keys")
    assert "duplicate org ids ['acme']" in line
    log.unlink()
