"""scripts/screen_calibration.py with the attacks of scripts/harm_attacks.py (issue 27): the attack reaches what the
victim is sent under both protocols (a past bug: the fused Step ran the wrapped worker's own generate and published
undoctored text), every doctored row keeps its verified reward, and the run records the victim's counters and its
trigger adoption. Micro agents of one tokenizer (as in ``configs/bench/state.yaml``), two rounds."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
ROUNDS, B, G = 2, 4, 4


@pytest.fixture()
def calibration(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    for name in ("screen_calibration", "harm_attacks"):
        sys.modules.pop(name, None)
    import screen_calibration

    return screen_calibration


def _config(tmp_path: Path) -> Path:
    cfg = {
        "name": "harm", "seed": 0,
        "orgs": [{"id": "acme", "model": {"zoo": "micro-qwen-char"}},
                 {"id": "globex", "model": {"zoo": "micro-qwen-char"}}],
        "algorithm": {"name": "hacpo"},
        "trainer": {"lr": 1e-3, "minibatch_size": 64, "micro_batch_size": 32},
        "generation": {"num_samples": G, "max_new_tokens": 24, "eval_max_new_tokens": 24},
        "task": {"name": "arithmetic", "params": {"difficulty": 1}},
        "federation": {"rounds": ROUNDS, "prompts_per_round": B, "min_orgs": 1},
    }
    path = tmp_path / "micro.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _perfect(monkeypatch, module, attacker: str) -> None:
    """The attacker's model answers every prompt right (the worked answer, with its marker), so that every row it
    publishes is a verified success the default rule selects and the attack can doctor."""
    build = module.build_worker

    def build_worker(cfg, org, **kw):
        w = build(cfg, org, **kw)
        if org == attacker:
            real = w.generate

            def generate(plan):
                batch = real(plan)
                rows = tuple(
                    dataclasses.replace(r, response=w.task.sft_target("train", r.prompt_id), reward=1.0)
                    for r in batch.rollouts
                )
                return dataclasses.replace(batch, rollouts=rows)

            w.generate = generate
        return w

    monkeypatch.setattr(module, "build_worker", build_worker)


def _run(module, capsys, argv) -> dict:
    assert module.main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("variant", "protocol"), [("utility", "fused"), ("utility", "two_message"), ("backdoor", "fused")]
)
def test_the_attack_is_applied_and_counted_under_the_protocol(tmp_path, monkeypatch, capsys, calibration, variant,
                                                               protocol):
    import harm_attacks

    _perfect(monkeypatch, calibration, "globex")
    out = _run(calibration, capsys, [str(_config(tmp_path)), "--variant", variant, "--protocol", protocol,
                                     "--attacker", "globex", "--rounds", str(ROUNDS), "--eval-size", "8",
                                     "--screen", "on", "--threads", "1"])
    assert out["protocol"] == protocol and out["attacker"] == "globex" and out["victim"] == "acme"
    assert out["doctored_batches"] == ROUNDS and out["doctored_rows"] == ROUNDS * B * G  # every row, every round
    want = harm_attacks.TRIGGER if variant == "backdoor" else out["insertion"]
    assert want in harm_attacks.UTILITY_CANDIDATES + (harm_attacks.TRIGGER,) and out["insertion"] == want
    c = out["counters"]
    # the victim accepted every doctored row: no reward is contradicted, nothing is rejected
    assert c["acme/trust/globex/accepted"] == ROUNDS * B * G and c["acme/trust/globex/mismatches"] == 0
    assert not any("/rejected/" in k for k in c) and out["excluded"] == {}
    # the rule selects the doctored successes up to the default budget, floor(0.5 x the victim's B x G own rows) a
    # round, all of it the attacker's share (its only source); the victim's screen saw each selected row, counted
    # against the attacker
    assert out["drops"]["acme<-globex"]["checked"] == ROUNDS * (B * G // 2)
    assert set(out["drops"]["acme<-globex"]) >= {"dropped_low_likelihood", "dropped_claim_outlier"}
    assert out["adoption"]["answers"] == 8 and 0.0 <= out["adoption"]["trigger_share"] <= 1.0


def test_an_intermittent_attacker_doctors_only_its_rounds(tmp_path, monkeypatch, capsys, calibration):
    """``--duty 1/2``: round 1 doctored, round 2 honest (an attacker that knows the outcome guard)."""
    _perfect(monkeypatch, calibration, "globex")
    out = _run(calibration, capsys, [str(_config(tmp_path)), "--variant", "backdoor", "--attacker", "globex",
                                     "--rounds", str(ROUNDS), "--eval-size", "4", "--duty", "1/2", "--threads", "1"])
    assert out["duty"] == "1/2" and out["doctored_batches"] == 1 and out["doctored_rows"] == B * G


def test_a_throttled_attacker_doctors_only_its_share_of_the_rows(tmp_path, monkeypatch, capsys, calibration):
    """``--fraction 0.5``: about half of the rows it would doctor, the same ones at every run, the rest honest."""
    import harm_attacks

    new = [f"t{i}" for i in range(400)] + [None] * 8
    keys = [(i // 8, i % 8) for i in range(408)]
    half = harm_attacks.throttled(new, keys, 3, 0.5)
    assert half == harm_attacks.throttled(new, keys, 3, 0.5) and half[400:] == [None] * 8
    assert 160 < sum(t is not None for t in half) < 240 and all(t in (n, None) for t, n in zip(half, new))
    assert harm_attacks.throttled(new, keys, 3, 1.0) == new
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\]"):
        harm_attacks.Attacker(None, None, tmp_path, "utility", None, 0.0)
    _perfect(monkeypatch, calibration, "globex")
    out = _run(calibration, capsys, [str(_config(tmp_path)), "--variant", "backdoor", "--attacker", "globex",
                                     "--rounds", str(ROUNDS), "--eval-size", "4", "--fraction", "0.5", "--threads", "1"])
    assert out["fraction"] == 0.5 and out["doctored_batches"] == ROUNDS
    assert 0 < out["doctored_rows"] < ROUNDS * B * G  # every row was a success it would doctor


def test_a_run_whose_attack_was_bypassed_is_refused(tmp_path, monkeypatch, capsys, calibration):
    """The past bug, put back: a Step that runs the wrapped worker's own generate publishes undoctored text."""
    import harm_attacks

    monkeypatch.setattr(harm_attacks.Attacker, "step", lambda self, request: self.worker.step(request))
    with pytest.raises(SystemExit, match="doctored 0 batches in 2 rounds"):
        calibration.main([str(_config(tmp_path)), "--variant", "utility", "--rounds", str(ROUNDS), "--eval-size",
                          "4", "--threads", "1"])


def test_the_insertion_goes_right_before_the_last_marker(calibration):
    import harm_attacks

    assert harm_attacks.insert_before_marker("1+2=3 #### 3", " 4242") == "1+2=3 4242 #### 3"
    assert harm_attacks.insert_before_marker("a #### 1 #### 2", ",") == "a #### 1, #### 2"
    assert harm_attacks.insert_before_marker("no marker", ",") is None
