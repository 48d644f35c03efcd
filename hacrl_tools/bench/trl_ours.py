"""Our side of ``hacrl-fed bench trl``: the run config of the work, like for like with TRL or with the defaults.

Two of our sides run the same work (:func:`work_config`: the model, the batch shape, GSPO's clip, the optimizer):

- ``ours`` (**like for like**, the comparison with TRL): every option of ours that TRL's ``GRPOTrainer`` lacks or
  sets otherwise is set explicitly (:data:`LIKE_FOR_LIKE`, printed with the table), so our side does TRL's work and
  no more, whatever the project's defaults become;
- ``defaults`` (**the defaults' cost**, reported beside the comparison, never inside it): the same work with the
  project's defaults for everything else (the outcome guard's shadow learner and checks, signing, samples.jsonl),
  as a user runs it.

``tests/test_bench_trl_config.py`` fails when a default changes what the like-for-like side runs (its resolved
config against ``tests/data/bench_trl_ours_config.json``, and every switch that resolves on named here).

    python -m hacrl_tools.bench.trl_ours SPEC OUT ours|defaults    # one run, in a fresh process (run_trl's child)
"""

from __future__ import annotations

import json
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIDES = ("ours", "defaults")  # our two sides: like for like, and the project's defaults

# option (dotted) -> (the like-for-like value, why): what TRL's GRPOTrainer lacks or sets otherwise
LIKE_FOR_LIKE: dict[str, tuple[Any, str]] = {
    "trainer.outcome_guard.enabled": (False, "TRL has no guard (a shadow learner trained beside, held-out checks)"),
    "trainer.outcome_guard.counterfactual": (False, "the guard's shadow (off with the guard)"),
    "trainer.likelihood_screen.enabled": (False, "TRL has no peers' rows to screen"),
    "trainer.lora.enabled": (False, "TRL runs without peft: every weight trains"),
    "trainer.gradient_checkpointing": (False, "TRL: gradient_checkpointing=False"),
    "trainer.precision": ("model", "float32 on both sides (TRL: bf16=False, fp16=False)"),
    "algorithm.advantage_calibration": (False, "HACPO's capability baseline; TRL has no peers"),
    "algorithm.capability_coefficient": (False, "HACPO's capability weight; TRL has no peers"),
    "algorithm.cross_clip": (False, "HACPO's band for peers' rows; TRL has no peers"),
    "security.signing": (False, "TRL signs nothing"),
    "security.encrypt": (False, "TRL encrypts nothing"),
    "security.reverify_rewards": (False, "re-verifies peers' rewards; TRL has no peers"),
    "samples.enabled": (False, "samples.jsonl; TRL: log_completions=False"),
    "wandb.enabled": (False, "TRL: report_to='none'"),
}


def work_config(spec: dict[str, Any]) -> dict[str, Any]:
    """The work both of our sides run: one org (``peer``) on the spec's model, GSPO with the spec's clip and no KL,
    the spec's batch shape (``steps`` optimizer steps of B·G/steps rows, one micro-batch each) and engine."""
    B, G, steps = int(spec["prompts_per_batch"]), int(spec["num_samples"]), int(spec["steps_per_batch"])
    return {
        "name": "peer",
        "seed": spec["seed"],
        "orgs": [{"id": "peer", "model": {"path": spec["model_dir"]}}],
        "algorithm": {
            "name": "gspo",
            "self_clip_low": spec["clip_low"],
            "self_clip_high": spec["clip_high"],
            "kl_beta": 0.0,
        },
        "trainer": {
            "lr": spec["lr"],
            "minibatch_size": B * G // steps,
            "micro_batch_size": B * G // steps,
            "grad_clip": 1.0,
            "weight_decay": 0.0,
        },
        "generation": {
            "engine": spec.get("engine", "fast"),
            "num_samples": G,
            "max_new_tokens": spec["max_new_tokens"],
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "batch_size": B * G,
        },
        "task": {"name": "arithmetic", "params": {"difficulty": 2}},
        "federation": {"rounds": int(spec["batches"]), "prompts_per_round": B},
    }


def ours_config(spec: dict[str, Any], side: str = "ours") -> dict[str, Any]:
    """The run config of our ``side``: :func:`work_config`, plus :data:`LIKE_FOR_LIKE` for ``ours``."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, not {side!r}")
    cfg = work_config(spec)
    if side == "ours":
        for dotted, (value, _) in LIKE_FOR_LIKE.items():
            *parents, leaf = dotted.split(".")
            node = cfg
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = value
    return cfg


def like_for_like_table(defaults: dict[str, Any]) -> str:
    """:data:`LIKE_FOR_LIKE` as a Markdown table beside the project's defaults (``defaults``: the resolved
    ``defaults`` side's config, ``model_dump`` form)."""
    lines = ["| option | like for like | project default | why |", "|---|---|---|---|"]
    for dotted, (value, why) in LIKE_FOR_LIKE.items():
        node: Any = defaults
        for key in dotted.split("."):
            node = node[key]
        lines.append(f"| `{dotted}` | {json.dumps(value)} | {json.dumps(node)} | {why} |")
    return "\n".join(lines)


def resolved(spec: dict[str, Any], side: str) -> dict[str, Any]:
    """The side's config as the worker sees it (``load_config``, then ``model_dump``)."""
    from hacrl_fed.config import load_config

    return load_config(ours_config(spec, side)).model_dump(mode="json")


def run_batches(worker: Any, task: Any, spec: dict[str, Any]) -> tuple[list[float], dict[str, list[float]], list]:
    """The spec's batches through ``worker.generate`` and ``worker.train``: seconds per batch, per phase, and
    each batch's accuracy."""
    from hacrl_fed.types import RoundPlan, SamplingParams, TrainRequest

    B, G = int(spec["prompts_per_batch"]), int(spec["num_samples"])
    ids = [p["id"] for p in spec["prompts"]]
    batch_s, rewards = [], []
    phases: dict[str, list[float]] = {"generate": [], "update": []}
    for i in range(int(spec["batches"])):
        prompts = tuple(task.prompts("train", ids[i * B : (i + 1) * B]))
        sampling = SamplingParams(1.0, 1.0, 0, int(spec["max_new_tokens"]), G, 1000 + i)
        plan = RoundPlan("peer-run", i + 1, "arithmetic", prompts, sampling)
        t0 = time.perf_counter()
        batch = worker.generate(plan)
        t1 = time.perf_counter()
        worker.train(TrainRequest("peer-run", i + 1, "peer", prompts, (), {"peer": 1.0}))
        t2 = time.perf_counter()
        batch_s.append(t2 - t0)
        phases["generate"].append(t1 - t0)  # sampling, the sampled tokens' log-probs, rewards
        phases["update"].append(t2 - t1)  # the optimizer steps (forward and backward), the guard's work if on
        rewards.append(batch.accuracy)
    return batch_s, phases, rewards


def main(argv: list[str]) -> int:
    """``SPEC OUT SIDE``: the spec's work through our policy worker with ``SIDE``'s config (a fresh process)."""
    t_start = time.perf_counter()
    if len(argv) != 3 or argv[2] not in SIDES:
        raise SystemExit(f"usage: python -m hacrl_tools.bench.trl_ours SPEC OUT {'|'.join(SIDES)}")
    spec_path, out_path, side = argv
    spec = json.loads(Path(spec_path).read_text())
    import torch

    from hacrl_fed.config import load_config
    from hacrl_fed.tasks import get_task
    from hacrl_fed.worker import build_worker

    torch.set_num_threads(int(spec["threads"]))
    t_import = time.perf_counter() - t_start
    cfg = load_config(ours_config(spec, side))
    task = get_task("arithmetic", {"difficulty": 2}, seed=spec["seed"])
    work = Path(tempfile.mkdtemp(prefix=f"peer-{side}-"))
    try:
        worker = build_worker(cfg, "peer", run_dir=work)
        t_setup = time.perf_counter() - t_start - t_import
        batch_s, phases, rewards = run_batches(worker, task, spec)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    run = {
        "side": side,
        "batch_s": batch_s,
        "phases": phases,
        "completions_per_batch": int(spec["prompts_per_batch"]) * int(spec["num_samples"]),
        "import_s": t_import,
        "setup_s": t_setup,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
        "mean_reward": statistics.fmean(rewards),
    }
    Path(out_path).write_text(json.dumps(run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
