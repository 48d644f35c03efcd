"""Deterministic fake task and policy workers for coordinator / CLI tests (no models, microseconds per call).

:class:`FakeWorker` answers a plan with ``G`` rollouts per prompt whose rewards give batch accuracy exactly
``skill`` (sample ``i`` scores 1 iff ``i < round(skill * G)``), records every request it gets, and can fail
``generate`` in chosen rounds, add invalid rollouts, or lie about its accuracy.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from hacrl_fed.config import load_config
from hacrl_fed.types import (
    ChatMessage, EvalReport, EvalRequest, Prompt, Rollout, RolloutBatch, RoundPlan, StepReply, StepRequest,
    TrainReport, TrainRequest,
)
from hacrl_fed.worker.api import run_step


class FakeTask:
    """``train`` / ``test`` splits of ``n_train`` / ``n_test`` trivial prompts; reference = the prompt id."""

    name = "fake"

    def __init__(self, n_train: int = 1000, n_test: int = 50):
        self.sizes = {"train": n_train, "test": n_test}

    def size(self, split: str) -> int:
        return self.sizes[split]

    def prompts(self, split: str, ids) -> list[Prompt]:
        offset = 0 if split == "train" else 10**6
        return [Prompt(int(i), (ChatMessage("user", f"{split} question {i}"),), str(int(i) + offset)) for i in ids]

    def verify(self, response: str, reference: str) -> float:
        return float(response.strip() == reference)


@dataclass
class FakeWorker:
    org_id: str
    skill: float = 0.5
    fail_generate_rounds: set[int] = field(default_factory=set)
    invalid_per_batch: int = 0  # extra rollouts with reward 2.0 (must be dropped by the coordinator)
    reported_accuracy: float | None = None  # None: report the truth
    lie_rewards: bool = False  # claim reward 1.0 on every rollout (re-verification must catch it)
    delay_s: float = 0.0
    hold: threading.Event | None = None  # set: generate() answers only once the event is set (at most 30 s)
    plans: list[RoundPlan] = field(default_factory=list)
    train_requests: list[TrainRequest] = field(default_factory=list)
    eval_requests: list[EvalRequest] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    trained_rounds: int = 0

    def generate(self, plan: RoundPlan) -> RolloutBatch:
        time.sleep(self.delay_s)
        if self.hold is not None:
            self.hold.wait(30)
        self.plans.append(plan)
        if plan.round in self.fail_generate_rounds:
            raise RuntimeError(f"{self.org_id} is down in round {plan.round}")
        g = plan.sampling.num_samples
        wins = round(self.skill * g)
        rollouts = [  # a winning sample answers the reference (FakeTask.verify agrees with its reward)
            Rollout(self.org_id, plan.round, p.prompt_id, i, p.reference if i < wins else f"{self.org_id} gives up",
                    "stop", 1.0 if i < wins else 0.0, -1.0 - i, 3)
            for p in plan.prompts for i in range(g)
        ]
        if self.lie_rewards:
            rollouts = [Rollout(*[getattr(r, f) for f in ("org_id", "round", "prompt_id", "sample_index", "response",
                                                          "finish_reason")], 1.0, r.logprob_sum, r.token_count)
                        for r in rollouts]
        bad = [Rollout(self.org_id, plan.round, plan.prompts[0].prompt_id, k % g, "bad", "stop", 2.0, -1.0, 3)
               for k in range(self.invalid_per_batch)]
        rollouts = bad + rollouts  # first: a dropped copy must not shadow the valid one with the same index
        acc = self.skill if self.reported_accuracy is None else self.reported_accuracy
        return RolloutBatch(plan.run_id, plan.round, self.org_id, tuple(rollouts), acc, {"gen/responses": len(rollouts)})

    def train(self, request: TrainRequest) -> TrainReport:
        self.train_requests.append(request)
        self.trained_rounds += 1
        return TrainReport(request.run_id, request.round, self.org_id,
                           {"hacpo/loss": 0.1 * request.round, "hacpo/foreign": float(len(request.foreign))})

    def evaluate(self, request: EvalRequest) -> EvalReport:
        self.eval_requests.append(request)
        acc = min(1.0, self.skill + 0.01 * self.trained_rounds)
        return EvalReport(request.run_id, request.round, self.org_id, acc, len(request.prompts))

    def health(self) -> dict[str, str]:
        return {"org_id": self.org_id, "status": "ok", "round": str(self.trained_rounds)}

    def checkpoint(self, round: int) -> str:
        self.checkpoints.append(round)
        return f"/tmp/fake/{self.org_id}/round-{round}"

    def step(self, request: StepRequest) -> StepReply:
        """The fused round: train, then generate (the real worker's order), each half failing alone."""
        return run_step(self, request)


def fake_config(orgs=("a", "b", "c"), *, security=None, **federation):
    """A RunConfig with zoo-named orgs (never built here), G=4, B=3, tiny generation settings; fake workers do not
    sign, so signing is off unless ``security`` says otherwise."""
    fed = {"rounds": 4, "prompts_per_round": 3, "eval_every": 2, "checkpoint_every": 2, "min_orgs": 1}
    fed.update(federation)
    return load_config({
        "name": "fake", "seed": 11,
        "generation": {"num_samples": 4, "max_new_tokens": 8, "eval_max_new_tokens": 6},
        "task": {"name": "fake", "eval_size": 5},
        "algorithm": {"capability_window": 2},
        "orgs": [{"id": o, "model": {"zoo": "tiny"}} for o in orgs],
        "federation": fed,
        "security": {"signing": False, **(security or {})},
    })


SCRIPT_SKILLS = {"a": 0.25, "b": 0.5, "c": 0.75}


def main(argv=None) -> int:
    """A stand-in for ``hacrl-fed worker``: serve a FakeWorker, print the ready line, stop on SIGTERM.

    Takes the real worker's link flags (``--listen``, ``--insecure``, ``--tls-*``) with the same rules (exit 2 on a
    refused setting). Extra flags for launcher tests: ``--ignore-sigterm`` (needs SIGKILL), ``--exit-code N`` (die
    before ready), ``--silent`` (never print the ready line), ``--step-s S`` (each step sleeps S seconds first).
    """
    import argparse
    import signal
    import threading

    from hacrl_fed.cli.worker import add_link_args, link_secret, link_settings
    from hacrl_fed.wire.grpc_server import serve_worker

    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--org", required=True)
    add_link_args(p)
    p.add_argument("--run-dir")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--exit-code", type=int)
    p.add_argument("--silent", action="store_true")
    p.add_argument("--step-s", type=float, default=0.0, help="each step sleeps this long first (a slow org)")
    args = p.parse_args(argv)
    try:
        tls, insecure = link_settings(args)
        secret = link_secret(args, args.org)
    except ValueError as err:
        p.exit(2, f"fake worker: {err}\n")
    load_config(args.config)  # fail like the real worker on a bad config
    print(f"fake worker {args.org} starting (run_dir={args.run_dir}, resume={args.resume})", flush=True)
    if args.exit_code is not None:
        print("giving up on purpose", flush=True)
        return args.exit_code
    stop = threading.Event()
    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_sigterm else (lambda *_: stop.set()))
    worker = FakeWorker(args.org, SCRIPT_SKILLS.get(args.org, 0.5))
    health = worker.health  # with its count of updates, as the policy worker reports it (a rejoin adopts it)
    worker.health = lambda: {**health(), "version": str(len(worker.train_requests))}  # type: ignore[method-assign]
    if args.step_s > 0:
        import time

        fused = worker.step
        worker.step = lambda request: (time.sleep(args.step_s), fused(request))[1]  # type: ignore[method-assign]
    server = serve_worker(worker, args.listen, tls=tls,
                          insecure=insecure, secret=secret)
    if not args.silent:
        print(f"hacrl-fed worker {args.org} listening on {server.address}", flush=True)
    while not stop.wait(0.1):
        pass
    server.stop(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
