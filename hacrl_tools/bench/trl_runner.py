"""The TRL side of ``hacrl-fed bench trl``: GSPO with TRL's ``GRPOTrainer`` on the work described by a spec file.

Runs inside its own virtual environment (CPU torch, TRL, transformers, pydantic), not hacrl-fed's: only
:mod:`hacrl_fed.tasks` is imported (from CODE, the folder ``hacrl_fed`` is imported from), for the same answer check
as our verifier.

    <venv>/bin/python -I hacrl_tools/bench/trl_runner.py SPEC.json OUT.json CODE

``-I`` (as :func:`hacrl_tools.bench.trl_compare.peer_command` runs it) keeps this script's folder and
``PYTHONPATH`` off ``sys.path``; CODE is appended after the venv's own packages, so a module of ours can never
stand in for one of the peer's (``trl``, ``torch``, ``transformers``, ``datasets``).

The spec (written by :mod:`hacrl_tools.bench.trl_compare`) holds the model directory, the rendered prompt texts
(our chat template, so both sides condition on the same text) with their references, and the GSPO settings. Every
option that matters is set explicitly below, since TRL's defaults are not GSPO's (its default loss is ``dapo``, epsilon
0.2, token-level importance sampling, a linearly decaying learning rate).
"""

from __future__ import annotations

import json
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

T_START = time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    """``SPEC OUT CODE``: GSPO with TRL on the spec's work; the run's timings, peak RSS and versions to OUT."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3:
        raise SystemExit("usage: python -I trl_runner.py SPEC OUT CODE")
    spec_path, out_path, code = argv
    sys.path.append(code)  # after the venv's packages: ours can fill only what the peer's venv lacks
    spec = json.loads(Path(spec_path).read_text())

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from hacrl_fed.tasks.arithmetic import extract_integer  # from CODE, appended above

    torch.set_num_threads(int(spec["threads"]))
    torch.manual_seed(int(spec["seed"]))
    t_import = time.perf_counter() - T_START
    dataset = Dataset.from_list([{"prompt": p["text"], "reference": p["reference"]} for p in spec["prompts"]])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    config = grpo_config(spec, tempfile.mkdtemp(prefix="trl-peer-"))
    stamps: list[float] = []
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[answer_reward(extract_integer)],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[step_clock(stamps)],
    )
    gen_s = time_generation(trainer)
    t_setup = time.perf_counter() - T_START - t_import
    trainer.train()
    steps = int(spec["steps_per_batch"])
    # one generation batch = `steps` optimizer steps (its first step also generates and scores old log-probs)
    batch_s = [stamps[i + steps] - stamps[i] for i in range(0, len(stamps) - steps, steps)]
    if len(gen_s) != len(batch_s):
        raise RuntimeError(f"expected one generation per batch, timed {len(gen_s)} for {len(batch_s)} batches")
    run: dict[str, Any] = {"batch_s": batch_s, "import_s": t_import, "setup_s": t_setup}
    run["phases"] = {"generate": gen_s, "update": [b - g for b, g in zip(batch_s, gen_s)]}
    Path(out_path).write_text(json.dumps(report(spec, trainer, config, run)))
    return 0


def answer_reward(extract_integer: Callable[[str], int | None]) -> Callable[..., list[float]]:
    """TRL's reward function: 1 for a completion whose answer is the reference (our verifier's answer check)."""

    def reward(completions, reference, **_):
        out = []
        for text, ref in zip(completions, reference):
            try:
                out.append(1.0 if extract_integer(text) == int(ref) else 0.0)
            except Exception:
                out.append(0.0)
        return out

    return reward


def grpo_config(spec: dict[str, Any], work: str):
    """``GRPOConfig`` for GSPO on the spec's batch shape, every option that matters set explicitly."""
    from trl import GRPOConfig

    B, G, steps = int(spec["prompts_per_batch"]), int(spec["num_samples"]), int(spec["steps_per_batch"])
    batches = int(spec["batches"])
    rows = B * G // steps  # sequences per optimizer step (one forward/backward: no gradient accumulation)
    return GRPOConfig(
        output_dir=work,
        report_to="none",
        save_strategy="no",
        logging_strategy="steps",
        logging_steps=steps,
        disable_tqdm=True,
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=int(spec["seed"]),
        data_seed=int(spec["seed"]),
        dataloader_num_workers=0,
        remove_unused_columns=False,
        gradient_checkpointing=False,
        # optimizer: AdamW, constant lr, as our trainer
        learning_rate=float(spec["lr"]),
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        optim="adamw_torch",
        # batch shape: B prompts x G samples per generation, `steps` optimizer steps per generation batch
        per_device_train_batch_size=rows,
        gradient_accumulation_steps=1,
        steps_per_generation=steps,
        num_generations=G,
        max_steps=batches * steps,
        num_iterations=1,
        shuffle_dataset=False,
        # sampling as ours: temperature 1, no top-p / top-k / min-p, no repetition penalty
        max_completion_length=int(spec["max_new_tokens"]),
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        use_vllm=False,
        disable_dropout=True,
        log_completions=False,
        # GSPO: sequence-level ratio, clip [1 - 3e-4, 1 + 4e-4], sequence-mean of token-means, no KL
        importance_sampling_level="sequence",
        loss_type="grpo",
        epsilon=float(spec["clip_low"]),
        epsilon_high=float(spec["clip_high"]),
        beta=0.0,
        scale_rewards="group",
        mask_truncated_completions=False,
    )


def step_clock(stamps: list[float]):
    """A ``TrainerCallback`` appending ``time.perf_counter()`` to ``stamps`` at the start and after every step."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    return Clock()


def time_generation(trainer) -> list[float]:
    """Seconds of each of ``trainer``'s generation phases (TRL 1.16's ``_generate_and_score_completions``:
    sampling, old log-probs, rewards), appended to the returned list as training runs."""
    gen_s: list[float] = []
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        try:
            return generate_and_score(*a, **kw)
        finally:
            gen_s.append(time.perf_counter() - t0)

    trainer._generate_and_score_completions = timed_generate
    return gen_s


def report(spec: dict[str, Any], trainer, config, run: dict[str, Any]) -> dict[str, Any]:
    """OUT's content: ``run`` (batch and phase seconds, import and setup seconds), completions per batch, mean
    reward, peak RSS, the versions and the config's scalar options."""
    import torch
    import transformers
    import trl

    rewards = [float(h["reward"]) for h in trainer.state.log_history if "reward" in h]
    return {
        "side": "trl",
        **run,
        "completions_per_batch": int(spec["prompts_per_batch"]) * int(spec["num_samples"]),
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "config": {k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, str, bool, type(None)))},
    }


if __name__ == "__main__":
    raise SystemExit(main())
