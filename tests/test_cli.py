"""``hacrl-fed`` CLI: run (in-process, gRPC with --worker, gRPC with launched workers), resume, exit codes, delegation.

Workers are fakes (see helpers_fake_workers); the task is the real default ``arithmetic``.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import hacrl_fed.worker
from helpers_fake_workers import SCRIPT_SKILLS, FakeWorker, fake_config
from hacrl_fed import cli
from hacrl_fed.coordinator import launcher

FAKE_WORKER = [sys.executable, str(Path(__file__).with_name("helpers_fake_workers.py"))]


@pytest.fixture
def config_path(tmp_path):
    data = fake_config(orgs=("a", "b"), rounds=2, eval_every=0).model_dump(mode="json")
    data["task"] = {"name": "arithmetic", "eval_size": 4}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def fake_build(monkeypatch):
    """Replace build_worker with FakeWorker construction; records (org, run_dir, resume) per call."""
    calls = []

    def build(cfg, org_id, *, run_dir, resume=False):
        calls.append((org_id, Path(run_dir), resume))
        return FakeWorker(org_id, SCRIPT_SKILLS[org_id])

    monkeypatch.setattr(hacrl_fed.worker, "build_worker", build)
    return calls


def test_run_inprocess_writes_outputs_and_prints_table(tmp_path, config_path, fake_build, capsys):
    run_dir = tmp_path / "out"
    rc = cli.main(["run", str(config_path), "--run-dir", str(run_dir), "--set", "federation.rounds=3",
                   "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert fake_build == [("a", run_dir, False), ("b", run_dir, False)]
    for name in ("metrics.jsonl", "accuracy.png", "config.yaml", "coordinator_state.json", "report.html"):
        assert (run_dir / name).is_file(), name
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["federation"]["rounds"] == 3
    assert json.loads((run_dir / "coordinator_state.json").read_text())["round"] == 3
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
    assert rows["a"][1:5] == ["0.250", "->", "0.280", "+0.030"]  # FakeWorker: +0.01 held-out per trained round
    assert rows["b"][5:7] == ["36", "36"]  # 3 rounds x B=3 x G=4 and "3 rounds (0 skipped)" in out


def test_resume_extends_a_finished_run(tmp_path, config_path, fake_build, capsys):
    run_dir = tmp_path / "out"
    args = ["run", str(config_path), "--run-dir", str(run_dir), "--no-progress"]
    assert cli.main(args) == 0
    assert cli.main(args) == 2  # refuses to overwrite
    assert "already holds a run: pass --resume" in capsys.readouterr().err
    assert cli.main(args + ["--resume", "--set", "federation.rounds=4"]) == 0
    assert fake_build[-1] == ("b", run_dir, True)
    rounds = [json.loads(line)["round"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [0, 1, 2, 3, 4]
    assert "4 rounds (0 skipped)" in capsys.readouterr().out


@pytest.mark.parametrize("extra,field", [
    (["--set", "trainer.lr=-1"], "trainer.lr"),
    (["--set", "federation.roundz=3"], "federation.roundz"),
    (["--set", "novalue"], "novalue"),
    (["--worker", "zz=127.0.0.1:1"], "org 'zz' is not in the config"),
    (["--worker", "a"], "ORG=ADDRESS"),
    (["--resume"], "no run to resume"),
])
def test_bad_usage_is_one_line_exit_2(tmp_path, config_path, fake_build, capsys, extra, field):
    rc = cli.main(["run", str(config_path), "--run-dir", str(tmp_path / "out"), "--no-progress"] + extra)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and field in err and len(err.splitlines()) == 1
    assert fake_build == []


def test_missing_config_file_exit_2(tmp_path, capsys):
    assert cli.main(["run", str(tmp_path / "nope.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_federation_failure_exit_1(tmp_path, config_path, monkeypatch, capsys):
    def build(cfg, org_id, *, run_dir, resume=False):
        return FakeWorker(org_id, 0.5, fail_generate_rounds=set(range(1, 10)))

    monkeypatch.setattr(hacrl_fed.worker, "build_worker", build)
    rc = cli.main(["run", str(config_path), "--run-dir", str(tmp_path / "o"), "--set", "federation.rounds=5",
                   "--no-progress"])
    assert rc == 1 and "3 consecutive rounds" in capsys.readouterr().err


def test_unexpected_error_exit_1_with_traceback_file(tmp_path, config_path, monkeypatch, capsys):
    def build(cfg, org_id, *, run_dir, resume=False):
        raise OSError("disk on fire")

    monkeypatch.setattr(hacrl_fed.worker, "build_worker", build)
    rc = cli.main(["run", str(config_path), "--run-dir", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and "failed: OSError: disk on fire" in err
    assert "disk on fire" in (tmp_path / "o" / "error.log").read_text()


def test_run_grpc_with_running_workers(tmp_path, config_path, capsys):
    from hacrl_fed.wire.grpc_server import serve_worker

    workers = {org: FakeWorker(org, SCRIPT_SKILLS[org]) for org in ("a", "b")}
    servers = [serve_worker(w, "127.0.0.1:0") for w in workers.values()]
    try:
        rc = cli.main(["run", str(config_path), "--run-dir", str(tmp_path / "o"), "--no-progress",
                       "--worker", f"a={servers[0].address}", "--worker", f"b={servers[1].address}"])
    finally:
        for s in servers:
            s.stop(0)
    assert rc == 0 and [r.round for r in workers["b"].train_requests] == [1, 2]
    assert "rounds (0 skipped)" in capsys.readouterr().out
    rec = json.loads((tmp_path / "o" / "metrics.jsonl").read_text().splitlines()[1])
    assert rec["bytes/step/a"] > 0 and rec["round/a/messages"] == 1.0


def test_run_grpc_launching_workers(tmp_path, config_path, monkeypatch, capsys):
    monkeypatch.setattr(launcher, "DEFAULT_WORKER_COMMAND", tuple(FAKE_WORKER))
    run_dir = tmp_path / "o"
    rc = cli.main(["run", str(config_path), "--transport", "grpc", "--run-dir", str(run_dir), "--no-progress",
                   "--ready-timeout-s", "60"])
    assert rc == 0, capsys.readouterr().err
    log_a = (run_dir / "logs" / "a.log").read_text()
    assert f"run_dir={run_dir}, resume=False" in log_a and "listening on" in log_a
    assert json.loads((run_dir / "coordinator_state.json").read_text())["round"] == 2
    rc = cli.main(["run", str(config_path), "--transport", "grpc", "--run-dir", str(run_dir), "--no-progress",
                   "--resume", "--set", "federation.rounds=3"])
    assert rc == 0, capsys.readouterr().err
    assert f"run_dir={run_dir}, resume=True" in (run_dir / "logs" / "b.log").read_text()
    assert yaml.safe_load((run_dir / "worker_config.yaml").read_text())["federation"]["rounds"] == 3


def test_each_command_gets_its_argv(monkeypatch):
    import hacrl_fed.cli.worker as worker
    import hacrl_fed.cli.zoo as zoo

    seen = {}
    monkeypatch.setattr(zoo, "main", lambda argv: seen.setdefault("zoo", argv) and 0)
    monkeypatch.setattr(worker, "main", lambda argv: seen.setdefault("worker", argv) and 3)
    assert cli.main(["zoo", "build", "all"]) == 0
    assert cli.main(["worker", "--config", "x.yaml", "--org", "a"]) == 3
    assert seen == {"zoo": ["build", "all"], "worker": ["--config", "x.yaml", "--org", "a"]}


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "hacrl_fed.cli", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "simulate" in out.stdout and "run" in out.stdout
    bare = subprocess.run([sys.executable, "-m", "hacrl_fed.cli"], capture_output=True, text=True, timeout=60)
    assert bare.returncode == 2


def _parsers():
    """Every command parser that takes overrides, built as the command builds it."""
    import hacrl_tools.bench.learning
    import hacrl_tools.bench.system
    import hacrl_tools.deploy_local
    from hacrl_fed.cli import bench, config, deploy_local, run, simulate, worker

    return {
        "run": (run.build_parser(), ["c.yaml"]),
        "worker": (worker.build_parser(), ["--config", "c.yaml", "--listen", "unix:/x"]),
        "simulate": (simulate.build_parser(), ["c.yaml"]),
        "config": (config.build_parser(), ["--config", "c.yaml"]),
        "deploy-local": (deploy_local.build_parser(hacrl_tools.deploy_local), ["--config", "c.yaml"]),
        "bench learning": (bench.learning_parser(hacrl_tools.bench.learning), []),
        "bench system": (bench.system_parser(hacrl_tools.bench.system), []),
    }


@pytest.mark.parametrize("name", list(_parsers()))
def test_set_has_one_meaning_in_every_command(name):
    parser, required = _parsers()[name]
    args = parser.parse_args([*required, "--set", "a=1", "b=2", "--set", "c=3"])
    assert args.overrides == ["a=1", "b=2", "c=3"]
    assert parser.parse_args(required).overrides == []


def test_exit_code_rules(capsys):
    from hacrl_fed.cli.common import UsageError, run_command
    from hacrl_fed.config import BuildError

    def boom(err):
        def work():
            raise err
        return work

    assert run_command("p", lambda: None) == 0 and run_command("p", lambda: 3) == 3
    assert run_command("p", boom(UsageError("bad --x"))) == 2
    assert capsys.readouterr().err.strip() == "p: error: bad --x"
    assert run_command("p", boom(BuildError("model.path: missing"))) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("p: error: model.path: missing (traceback in ") and len(err.splitlines()) == 1
    Path(err.rsplit("traceback in ", 1)[1].rstrip(")")).unlink()
    assert run_command("p", boom(KeyError("k")), bad_input=(KeyError,)) == 2
    Path(capsys.readouterr().err.rsplit("traceback in ", 1)[1].strip().rstrip(")")).unlink()
    assert run_command("p", boom(RuntimeError("down")), failure_detail=lambda: " (see x.log)") == 1
    assert capsys.readouterr().err.strip() == "p: failed: RuntimeError: down (see x.log)"
    assert run_command("p", boom(KeyboardInterrupt()), interrupted=" (resume)") == 1
    assert capsys.readouterr().err.strip() == "p: interrupted (resume)"
    assert run_command("p", boom(BrokenPipeError())) == 141  # `hacrl-fed config --describe | head`: quiet
    assert capsys.readouterr().err == ""


def test_a_closed_pipe_ends_the_command_quietly():
    proc = subprocess.run(
        f"{shlex.quote(sys.executable)} -m hacrl_fed.cli config --describe | head -c 1 >/dev/null; "
        "echo ${PIPESTATUS[0]}",
        shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[1],
    )
    assert proc.stdout.strip() in ("0", "141") and "Traceback" not in proc.stderr, proc.stderr


def test_tools_commands_say_in_one_line_when_the_tools_are_absent(tmp_path, monkeypatch, capsys):
    class NoTools:  # a Python without the hacrl_tools package: its import finds nothing
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "hacrl_tools":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    for mod in [m for m in sys.modules if m == "hacrl_tools" or m.startswith("hacrl_tools.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(sys, "meta_path", [NoTools, *sys.meta_path])
    monkeypatch.chdir(tmp_path)  # not a checkout
    for argv in (["bench", "report"], ["deploy-local", "--config", "c.yaml"], ["gpu-check", "--dry-run"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "the tools package 'hacrl_tools' is not installed" in err, err


def test_from_a_checkout_the_tools_are_found_in_the_working_directory(tmp_path, monkeypatch):
    """An install that left the tools out (an older editable install): the checkout in the cwd provides them.
    The tools package gets a name no install provides, so the fallback runs whatever this venv has installed."""
    from hacrl_fed.cli import common
    from hacrl_fed.cli.common import load_tools

    name = "hacrl_tools_checkout_probe"
    monkeypatch.setattr(common, "TOOLS", name)
    checkout = tmp_path / "checkout"
    (checkout / name).mkdir(parents=True)
    (checkout / name / "__init__.py").write_text("")
    (checkout / name / "probe.py").write_text("WHERE = 'checkout'\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(checkout)
    try:
        assert load_tools("probe", "hacrl-fed bench").WHERE == "checkout"
        assert sys.path[0] == str(checkout)
    finally:
        for mod in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
            del sys.modules[mod]
