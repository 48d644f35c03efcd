"""What sharding one org's worker costs and saves: per-rank training state and update / generation time.

    python scripts/sharded_cost.py --out cost-1.json                         # one process (the plain worker)
    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        scripts/sharded_cost.py --out cost-2.json                            # 2 ranks (gloo on CPU)
    python scripts/sharded_cost.py --table cost-1.json cost-2.json           # side by side + JSON

Each run builds org ``char`` of a small config (zoo ``qwen-char``: 4 decoder layers, HACPO, 8 prompts x 4
samples per round in engine batches of 8, ``generation.seed_per_batch: true`` so the ranks share the sampling),
plays one warm-up round, then ``--reps`` timed rounds: ``generate`` and ``train`` (own rows, rewards spread over
each group), each started together on every rank (a barrier) and timed on rank 0 (wall seconds). After the last
update every rank counts the bytes it holds of the training model's parameters, their gradients and AdamW's
state (its FSDP2 shards; the whole tensors in one process), and of the whole-weight replica it generates with.
Run it with one thread per rank (``OMP_NUM_THREADS=1``); the table says how many CPU cores the machine had.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def config(ranks: int):
    from hacrl_fed.config import load_config

    org = {"id": "char", "model": {"zoo": "qwen-char"}, "sharding": {"ranks": ranks}}
    return load_config(
        {
            "name": "cost",
            "seed": 1,
            "orgs": [org],
            "algorithm": {"name": "hacpo"},
            "trainer": {"lr": 1e-5, "minibatch_size": 16, "micro_batch_size": 4},
            "generation": {"num_samples": 4, "max_new_tokens": 24, "batch_size": 8, "seed_per_batch": True},
            "task": {"name": "arithmetic"},
            "security": {"signing": False},
        }
    )


def local_bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor's local shard, a plain tensor whole)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if isinstance(t, DTensor) else t
            total += t.numel() * t.element_size()
    return total


def held_bytes(worker) -> dict[str, int]:
    """This rank's parameter, gradient, optimizer-state and replica bytes (module docstring)."""
    trainer = worker.trainer
    params = list(trainer.model.parameters())
    state = [v for s in trainer.optimizer.state.values() for v in s.values()]
    replica = 0 if trainer.model is worker.model else local_bytes(worker.model.parameters())
    return {
        "params": local_bytes(params),
        "grads": local_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": local_bytes(state),
        "replica": replica,  # 0: one process generates with the training model itself
    }


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def timed_round(worker, round_: int) -> tuple[float, float]:
    from hacrl_fed.types import RoundPlan, SamplingParams, TrainRequest

    prompts = tuple(worker.task.prompts("train", list(range(8 * round_, 8 * round_ + 8))))
    plan = RoundPlan("cost", round_, "arithmetic", prompts, SamplingParams(max_new_tokens=24, num_samples=4, seed=5))
    barrier()
    t0 = time.perf_counter()
    worker.generate(plan)
    gen = time.perf_counter() - t0
    for i, row in enumerate(worker._own.rows):
        row.reward = float(i % 2)
    barrier()
    t0 = time.perf_counter()
    worker.train(TrainRequest("cost", round_, "char", prompts, (), {"char": 0.5}))
    return gen, time.perf_counter() - t0


def measure(reps: int, out: Path, run_dir: Path) -> None:
    from hacrl_fed.sharded.fsdp import gather
    from hacrl_fed.sharded.worker import ShardedPolicyWorker

    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks > 1:
        torch.distributed.init_process_group("gloo")
    try:
        worker = ShardedPolicyWorker(config(ranks), "char", run_dir=run_dir / f"ranks-{ranks}")
        times = [timed_round(worker, r) for r in range(1, reps + 2)][1:]  # round 1: warm-up
        held = gather(held_bytes(worker))
    finally:
        if ranks > 1:
            torch.distributed.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        n_params = sum(p.numel() for p in worker.model.parameters())
        result = {
            "ranks": ranks,
            "params": n_params,
            "cores": len(os.sched_getaffinity(0)),
            "threads": torch.get_num_threads(),
            "generate_s": [g for g, _ in times],
            "update_s": [u for _, u in times],
            "held_bytes": held,
        }
        out.write_text(json.dumps(result, indent=2) + "\n")


def mean_se(xs: list[float]) -> str:
    se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):.3f} ± {se:.3f}"


def table(paths: list[Path]) -> None:
    runs = sorted((json.loads(p.read_text()) for p in paths), key=lambda r: r["ranks"])
    base = runs[0]["held_bytes"][0]
    base_train = base["params"] + base["grads"] + base["optimizer"]
    print(
        f"org char: zoo qwen-char, {runs[0]['params']:,} parameters, {runs[0]['cores']} usable CPU core(s), "
        f"{runs[0]['threads']} thread(s) per rank"
    )
    print(
        "| ranks | params / rank | grads / rank | AdamW state / rank | sum / rank | vs 1 process | replica / rank "
        "| update s (mean ± SE) | generation s (mean ± SE) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    summary = []
    for run in runs:
        worst = max(run["held_bytes"], key=lambda h: h["params"] + h["grads"] + h["optimizer"])
        total = worst["params"] + worst["grads"] + worst["optimizer"]
        kb = {k: worst[k] / 1024 for k in ("params", "grads", "optimizer", "replica")}
        print(
            f"| {run['ranks']} | {kb['params']:.1f} KiB | {kb['grads']:.1f} KiB | {kb['optimizer']:.1f} KiB | "
            f"{total / 1024:.1f} KiB | {total / base_train:.3f} | {kb['replica']:.1f} KiB | "
            f"{mean_se(run['update_s'])} | {mean_se(run['generate_s'])} |"
        )
        summary.append(
            {
                "ranks": run["ranks"],
                "train_bytes_per_rank": total,
                "fraction_of_one_process": total / base_train,
                "replica_bytes_per_rank": worst["replica"],
                "update_s": run["update_s"],
                "generate_s": run["generate_s"],
            }
        )
    print(json.dumps(summary))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="write this run's figures here (JSON)")
    p.add_argument("--reps", type=int, default=5, help="timed rounds after one warm-up round")
    p.add_argument("--run-dir", type=Path, default=Path("runs/sharded-cost"))
    p.add_argument("--table", type=Path, nargs="+", help="print the figures of these runs side by side")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.table:
        table(args.table)
    elif args.out:
        measure(args.reps, args.out, args.run_dir)
    else:
        p.error("give --out (measure) or --table (compare)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
