"""Issue 20's second-layer attacks over real gRPC, where their path differs from in-process: the doctored text and
its lying log-probs cross the codec as signed batches (and the screen's counters come back in the TrainReport),
a framer's unsigned or keyless report crosses it in coordinator-blind mode, and a plan's challenge map is refused
by the served worker as INVALID_ARGUMENT. Micro agents, one or two rounds each. The in-process versions are in
tests/test_likelihood_screen.py, tests/test_security_edges.py and tests/test_replay.py.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from hacrl_fed.coordinator import Coordinator
from hacrl_fed.worker import build_worker
from test_likelihood_screen import _cfg, doctor
from test_security_attacks import B, G, Hostile, Via, fresh, make_cfg, plan_for
from test_security_edges import Framer, _blind_cfg


@pytest.fixture()
def grpc_via(tmp_path):
    v = Via("grpc", tmp_path / "sock")
    yield v
    v.close()


@pytest.mark.parametrize("lying,defaults", [(False, False), (True, False), (True, True)],
                         ids=["honest_logprobs", "lying_logprobs", "lying_correct_answers_under_the_defaults"])
def test_doctored_text_over_grpc_is_screened_out_and_counted_against_the_attacker(tmp_path, grpc_via, lying, defaults):
    """Why 1 and 2: a member inserts a fixed string into every correct response, with its own or lying log-probs;
    the learner's likelihood screen leaves the rows out and the counters, back over the wire, name the attacker.
    ``defaults``: the project's defaults, against doctored text with right answers (the rows the rule selects)."""
    run_dir = tmp_path / "run"
    cfg = _cfg(rounds=2, rule=None if defaults else "all")
    acme = Hostile(build_worker(cfg, "acme", run_dir=run_dir), lambda b: b)  # records what the server decoded
    globex_worker = build_worker(cfg, "globex", run_dir=run_dir)
    globex = Hostile(globex_worker, doctor(globex_worker, acme.worker, run_dir, lying, correct=defaults))
    transport = grpc_via.transport({"acme": acme, "globex": globex})
    # both servers live in this test process and share torch's global RNG (separate worker processes do not):
    # one call at a time keeps each org's sampling what it would be in its own process
    transport._pool.shutdown()
    transport._pool = ThreadPoolExecutor(max_workers=1)
    coord = Coordinator(cfg, transport, run_dir)
    m = coord.run_round(1).metrics
    checked = m["acme/screen/globex/checked"]
    # every answer correct, so the rule passes them all; under the defaults the budget is floor(0.5 x acme's G x B
    # own rows), all of it globex's share (its only source), and the screen checks what was selected
    selected = G * B // 2 if defaults else G * B
    assert checked == selected and m["acme/select/globex/selected"] == selected
    assert m.get("round/globex/rejected/reward_mismatch", 0.0) == 0
    assert m["acme/trust/globex/accepted"] == G * B  # the text passed every signed check: only the screen acts
    dropped = m["acme/screen/globex/dropped_low_likelihood"] + m["acme/screen/globex/dropped_claim_outlier"]
    assert dropped >= 0.75 * checked and m["acme/train/num_cross"] == checked - dropped
    # the honest source's rows are never dropped (under the defaults the micro models' few successes may be none,
    # and then globex screens nothing of acme's)
    honest = [m.get(f"globex/screen/acme/dropped_{why}") for why in ("low_likelihood", "claim_outlier")]
    assert (defaults or None not in honest) and sum(x or 0 for x in honest) == 0
    (request,) = acme.train_requests  # the doctored text reached the learner through the codec, signed
    assert all(r.response.startswith("Hail to the thief") for b in request.source_batches for r in b.rollouts)


@pytest.mark.parametrize("orgs", [("acme", "globex", "initech"), ("acme", "globex")], ids=["3_orgs", "2_orgs"])
@pytest.mark.parametrize("mode", ["no_evidence", "unsigned"])
def test_framing_without_evidence_or_signature_over_grpc_is_ignored_and_counted(tmp_path, grpc_via, mode, orgs):
    """Why 3 over gRPC in blind mode, with 3 and with 2 orgs: a report accusing an honest org without the batch's
    content key, or an unsigned one, crosses the codec and moves nothing."""
    cfg, run_dir = _blind_cfg(orgs), tmp_path / "run"
    workers = {o: Hostile(build_worker(cfg, o, run_dir=run_dir), lambda b: b) for o in orgs}
    workers["acme"] = Framer(
        workers["acme"].worker, "globex", run_dir, evidence=mode == "unsigned", sign=mode != "unsigned"
    )
    coord = Coordinator(cfg, grpc_via.transport(workers), run_dir)
    m = coord.run_round(1).metrics
    counter = "round/acme/unproven_accusation" if mode == "no_evidence" else "round/acme/report_rejected/bad_signature"
    assert m[counter] == 1.0 and coord.guard.excluded == {} and "round/acme/false_accusation" not in m
    if mode == "unsigned" and len(orgs) == 2:  # its one receiver's report does not count: no verdict this round
        assert "round/globex/verified_accuracy" not in m and coord.tracker.history("globex") == []
    else:  # the lie moved nothing
        assert m["round/globex/verified_accuracy"] == pytest.approx(m["round/globex/accuracy"])
        assert m["round/globex/mismatch_rate"] == 0.0


@pytest.mark.parametrize(
    "challenges, match",
    [
        ({"acme": b"x" * 32, "globex": b"y" * 32, "initech": b"z" * 32}, "3 challenges for 2 orgs"),
        ({"mallory": b"x" * 32}, "not in the run"),
        ({"acme": b"x" * 31}, "not 32 bytes"),
    ],
)
def test_a_challenge_map_outside_the_roster_is_invalid_argument_over_grpc(tmp_path, grpc_via, challenges, match):
    from hacrl_fed.wire.grpc_client import WorkerCallError

    worker = build_worker(make_cfg(), "acme", run_dir=tmp_path / "run")
    client = grpc_via.api(worker)
    with pytest.raises(WorkerCallError) as info:
        client.generate(dataclasses.replace(plan_for(worker), challenges=challenges))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "bad_challenges" in info.value.details
    assert match in info.value.details
    assert client.generate(fresh(plan_for(worker), client)).round == 1  # the worker goes on


def test_latest_pointing_outside_the_checkpoint_root_is_refused_over_grpc(tmp_path, grpc_via):
    """Why 4, the path a served worker takes: a coordinator resumes a run whose LATEST (on the worker's disk) was
    pointed outside the run's checkpoint root; the request is refused, nothing outside is loaded, and the worker
    goes on serving."""
    from pathlib import Path

    from hacrl_fed.types import TrainRequest
    from hacrl_fed.wire.grpc_client import WorkerCallError

    cfg, run_dir = make_cfg(), tmp_path / "run"
    first = build_worker(cfg, "acme", run_dir=run_dir)
    plan = fresh(plan_for(first), first)
    first.generate(plan)
    first.train(TrainRequest(plan.run_id, 1, "acme", plan.prompts, (), {}))
    root = Path(first.checkpoint(1)).parent
    elsewhere = tmp_path / "elsewhere" / "round-000009"
    elsewhere.mkdir(parents=True)
    (root / "LATEST").write_text(str(elsewhere))
    worker = build_worker(cfg, "acme", run_dir=run_dir)  # a new process of the org: serves no run yet
    client = grpc_via.api(worker)
    with pytest.raises(WorkerCallError) as info:
        client.generate(plan_for(worker, round_=2))  # run-1 again: the worker would resume it from LATEST
    assert "not a round-NNNNNN checkpoint inside" in info.value.details
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION  # the worker's own disk state, not the request
    assert worker.run_id is None and worker.last_round == 0  # nothing was loaded
    assert client.generate(plan_for(worker, run_id="run-2")).round == 1  # the worker goes on
