"""The one run lifecycle (hacrl_fed/lifecycle.py) every entry point uses: the same outputs in the run dir for
``hacrl-fed run`` (in-process and gRPC) and the Flower ServerApp, the rerun error naming the entry point's keys
(cleanly, without a traceback, under ``flwr run``), one logging set-up, one offline environment. Fake workers, no
models: seconds. (The simulation and the deployment are checked in test_flower_simulation.py and
test_deployment.py.)"""

from __future__ import annotations

import io
import json
import logging
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml

import hacrl_fed.worker
from hacrl_fed import cli, lifecycle
from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.run_files import STATE_FILE
from hacrl_fed.lifecycle import CLI_KEYS, FLWR_KEYS, OFFLINE_ENV, Run, RunDirError, check_run_dir
from helpers_fake_workers import SCRIPT_SKILLS, FakeTask, FakeWorker, fake_config
from test_flower_transport import APP_DIR, FakeGrid, flower_identity, sim_contexts, write_config  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
OUTPUTS = (
    "config.yaml", "run_info.json", "metrics.jsonl", "coordinator_state.json", "accuracy.png", "summary.txt", "report.html"
)


def config_file(tmp_path: Path, **federation) -> Path:
    data = fake_config(orgs=("a", "b"), rounds=2, eval_every=0, **federation).model_dump(mode="json")
    data["task"] = {"name": "arithmetic", "eval_size": 4}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def check_outputs(run_dir: Path, transport: str, *, flower_run_id=None) -> dict:
    """The outputs every entry point leaves; returns run_info.json."""
    for name in OUTPUTS:
        assert (run_dir / name).is_file(), name
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    text = (run_dir / "config.yaml").read_text()
    assert f"\n# transport: {transport}\n" in text
    assert yaml.safe_load(text)["federation"]["transport"] == lifecycle.TRANSPORTS[transport]
    info = json.loads((run_dir / "run_info.json").read_text())
    state = json.loads((run_dir / STATE_FILE).read_text())
    assert info["run_id"] == state["run_id"] and info["run_dir"] == str(run_dir.absolute())
    assert info["status"] == "completed" and info["transport"] == transport
    assert info["flower_run_id"] == flower_run_id and info["sessions"][-1]["flower_run_id"] == flower_run_id
    summary = (run_dir / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("org ") and summary[-1] == f"outputs in {run_dir.absolute()}"
    assert f"hacrl run id {state['run_id']}" in summary[-2] and f"transport {transport}" in summary[-2]
    if flower_run_id is not None:
        assert f"Flower run id {flower_run_id}" in summary[-2]
    assert not (run_dir / "error.log").exists()
    return info


# ------------------------------------------------------------------------------------------------ entry points


@pytest.fixture
def fake_build(monkeypatch):
    monkeypatch.setattr(hacrl_fed.worker, "build_worker",
                        lambda cfg, org_id, *, run_dir, resume=False: FakeWorker(org_id, SCRIPT_SKILLS[org_id]))


def test_cli_inprocess_outputs_progress_lines_and_a_resume_session(tmp_path, fake_build, capsys):
    config, run_dir = config_file(tmp_path), tmp_path / "out"
    assert cli.main(["run", str(config), "--run-dir", str(run_dir), "--no-progress"]) == 0
    captured = capsys.readouterr()
    info = check_outputs(run_dir, "inprocess")
    assert captured.out.rstrip().endswith(f"outputs in {run_dir}")  # the table, the ids, the absolute path
    assert [line for line in captured.err.splitlines() if " round 1/2 in " in line]  # one INFO line per round
    assert "eval at round 2: held-out accuracy" in captured.err
    assert cli.main(["run", str(config), "--run-dir", str(run_dir), "--no-progress", "--resume",
                     "--set", "federation.rounds=3"]) == 0
    resumed = check_outputs(run_dir, "inprocess")
    assert resumed["run_id"] == info["run_id"]
    assert [s["resumed"] for s in resumed["sessions"]] == [False, True]
    assert [s["rounds_completed"] for s in resumed["sessions"]] == [2, 3]


def test_cli_grpc_outputs_the_same(tmp_path, capsys):
    from hacrl_fed.wire.grpc_server import serve_worker

    servers = [serve_worker(FakeWorker(org, SCRIPT_SKILLS[org]), "127.0.0.1:0") for org in ("a", "b")]
    try:
        rc = cli.main(["run", str(config_file(tmp_path)), "--run-dir", str(tmp_path / "o"), "--no-progress",
                       "--worker", f"a={servers[0].address}", "--worker", f"b={servers[1].address}"])
    finally:
        for s in servers:
            s.stop(0)
    assert rc == 0, capsys.readouterr().err
    check_outputs(tmp_path / "o", "grpc")


def test_server_app_outputs_the_same_with_the_flower_run_id(tmp_path, monkeypatch):
    from hacrl_fed.flower import node
    from hacrl_fed.flower.federation import run_federation
    from hacrl_fed.flower.settings import ENV_VAR

    monkeypatch.delenv(ENV_VAR, raising=False)
    config, run_dir = write_config(tmp_path), tmp_path / "run"
    run_config = {"config-path": str(config), "run-dir": str(run_dir), "overrides": "federation.rounds=2"}
    try:
        run_federation(FakeGrid(sim_contexts(config, 2, **run_config)), run_config, app_dir=APP_DIR,
                       flower_run_id=7016016346261675442)
    finally:
        node.release_simulation_workers()
    info = check_outputs(run_dir, "flower-deployment", flower_run_id=7016016346261675442)
    assert info["sessions"][0]["entry"] == "flwr run (ServerApp)"


# ------------------------------------------------------------------------------------------------ failures


def test_failure_leaves_error_log_and_a_failed_status(tmp_path):
    cfg = fake_config(orgs=("a",), rounds=2)
    run = Run(cfg, tmp_path / "r", transport="inprocess")
    transport = InProcessTransport({"a": FakeWorker("a", 0.5)})
    transport.step = lambda requests, timeout_s: (_ for _ in ()).throw(RuntimeError("transport blew up"))
    with pytest.raises(RuntimeError, match="transport blew up"):
        with run:
            run.execute(transport, task=FakeTask())
    assert "RuntimeError: transport blew up" in (tmp_path / "r" / "error.log").read_text()
    assert "Traceback" in run.error_log.read_text()
    info = json.loads((tmp_path / "r" / "run_info.json").read_text())
    assert info["status"] == "failed" and info["sessions"][-1]["error"] == "RuntimeError: transport blew up"
    assert info["run_id"] == run.run_id and info["sessions"][-1]["rounds_completed"] == 0


def test_rerun_errors_name_the_keys_of_the_entry_point(tmp_path):
    (tmp_path / STATE_FILE).write_text("{}")
    with pytest.raises(RunDirError, match=r"already holds a run: pass --resume to continue it, or another --run-dir$"):
        check_run_dir(tmp_path, False, CLI_KEYS)
    with pytest.raises(RunDirError, match=r'already holds a run: set resume=true to continue it, or another '
                                          r'run-dir="DIR" in flwr run --run-config$'):
        check_run_dir(tmp_path, False, FLWR_KEYS)
    with pytest.raises(RunDirError, match=r"^resume=true: no run to resume in"):
        check_run_dir(tmp_path / "empty", True, FLWR_KEYS)


def test_flwr_run_into_a_used_run_dir_fails_with_one_line_and_no_traceback(tmp_path, monkeypatch):
    """Under flwr run the ServerApp raises RunRefused: its reason logged once, and Flower's own "ServerApp raised an
    exception" record (logged with the exception, as flwr 1.42's run_serverapp does) carries no traceback."""
    from flwr.common.logger import log as flwr_log

    from hacrl_fed.flower.federation import RunRefused, run_federation
    from hacrl_fed.flower.settings import ENV_VAR

    monkeypatch.delenv(ENV_VAR, raising=False)
    config, run_dir = write_config(tmp_path), tmp_path / "run"
    run_dir.mkdir()
    (run_dir / STATE_FILE).write_text("{}")
    (run_dir / "config.yaml").write_text("kept")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger("flwr").addHandler(handler)
    logging.getLogger("hacrl_fed").addHandler(handler)
    try:
        run_config = {"config-path": str(config), "run-dir": str(run_dir)}
        with pytest.raises(RunRefused) as info:
            run_federation(FakeGrid(sim_contexts(config, 2)), run_config, app_dir=APP_DIR)
        try:
            raise info.value
        except RunRefused as err:  # what flwr's run_serverapp does with it
            flwr_log(logging.ERROR, "%s raised an exception", "ServerApp", exc_info=err)
    finally:
        logging.getLogger("flwr").removeHandler(handler)
        logging.getLogger("hacrl_fed").removeHandler(handler)
    text = stream.getvalue()
    assert str(info.value) == f'{run_dir} already holds a run: set resume=true to continue it, or another ' \
                              f'run-dir="DIR" in flwr run --run-config'
    assert text.splitlines() == [f"ERROR hacrl_fed.flower.federation: hacrl-fed: the run is refused: {info.value}",
                                 "ERROR flwr: ServerApp raised an exception"], text
    assert (run_dir / "config.yaml").read_text() == "kept" and not (run_dir / "error.log").exists()
    bad = {"config-path": str(config), "run-dir": str(tmp_path / "x"), "overrides": "trainer.lr=-1"}
    with pytest.raises(RunRefused, match="trainer.lr"):  # a bad config is refused the same way
        run_federation(FakeGrid(sim_contexts(config, 2)), bad, app_dir=APP_DIR)


# ------------------------------------------------------------------------------------------------ shared pieces


def test_setup_logging_is_one_idempotent_handler_and_records_still_propagate(caplog, capsys):
    lifecycle.setup_logging("INFO")
    lifecycle.setup_logging("INFO")
    ours = [h for h in logging.getLogger("hacrl_fed").handlers if isinstance(h, lifecycle._StderrHandler)]
    assert len(ours) == 1
    with caplog.at_level(logging.INFO, logger="hacrl_fed"):
        logging.getLogger("hacrl_fed.test").info("progress line")
    assert "progress line" in caplog.text  # caplog (root) still sees hacrl-fed's records
    assert capsys.readouterr().err.count("INFO hacrl_fed.test: progress line") == 1  # printed once, to stderr
    lifecycle.setup_logging("WARNING")  # hacrl-fed simulate --log-level WARNING ...
    lifecycle.setup_logging(None, others=None)  # ... then its ServerApp: the level stays
    assert logging.getLogger("hacrl_fed").level == logging.WARNING
    lifecycle.setup_logging("INFO")


def test_accuracy_plot_has_a_title_and_integer_round_ticks(tmp_path, monkeypatch):
    import matplotlib.figure

    from hacrl_fed.metrics import RunLogger, plot_accuracy

    with RunLogger(tmp_path, tensorboard=False) as logger:
        for t in (0, 1, 2, 3):
            logger.log(t, {"eval/a/accuracy": 0.1 * t})
    seen = []
    real = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: (seen.append(fig), real(fig, *a, **k))[1])
    plot_accuracy(tmp_path, title="demo: held-out accuracy")
    ax = seen[0].axes[0]
    assert ax.get_title() == "demo: held-out accuracy"
    ticks = [t for t in ax.get_xticks() if 0 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks)


def _make_env(text: str) -> dict[str, str]:
    """``NAME=value`` assignments of the Makefile's ``RUN_ENV`` (continuation lines joined)."""
    body = re.search(r"^RUN_ENV := (.*?)(?<!\\)\n", text, re.M | re.S)[1].replace("\\\n", " ")
    return dict(item.split("=", 1) for item in shlex.split(body))


def test_one_offline_environment(tmp_path):
    from hacrl_tools.deploy_local import Deployment

    import conftest

    assert conftest.OFFLINE_ENV is OFFLINE_ENV
    assert _make_env((REPO / "Makefile").read_text()) == OFFLINE_ENV  # the Makefile's shell copy agrees
    ci = dict(re.findall(r"^export (\w+)=(\S+)$", (REPO / ".ci" / "run").read_text(), re.M))
    assert {k: ci[k] for k in OFFLINE_ENV} == OFFLINE_ENV  # and so does .ci/run's
    env = Deployment(tmp_path).env("x")
    assert {k: env[k] for k in OFFLINE_ENV} == OFFLINE_ENV  # every process of the deployment harness
    assert lifecycle.FLOWER_ENV.items() <= OFFLINE_ENV.items()  # what the simulation sets where unset
    assert sys.modules["hacrl_fed.lifecycle"] is lifecycle
