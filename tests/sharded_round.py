"""A seeded round of org ``char`` under the sharded worker, run by ``tests/test_sharded_worker.py``.

Run as ``python -m torch.distributed.run --standalone --nproc-per-node N tests/sharded_round.py OUT CASE...`` (N
ranks, gloo) or as ``python tests/sharded_round.py OUT CASE...`` (one process, no process group: the plain
worker). For each CASE (``hacpo``, ``gspo``, ``hacpo-lora``, ...) it builds the tiny two-org config, generates round
1 for ``char`` (with ``bpe``'s rollouts as the foreign rows), trains it, evaluates, and rank 0 writes
``OUT/CASE-N.pt``: the rollouts, the train and eval metrics and the whole weights after the update (a ``-ckpt``
case also checkpoints round 1 and plays round 2). ``resume:CASE:RUN_DIR`` resumes a ``-ckpt`` case's run dir
(checkpointed at any N) and plays round 2 (``OUT/resume-CASE-N.pt``); a ``-step`` case plays two rounds through
``step``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hacrl_fed.config import load_config  # noqa: E402
from hacrl_fed.types import EvalRequest, RoundPlan, SamplingParams, TrainRequest  # noqa: E402

ORGS = [{"id": "char", "model": {"zoo": "micro-qwen-char"}}, {"id": "bpe", "model": {"zoo": "micro-gpt2-bpe"}}]
LORA = {"enabled": True, "r": 4, "target_modules": "all-linear"}


def make_cfg(case: str, ranks: int):
    return load_config(cfg_data(case, ranks))


def cfg_data(case: str, ranks: int) -> dict:
    """The tiny two-org run config of ``case`` with org ``char`` on ``ranks`` ranks."""
    algorithm, *opts = case.split("-")
    trainer = {
        "lr": 1e-3,
        "minibatch_size": 16,
        "micro_batch_size": 4,
        "selection": {"rule": "all"},
        "likelihood_screen": {"enabled": False},
        "outcome_guard": {"enabled": False},  # refused over ranks > 1
    }
    generation = {"num_samples": 4, "max_new_tokens": 12, "batch_size": 8, "seed_per_batch": "batchseed" in opts}
    if "kl" in opts:  # self rows come first: two mini-batches of them, so the second sees a KL off the reference
        trainer["minibatch_size"] = 8
    if "gc" in opts:
        trainer["gradient_checkpointing"] = True
    if "lora" in opts:
        trainer.update(lr=1e-2, lora=LORA)
    sharding = {
        "ranks": ranks,
        "mixed_precision": "bf16" if "bf16" in opts else "off",
        "cpu_offload": "offload" in opts,
    }
    orgs = [dict(ORGS[0], sharding=sharding), ORGS[1]]
    return {
        "name": "t",
        "seed": 3,
        "orgs": orgs,
        "algorithm": {
            "name": algorithm,
            "kl_beta": 0.05 if "kl" in opts else 0.0,
            "baseline_rows": "in_band" if "inband" in opts else "joint",
        },
        "trainer": trainer,
        "generation": generation,
        "task": {"name": "arithmetic", "eval_size": 8},
        "security": {"signing": False, "reverify_rewards": False},
    }


def play(w, b, round_: int) -> tuple:
    """Round ``round_`` of ``char`` (worker ``w``) with ``bpe``'s (``b``) rollouts as foreign rows, rewards spread
    over each group (a tiny model solves nothing); returns ``(char's rollouts, its train metrics)``."""
    prompts = tuple(w.task.prompts("train", list(range(10 * round_, 10 * round_ + 4))))
    sampling = SamplingParams(max_new_tokens=12, num_samples=4, seed=11 + round_)
    plan = RoundPlan("run", round_, "arithmetic", prompts, sampling)
    mine = w.generate(plan)
    for i, row in enumerate(w._own.rows):
        row.reward = float(i % 2)
    theirs = b.generate(plan).rollouts
    foreign = tuple(r.__class__(**{**r.__dict__, "reward": float(i % 2)}) for i, r in enumerate(theirs))
    report = w.train(TrainRequest("run", round_, "char", prompts, foreign, {"char": 0.5, "bpe": 0.25}))
    return [r.__dict__ for r in mine.rollouts], report.metrics


def weights(w) -> dict:
    return {k: v.detach().clone() for k, v in w.model.state_dict().items()}


def workers(case: str, ranks: int, run_dir: Path, resume: bool = False) -> tuple:
    from hacrl_fed.sharded.worker import ShardedPolicyWorker
    from hacrl_fed.worker.policy_worker import PolicyWorker

    cfg = make_cfg(case, ranks)
    return ShardedPolicyWorker(cfg, "char", run_dir=run_dir, resume=resume), PolicyWorker(cfg, "bpe", run_dir=run_dir)


def run_case(case: str, ranks: int, run_dir: Path) -> dict:
    """Round 1, then an evaluation; with ``-ckpt`` a checkpoint of round 1 and round 2 as well."""
    from hacrl_fed.sharded.fsdp import gather

    w, b = workers(case, ranks, run_dir / case)
    before = weights(w)
    inner = getattr(w.engine, "inner", w.engine)
    calls: list[int] = []  # the engine batches this rank sampled (first sequence of each)
    sample_batch = inner.sample_batch
    inner.sample_batch = lambda flat, start, *a: calls.append(start) or sample_batch(flat, start, *a)
    rollouts, metrics = play(w, b, 1)
    ev = w.evaluate(EvalRequest("run", 1, "arithmetic", tuple(w.task.prompts("test", range(8))), max_new_tokens=12))
    out = {
        "rollouts": rollouts,
        "train": metrics,
        "eval": ev.accuracy,
        "batches": gather(list(calls)),
        "before": before,
    }
    out["weights"] = weights(w)
    if "ckpt" in case:
        out["checkpoint"] = w.checkpoint(1)
        out["round2"] = play(w, b, 2)
        out["weights2"] = weights(w)
    return out


def step_case(case: str, ranks: int, run_dir: Path) -> dict:
    """Two rounds through ``step`` (the API the endpoint serves): round 1's plan, then one message with round 1's
    train, an evaluation, a checkpoint and round 2's plan."""
    from hacrl_fed.types import StepRequest

    w, _ = workers(case, ranks, run_dir / case)

    def plan(r: int) -> RoundPlan:
        prompts = tuple(w.task.prompts("train", list(range(10 * r, 10 * r + 4))))
        return RoundPlan("run", r, "arithmetic", prompts, SamplingParams(max_new_tokens=12, num_samples=4, seed=11))

    first = w.step(StepRequest(plan=plan(1)))
    for i, row in enumerate(w._own.rows):
        row.reward = float(i % 2)
    ev = EvalRequest("run", 1, "arithmetic", tuple(w.task.prompts("test", range(8))), max_new_tokens=12)
    train = TrainRequest("run", 1, "char", plan(1).prompts, (), {"char": 0.5})
    second = w.step(StepRequest(train=train, evaluate=ev, checkpoint=1, plan=plan(2)))
    assert first.batch is not None and second.batch is not None and second.report is not None
    return {
        "rounds": [[r.__dict__ for r in reply.batch.rollouts] for reply in (first, second)],
        "errors": [second.train_error, second.generate_error, second.eval_error, second.checkpoint_error],
        "loss": second.report.metrics["train/loss"],
        "eval": second.eval_report.accuracy if second.eval_report else None,
        "checkpoint": second.checkpoint,
    }


def resume_case(case: str, ranks: int, run_dir: Path) -> dict:
    """Resume ``run_dir`` (a ``-ckpt`` case's run, written at any N) at round 1 and play round 2."""
    w, b = workers(case, ranks, run_dir, resume=True)
    assert w.last_round == 1
    return {"resumed": weights(w), "round2": play(w, b, 2), "weights2": weights(w)}


def main() -> None:
    torch.set_num_threads(1)
    out, cases = Path(sys.argv[1]), sys.argv[2:]
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks > 1:
        torch.distributed.init_process_group("gloo")
    done = False
    try:
        for case in cases:  # CASE, or resume:CASE:RUN_DIR
            if case.startswith("resume:"):
                _, name, run_dir = case.split(":", 2)
                result, case = resume_case(name, ranks, Path(run_dir)), f"resume-{name}"
            elif "step" in case:
                result = step_case(case, ranks, out / f"run-{ranks}")
            else:
                result = run_case(case, ranks, out / f"run-{ranks}")
            if int(os.environ.get("RANK", "0")) == 0:
                torch.save(result, out / f"{case}-{ranks}.pt")
        done = True
    finally:
        if ranks > 1:
            torch.distributed.destroy_process_group()
    if done:  # every result is written: skip the interpreter's teardown, where a rank aborted in about 1 run of 8
        sys.stdout.flush()  # ("terminate called without an active exception", after the last case, gloo on CPU)
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
