"""A seeded round of org ``char`` under the sharded worker, run by ``tests/test_sharded_worker.py``.

Run as ``python -m torch.distributed.run --standalone --nproc-per-node N tests/sharded_round.py OUT CASE...`` (N
ranks, gloo) or as ``python tests/sharded_round.py OUT CASE...`` (one process, no process group: the plain
worker). For each CASE (``hacpo``, ``gspo``, ``hacpo-lora``, ...) it builds the tiny two-org config, generates round
1 for ``char`` (with ``bpe``'s rollouts as the foreign rows), trains it, evaluates, and rank 0 writes
``OUT/CASE.pt``: the rollouts, the train and eval metrics and the whole weights after the update.
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
    algorithm, *opts = case.split("-")
    trainer = {
        "lr": 1e-3,
        "minibatch_size": 16,
        "micro_batch_size": 4,
        "selection": {"rule": "all"},
        "likelihood_screen": {"enabled": False},
    }
    generation = {"num_samples": 4, "max_new_tokens": 12, "batch_size": 8, "seed_per_batch": "batchseed" in opts}
    if "lora" in opts:
        trainer.update(lr=1e-2, lora=LORA)
    orgs = [dict(ORGS[0], sharding={"ranks": ranks}), ORGS[1]]
    return load_config(
        {
            "name": "t",
            "seed": 3,
            "orgs": orgs,
            "algorithm": {"name": algorithm},
            "trainer": trainer,
            "generation": generation,
            "task": {"name": "arithmetic", "eval_size": 8},
            "security": {"signing": False, "reverify_rewards": False},
        }
    )


def run_case(case: str, ranks: int, run_dir: Path) -> dict:
    from hacrl_fed.sharded.fsdp import gather
    from hacrl_fed.sharded.worker import ShardedPolicyWorker
    from hacrl_fed.worker.policy_worker import PolicyWorker

    cfg = make_cfg(case, ranks)
    w = ShardedPolicyWorker(cfg, "char", run_dir=run_dir / case)
    b = PolicyWorker(cfg, "bpe", run_dir=run_dir / case)
    before = {k: v.detach().clone() for k, v in w.model.state_dict().items()}
    prompts = tuple(w.task.prompts("train", list(range(10, 14))))
    plan = RoundPlan("run", 1, "arithmetic", prompts, SamplingParams(max_new_tokens=12, num_samples=4, seed=11))
    inner = getattr(w.engine, "inner", w.engine)
    calls = []  # the engine batches this rank sampled (first sequence of each)
    sample_batch = inner.sample_batch
    inner.sample_batch = lambda flat, start, *a: calls.append(start) or sample_batch(flat, start, *a)
    mine = w.generate(plan)
    for i, row in enumerate(w._own.rows):  # a tiny model solves nothing: give its own groups a spread to learn from
        row.reward = float(i % 2)
    theirs = b.generate(plan).rollouts
    foreign = tuple(r.__class__(**{**r.__dict__, "reward": float(i % 2)}) for i, r in enumerate(theirs))
    report = w.train(TrainRequest("run", 1, "char", prompts, foreign, {"char": 0.5, "bpe": 0.25}))
    ev = w.evaluate(EvalRequest("run", 1, "arithmetic", tuple(w.task.prompts("test", range(8))), max_new_tokens=12))
    return {
        "rollouts": [r.__dict__ for r in mine.rollouts],
        "train": report.metrics,
        "eval": ev.accuracy,
        "batches": gather(calls),
        "before": before,
        "weights": {k: v.detach().clone() for k, v in w.model.state_dict().items()},
    }


def main() -> None:
    torch.set_num_threads(1)
    out, cases = Path(sys.argv[1]), sys.argv[2:]
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks > 1:
        torch.distributed.init_process_group("gloo")
    try:
        for case in cases:
            result = run_case(case, ranks, out / f"run-{ranks}")
            if int(os.environ.get("RANK", "0")) == 0:
                torch.save(result, out / f"{case}-{ranks}.pt")
    finally:
        if ranks > 1:
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
