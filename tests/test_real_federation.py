"""One federation of the two packaged real checkpoints end to end (issue 43): ``configs/real.yaml`` (SmolLM2-135M
and Gemma 3 270M base, each in the few-shot completion format) made tiny (2 rounds, 2 prompts x 2 samples, 4
held-out prompts, the outcome guard's validation and final splits 8 prompts each, its smallest: see ``TINY``),
every other setting the default: the outcome guard on with its shadow, validating after both rounds and checking
the counterfactual at the last. It checks that both orgs' responses stop, the round, intake, guard and evaluation
metrics are there, checkpoints are saved, and ``hacrl-fed export`` + ``hacrl-fed eval`` give back the
coordinator's last held-out accuracy for each org. The run's directory (GBs of checkpoints and guard files) is
deleted after the module.

Needs ``make real-models`` (``make test`` runs it first); skipped, with the reason, only when those packages are
missing. The checkpoints' conversions are cached in ``~/.cache/hacrl_fed/real`` between runs.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from hacrl_fed.cli import main
from hacrl_fed.export import find_checkpoint
from hacrl_fed.metrics import read_metrics
from hacrl_fed.models import real

ROOT = Path(__file__).resolve().parent.parent
MISSING = [m for m in ("gguf", *(e.module for e in real.REAL.values())) if importlib.util.find_spec(m) is None]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(MISSING), reason=f"real checkpoints not installed (`{real.INSTALL}`): {MISSING}"),
]
ORGS = ("smol", "gemma")
TINY = {  # configs/real.yaml, smaller: what the test needs to see, not learning
    ("federation", "prompts_per_round"): 2,
    ("generation", "num_samples"): 2,
    ("generation", "max_new_tokens"): 12,
    ("generation", "eval_max_new_tokens"): 12,
    ("task", "eval_size"): 4,
    # the guard as configured (every 2: it validates after both rounds, the shadow's counterfactual at the last),
    # on the smallest validation split it allows and as many final prompts: it validates, it is not measured here
    ("trainer", "outcome_guard"): {"every": 2, "val_size": 8, "final_size": 8},
}


def _config(tmp_path: Path) -> Path:
    data = yaml.safe_load((ROOT / "configs" / "real.yaml").read_text())
    for (section, key), value in TINY.items():
        data[section][key] = value
    data["run_dir"] = str(tmp_path / "runs")
    path = tmp_path / "real.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, real_model_lock) -> Iterator[Path]:
    """The run, deleted after the module whatever the outcome (GBs of checkpoints and guard files: pytest's
    retention policy keeps a failed test's tmp_path, and does not cover tmp_path_factory dirs under xdist)."""
    tmp = tmp_path_factory.mktemp("real")
    out = tmp / "run"
    try:
        assert main(["run", str(_config(tmp)), "--run-dir", str(out), "--no-progress"]) == 0
        yield out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_both_orgs_stop_train_and_are_evaluated(run_dir):
    records = read_metrics(run_dir)
    rounds = [r for r in records if r.get("round", 0) >= 1 and f"round/{ORGS[0]}/stopped_frac" in r]
    assert [r["round"] for r in rounds] == [1, 2]
    for org in ORGS:
        other = ORGS[1 - ORGS.index(org)]
        for rec in rounds:
            assert rec[f"round/{org}/stopped_frac"] >= 0.95, (org, rec["round"])
            assert f"{org}/intake/{other}/received" in rec and f"{org}/intake/{other}/kept" in rec
        assert [rec[f"{org}/outcome/validated"] for rec in rounds] == [1.0, 1.0], org  # the guard validated
        assert f"{org}/outcome/cf_read" in rounds[-1], org  # and compared the learner with its shadow
        evals = [r[f"eval/{org}/accuracy"] for r in records if f"eval/{org}/accuracy" in r]
        assert len(evals) >= 2 and all(0.0 <= a <= 1.0 for a in evals)  # before round 1 and after the last
        _, checkpoint = find_checkpoint(run_dir, org)
        assert checkpoint.name == "round-000002" and (checkpoint / "model.safetensors").is_file(), checkpoint
        # the guard's reference and shadow are files of their own, not a second copy inside trainer.pt (which
        # holds the optimizer's two moments: about twice the weights, tied embeddings written once)
        assert all((checkpoint / "files" / f"outcome_guard.{p}.pt").is_file() for p in ("reference", "shadow"))
        sizes = {f: (checkpoint / f).stat().st_size for f in ("trainer.pt", "model.safetensors")}
        assert sizes["trainer.pt"] < 2.5 * sizes["model.safetensors"], sizes


@pytest.mark.parametrize("org", ORGS)
def test_export_and_eval_round_trip(run_dir, tmp_path, capsys, org):
    out = tmp_path / org
    assert main(["export", str(run_dir), "--org", org, "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["eval", str(out), "--k", "1", "--device", "cpu"]) == 0
    scored = json.loads(capsys.readouterr().out)
    last = [r for r in read_metrics(run_dir) if f"eval/{org}/accuracy" in r][-1]
    assert scored["eval/prompts"] == 4
    assert scored["eval/accuracy"] == pytest.approx(last[f"eval/{org}/accuracy"])
