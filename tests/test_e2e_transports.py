"""The transports are faithful: same seed and config → the same per-round rewards and losses in-process, over
gRPC worker processes, and over the Flower Simulation Engine (real micro agents, real processes).

Each (transport, protocol) run is made once per module (:func:`runs`): the default protocol is fused, so the fused
run of each transport serves both the transport comparison and that transport's fused/two-message comparison.
"""

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from hacrl_fed.flower.simulation import simulate

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"
# the micro agents answer almost nothing right: rule all sends every foreign row to the update (the default,
# successes, would send almost none), so the cross ratios fingerprint each foreign text and claimed log-prob
OVERRIDES = ["federation.rounds=2", "federation.eval_every=1", "task.eval_size=8", "trainer.selection.rule=all"]
COMPARED = ("accuracy", "train/loss", "hacpo/cross_ratio_mean", "hacpo/self_ratio_mean", "train/grad_norm")


def _cli_run(run_dir: Path, *extra: str) -> None:
    cmd = [sys.executable, "-m", "hacrl_fed.cli", "run", str(CONFIG), "--run-dir", str(run_dir), "--no-progress",
           *[a for o in OVERRIDES for a in ("--set", o)], *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _rows(run_dir: Path) -> dict[int, dict[str, float]]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        keep = {k: v for k, v in rec.items() if any(k.endswith(c) for c in COMPARED) and v is not None}
        out.setdefault(rec["round"], {}).update(keep)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Callable[[str, str | None], Path]:
    """``runs(transport, protocol)``: the run dir of CONFIG + OVERRIDES over ``transport`` with
    ``federation.protocol=protocol`` (None: the config's default), run on first use and reused after."""
    root = tmp_path_factory.mktemp("e2e")
    made: dict[tuple[str, str | None], Path] = {}

    def run(transport: str, protocol: str | None) -> Path:
        if (transport, protocol) not in made:
            run_dir = root / f"{transport}-{protocol or 'default'}"
            extra = [] if protocol is None else [f"federation.protocol={protocol}"]
            if transport == "flower-simulation":
                simulate(CONFIG, OVERRIDES + extra, run_dir=run_dir)
            else:
                grpc = ["--transport", "grpc"] if transport == "grpc" else []
                _cli_run(run_dir, *[a for o in extra for a in ("--set", o)], *grpc)
            made[transport, protocol] = run_dir
        return made[transport, protocol]

    return run


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_inprocess_grpc_and_flower_simulation_agree(runs):
    dirs = {name: runs(name, None) for name in ("inprocess", "grpc", "flower-simulation")}
    ref = _rows(dirs["inprocess"])
    assert sorted(ref) == [0, 1, 2]
    assert any(k.startswith("round/acme/accuracy") for k in ref[1]) and any("train/loss" in k for k in ref[2])
    # cross ratios depend on every foreign response's text and source log-prob: a strong fingerprint
    assert any(abs(v - 1) > 1e-3 for m in ref.values() for k, v in m.items() if k.endswith("cross_ratio_mean"))
    for name in ("grpc", "flower-simulation"):
        got = _rows(dirs[name])
        assert sorted(got) == sorted(ref), name
        for rnd, metrics in ref.items():
            assert set(got[rnd]) >= set(metrics), (name, rnd, set(metrics) - set(got[rnd]))
            for key, value in metrics.items():
                assert got[rnd][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, rnd, key)


def _learning(run_dir: Path) -> dict[int, dict[str, float]]:
    """Every per-round metric that depends on weights and data (no timings, sizes, message counts, wall clocks)."""
    out: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        keep = {k: v for k, v in rec.items()
                if not {"time", "cpu", "bytes", "messages", "wall_time", "perf"} & set(k.split("/"))}
        out.setdefault(rec["round"], {}).update(keep)
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", ["inprocess", "grpc", "flower-simulation"])
def test_fused_and_two_message_protocols_give_identical_numbers(runs, transport):
    """The same seeded run with federation.protocol fused (the default: the run the transport comparison made) and
    two_message: identical rewards, accepted / rejected counts, losses and final accuracies (exact equality), and one
    message per org per round with fused."""
    dirs = {"two_message": runs(transport, "two_message"), "fused": runs(transport, None)}
    two, fused = _learning(dirs["two_message"]), _learning(dirs["fused"])
    assert sorted(two) == [0, 1, 2] and any(k.endswith("train/loss") for k in two[2])
    for key in ("round/acme/accuracy", "round/acme/rollouts_accepted", "round/acme/rollouts_rejected",
                "acme/train/loss", "eval/acme/accuracy"):
        assert key in two[2], key
    assert fused == two
    for t in (1, 2):  # every plan carried its learner's latest challenge (Health, then reports): nothing stale
        fresh = {k: v for k, v in two[t].items() if k.endswith("/trust/plan_fresh")}
        assert len(fresh) == 2 and all(v == 1.0 for v in fresh.values()), (t, fresh)
        assert not any(k.endswith("rejected/stale_plan") for k in two[t]), t
        assert two[t]["acme/trust/globex/accepted"] > 0 and two[t]["globex/trust/acme/accepted"] > 0
    sent = {protocol: {t: {k: v for k, v in json.loads(line).items() if k.endswith("/messages")}
                       for t, line in enumerate((dirs[protocol] / "metrics.jsonl").read_text().splitlines())}
            for protocol in ("two_message", "fused")}
    assert all(v == 2.0 for m in list(sent["two_message"].values())[1:] for v in m.values())
    assert sent["fused"][1] and all(v == 1.0 for v in sent["fused"][1].values())  # round 1 of 2: one message
