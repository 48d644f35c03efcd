"""A benchmark's slowdown, ``HACRL_FED_BENCH_SLOWDOWN`` (hacrl_fed/worker/pacing.py; ``orgs[].emulate_slowdown``
until issue 42): a paced worker's step takes F times its compute time, every other call goes through untouched,
F = 1 is no wrapper; ``hacrl-fed worker`` serves the paced worker; the transports that build every worker in one
process refuse it in one line naming it; a run config naming the old field is refused, naming it."""

from __future__ import annotations

import time

import pytest
import yaml

from hacrl_fed.config import ConfigError, load_config
from hacrl_fed.worker.pacing import SLOWDOWN_ENV, PacedWorker, paced, slowdowns

ORGS = [{"id": "acme", "model": {"zoo": "micro-qwen-char"}}, {"id": "globex", "model": {"zoo": "micro-gpt2-bpe"}}]


class Clock:
    """A fake clock the fake worker's step advances and the pacing's sleep advances too."""

    def __init__(self) -> None:
        self.now, self.sleeps = 100.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class StepWorker:
    """A worker whose step takes ``step_s`` (on ``clock``, or for real) and records every call."""

    org_id = "globex"

    def __init__(self, step_s: float, clock: Clock | None = None, fail: bool = False):
        self.step_s, self.clock, self.fail, self.calls = step_s, clock, fail, []

    def step(self, request):
        self.calls.append(("step", request))
        if self.clock is None:
            time.sleep(self.step_s)
        else:
            self.clock.now += self.step_s
        if self.fail:
            raise RuntimeError("out of memory")
        return f"reply to {request}"

    def health(self):
        self.calls.append(("health", None))
        return {"org_id": self.org_id, "status": "ok", "round": "0"}

    def evaluate(self, request):
        self.calls.append(("evaluate", request))
        return "report"


def test_a_paced_step_sleeps_f_minus_one_times_its_measured_seconds():
    clock = Clock()
    inner = StepWorker(0.5, clock)
    worker = PacedWorker(inner, 4.0, clock=clock, sleep=clock.sleep)
    assert worker.step("r1") == "reply to r1"
    assert clock.sleeps == [pytest.approx(1.5)] and clock.now == pytest.approx(102.0)  # 0.5 s of compute, 4x
    inner.step_s = 0.25
    worker.step("r2")
    assert clock.sleeps[1] == pytest.approx(0.75) and worker.slept_s == pytest.approx(2.25)


def test_other_calls_and_attributes_go_through_untouched():
    clock = Clock()
    inner = StepWorker(0.5, clock)
    worker = PacedWorker(inner, 3.0, clock=clock, sleep=clock.sleep)
    assert worker.health()["status"] == "ok" and worker.evaluate("e") == "report"
    assert worker.org_id == "globex" and worker.worker is inner
    assert clock.sleeps == [] and inner.calls == [("health", None), ("evaluate", "e")]
    with pytest.raises(AttributeError):
        worker.no_such_method  # noqa: B018


def test_a_failing_step_is_paced_too_and_raises():
    clock = Clock()
    worker = PacedWorker(StepWorker(0.2, clock, fail=True), 2.0, clock=clock, sleep=clock.sleep)
    with pytest.raises(RuntimeError, match="out of memory"):
        worker.step("r")
    assert clock.sleeps == [pytest.approx(0.2)]


def test_a_paced_step_takes_about_f_times_for_real():
    worker = paced(StepWorker(0.05), 3.0)
    t0 = time.perf_counter()
    worker.step("r")
    took = time.perf_counter() - t0
    assert 0.149 <= took < 0.5, took  # 0.05 s of "compute", 3x; the upper bound leaves room for a loaded CPU


def test_slowdown_one_is_no_wrapper():
    inner = StepWorker(0.0)
    assert paced(inner, 1.0) is inner
    with pytest.raises(ValueError, match="factor > 1"):
        PacedWorker(inner, 1.0)


def test_hacrl_fed_worker_serves_the_paced_worker(tmp_path, monkeypatch):
    """serve_endpoint (the plain worker and a sharded org's rank 0) hands the gRPC server the paced worker."""
    from hacrl_fed.cli import worker as cli_worker

    served = []

    class Server:
        address = "unix:/x.sock"

        def stop(self, grace):
            return type("Stopped", (), {"wait": lambda self: None})()

    def fake_serve(worker, listen, **kw):
        served.append(worker)
        return Server()

    monkeypatch.setattr(cli_worker, "serve_worker", fake_serve)
    monkeypatch.setenv(SLOWDOWN_ENV, "globex=4")
    cfg = _cfg("grpc")
    p = cli_worker.build_parser()
    args = p.parse_args(["--config", "x.yaml", "--listen", f"unix:{tmp_path}/w.sock"])
    stop = cli_worker.threading.Event()
    stop.set()
    for org, factor in (("acme", None), ("globex", 4.0)):
        inner = StepWorker(0.0)
        assert cli_worker.serve_endpoint(args, p, cfg, org, inner, link=(None, False), stop=stop) == 0
        if factor is None:
            assert served[-1] is inner
        else:
            assert isinstance(served[-1], PacedWorker) and served[-1].worker is inner and served[-1].factor == 4.0


def _cfg(transport: str = "inprocess", **fed):
    return load_config({"name": "pace", "orgs": ORGS, "federation": {"transport": transport, **fed}})


def test_the_slowdown_is_the_benchmarks_environment_and_a_config_naming_the_old_field_is_refused():
    cfg = _cfg()
    assert slowdowns(cfg, {}) == {} and slowdowns(cfg, {SLOWDOWN_ENV: ""}) == {}  # the default: no slowdown
    assert slowdowns(cfg, {SLOWDOWN_ENV: "globex=4"}) == {"globex": 4.0}
    assert slowdowns(cfg, {SLOWDOWN_ENV: "acme=1.5, globex=4"}) == {"acme": 1.5, "globex": 4.0}
    for bad in ("globex", "globex=0.5", "nobody=2", "globex=x", "globex=inf"):
        with pytest.raises(ConfigError, match=f"{SLOWDOWN_ENV}: '{bad}' is not ORG=F"):
            slowdowns(cfg, {SLOWDOWN_ENV: bad})
    orgs = [ORGS[0], dict(ORGS[1], emulate_slowdown=4.0)]
    with pytest.raises(ConfigError, match=r"orgs\.1: emulate_slowdown is a benchmark-only setting, .*"
                                          + SLOWDOWN_ENV):  # fmt: skip
        load_config({"name": "pace", "orgs": orgs, "federation": {"transport": "grpc"}})


def test_run_with_transport_inprocess_and_the_flower_simulation_refuse_it(tmp_path, capsys, monkeypatch):
    from hacrl_fed.cli.run import main as run_main
    from hacrl_fed.flower.simulation import simulate

    monkeypatch.setenv(SLOWDOWN_ENV, "globex=4")
    data = _cfg("grpc").model_dump(mode="json")
    config = tmp_path / "pace.yaml"
    config.write_text(yaml.safe_dump(data))
    assert run_main([str(config), "--transport", "inprocess", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{SLOWDOWN_ENV} slows ['globex']" in err[0] and "--transport inprocess" in err[0], err
    assert not (tmp_path / "r").exists()
    data["federation"]["transport"] = "flower"
    config.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=SLOWDOWN_ENV + r" slows \['globex'\] .*the Flower simulation"):
        simulate(config, run_dir=tmp_path / "f")
