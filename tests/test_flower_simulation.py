"""``hacrl-fed simulate`` end to end on Flower's Simulation Engine (Ray), with fake workers (no models).

Ray's start dominates (~15-25 s on 2 cores), so these are marked slow. The fake workers are built inside the
Ray actor through ``--worker-factory`` (this module is importable there: Flower copies ``sys.path``, which holds
``tests/``, into the Ray workers' ``PYTHONPATH``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from hacrl_fed.flower.settings import ENV_VAR
from hacrl_fed.cli.simulate import main as main_simulate
from hacrl_fed.flower.simulation import RAY_START_TRIES, backend_config, find_app_dir, start_ray
from helpers_fake_workers import FakeWorker

SKILLS = {"a": 0.25, "b": 0.75}
LIAR = "liar"  # claims reward 1.0 on every rollout; in the two-round test only


def make_fake_worker(cfg, org_id, *, run_dir, resume=False):
    """``worker-factory`` for the simulation: a FakeWorker that also records its process id in the run dir."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    Path(run_dir, f"built-{org_id}-{os.getpid()}").touch()
    if org_id == LIAR:
        return FakeWorker(org_id, 0.5, lie_rewards=True)
    return FakeWorker(org_id, SKILLS[org_id])


def _config(tmp_path: Path, *, orgs=tuple(SKILLS), **federation) -> Path:
    fed = {"rounds": 2, "prompts_per_round": 2, "eval_every": 1, "min_orgs": 2, "round_timeout_s": 60.0,
           **federation}
    data = {"name": "sim", "seed": 5, "run_dir": str(tmp_path / "runs"),
            "generation": {"num_samples": 2, "max_new_tokens": 8, "eval_max_new_tokens": 8},
            "task": {"name": "arithmetic", "params": {"difficulty": 1}, "eval_size": 3},
            "orgs": [{"id": o, "model": {"zoo": "tiny"}} for o in orgs], "federation": fed,
            "security": {"signing": False}}  # fake workers do not sign
    path = tmp_path / "sim.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_backend_config_gives_one_actor_everything():
    assert backend_config(4, 1) == {"client_resources": {"num_cpus": 4, "num_gpus": 1},
                                    "init_args": {"num_cpus": 4, "num_gpus": 1}}
    with pytest.raises(ValueError, match="num_cpus >= 1"):
        backend_config(0, 0)


class _FakeRay:
    """``ray`` for :func:`start_ray`: each init raises the next of ``errors`` (None: starts)."""

    def __init__(self, *errors):
        self.errors, self.calls, self.running = list(errors), [], False

    def is_initialized(self):
        return self.running

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        error = self.errors.pop(0) if self.errors else None
        if error is not None:
            raise error
        self.running = True

    def shutdown(self):
        self.calls.append(("shutdown", {}))
        self.running = False


def test_a_ray_start_that_timed_out_is_retried_and_any_other_error_raised(monkeypatch):
    import sys

    timeout = Exception("The current node timed out during startup. This could happen because ...")
    ray = _FakeRay(timeout, None)
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    start_ray(backend_config(2, 0))
    assert [c for c, _ in ray.calls] == ["init", "shutdown", "init"] and ray.running
    kwargs = ray.calls[-1][1]
    assert kwargs["num_cpus"] == 2 and kwargs["num_gpus"] == 0 and kwargs["include_dashboard"] is False
    paths = kwargs["runtime_env"]["env_vars"]["PYTHONPATH"].split(os.pathsep)
    assert paths[: len(sys.path)] == sys.path and paths[-1] == "/elsewhere"  # the ClientApp actor finds our modules
    start_ray(backend_config(2, 0))  # already running: nothing
    assert len(ray.calls) == 3
    ray = _FakeRay(*[timeout] * RAY_START_TRIES)
    monkeypatch.setitem(sys.modules, "ray", ray)
    with pytest.raises(Exception, match="timed out during startup"):
        start_ray(backend_config(1, 0))
    assert [c for c, _ in ray.calls].count("init") == RAY_START_TRIES
    ray = _FakeRay(ValueError("bad init args"))
    monkeypatch.setitem(sys.modules, "ray", ray)
    with pytest.raises(ValueError, match="bad init args"):
        start_ray(backend_config(1, 0))
    assert [c for c, _ in ray.calls] == ["init"]


def test_find_app_dir(tmp_path):
    assert (find_app_dir() / "server" / "app.py").is_file()
    with pytest.raises(FileNotFoundError, match="no Flower app"):
        find_app_dir(tmp_path)


def test_bad_config_exits_2_before_starting_ray(tmp_path, capsys):
    assert main_simulate([str(_config(tmp_path)), "--set", "federation.rounds=0"]) == 2
    assert "federation.rounds" in capsys.readouterr().err
    assert ENV_VAR not in os.environ


def test_run_dir_checks_exit_2_before_starting_ray(tmp_path, capsys):
    config = str(_config(tmp_path))
    assert main_simulate([config, "--run-dir", str(tmp_path / "fresh"), "--resume"]) == 2
    assert "no run to resume" in capsys.readouterr().err
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "coordinator_state.json").write_text("{}")
    assert main_simulate([config, "--run-dir", str(tmp_path / "used")]) == 2
    assert "already holds a run" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_rounds_over_the_simulation_engine(tmp_path, capsys):
    run_dir = tmp_path / "run"
    config = _config(tmp_path, orgs=(*SKILLS, LIAR))
    rc = main_simulate([str(config), "--run-dir", str(run_dir), "--num-cpus", "1",
                        "--worker-factory", "test_flower_simulation:make_fake_worker", "--set", "seed=9"])
    assert rc == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1, 2]
    for rec in records[1:]:
        for org in SKILLS:
            assert rec[f"bytes/step/{org}"] > 0  # one fused message a round (two in the last: its train alone)
            assert rec[f"round/{org}/messages"] == (1.0 if rec["round"] < 2 else 2.0)
            assert rec[f"round/{org}/failed"] == 0.0 and rec[f"round/{org}/rollouts_accepted"] == 4.0
            assert rec[f"{org}/hacpo/foreign"] == 4.0  # the honest other org's rollouts, never the liar's
    # the lying org: caught by re-verification in round 1, excluded from the pool, honest orgs trained that round
    r1, r2 = records[1], records[2]
    assert r1[f"round/{LIAR}/rejected/reward_mismatch"] == 2.0 and r1[f"round/{LIAR}/rollouts_accepted"] == 0.0
    assert r1[f"security/{LIAR}/excluded"] == 1.0 and r1[f"round/{LIAR}/failure/excluded"] == 1.0
    assert r2[f"round/{LIAR}/failure/excluded"] == 1.0 and f"bytes/step/{LIAR}" not in r2
    assert r1["round/orgs_trained"] == 2.0
    state = json.loads((run_dir / "coordinator_state.json").read_text())
    assert state["round"] == 2
    built = sorted(p.name for p in run_dir.glob("built-*"))
    assert [name.split("-")[1] for name in built] == ["a", "b", LIAR]  # one worker per org ...
    assert len({name.split("-")[2] for name in built}) == 1  # ... both in the single ClientApp actor
    assert ENV_VAR not in os.environ
    captured = capsys.readouterr()
    out = captured.out  # the final per-org table is the last thing printed
    assert out.splitlines()[0].startswith("org ") and "outputs in" in out.splitlines()[-1]
    assert "round 1/2 in " in captured.err and "round 2/2 in " in captured.err  # progress: one line per round
    summary = (run_dir / "summary.txt").read_text()
    assert summary.splitlines()[0].startswith("org ") and f"{LIAR} EXCLUDED from the pool: reward mismatch" in summary
    # the shared run lifecycle: the real transport, and Flower's run id next to hacrl's
    assert "\n# transport: flower-simulation\n" in (run_dir / "config.yaml").read_text()
    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["transport"] == "flower-simulation" and info["run_id"] == state["run_id"]
    assert isinstance(info["flower_run_id"], int) and f"Flower run id {info['flower_run_id']}" in summary
    assert info["sessions"][0]["entry"] == "hacrl-fed simulate" and info["status"] == "completed"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_asynchronous_rounds_over_the_simulation_engine(tmp_path):
    """K = 1 on Ray: each step pushed alone, its reply pulled as it comes (the orgs share one ClientApp actor, so
    their steps run one after another); every round logged once, each org trains every round, and every foreign
    batch is trained on once or counted refused."""
    run_dir = tmp_path / "run"
    config = _config(tmp_path, rounds=3, min_orgs=1, staleness=1)
    rc = main_simulate([str(config), "--run-dir", str(run_dir), "--num-cpus", "1",
                        "--worker-factory", "test_flower_simulation:make_fake_worker"])
    assert rc == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    assert records[-1]["async/a/version"] == records[-1]["async/b/version"] == 3
    for org, other in (("a", "b"), ("b", "a")):  # b's batches of rounds 1-3 at a, and a's at b: taken or refused
        taken = sum(r.get(f"{org}/hacpo/foreign", 0.0) for r in records) / 4  # 4 rollouts a batch
        refused = sum(v for r in records for k, v in r.items() if k.startswith(f"round/{org}/refused/"))
        assert taken + refused == 3, (org, taken, refused)
    assert all(r[f"round/{o}/rollouts_accepted"] == 4.0 for r in records[1:] for o in SKILLS)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_server_app_failure_exits_nonzero(tmp_path, capsys):
    # Both orgs' workers fail to build: no node can tell its org, discovery gives up after 3 s.
    rc = main_simulate([str(_config(tmp_path)), "--run-dir", str(tmp_path / "run"), "--num-cpus", "1",
                        "--worker-factory", "test_flower_simulation:no_such_factory", "--discovery-timeout", "3"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "DiscoveryError" in err and "only 0 of 2 orgs" in err
