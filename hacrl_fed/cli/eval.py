"""``hacrl-fed eval MODEL_DIR [--config CONFIG] [--set K=V ...]`` or ``hacrl-fed eval --run-dir RUN_DIR --org ORG
[--round N]``, with ``[--n N] [--k K] [--temperature T] [--top-p P] [--max-new-tokens M] [--seed S] [--threshold R]
[--device D] [--json FILE]``: greedy accuracy and pass@k on a task's test split (:mod:`hacrl_fed.evaluate`). Exits 2
with one line naming the argument or config field for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hacrl_fed.cli.common import add_set_flag, parser, run_command

PROG = "hacrl-fed eval"


def build_parser() -> argparse.ArgumentParser:
    p = parser(
        "eval",
        "Greedy accuracy and pass@k of a model on a task's held-out test split, scored by the task's verifier.",
    )
    p.add_argument("model", nargs="?", default=None, help="an exported (or any local transformers) model folder")
    p.add_argument("--config", default=None, help="run config naming the task (default: the export's run config)")
    add_set_flag(p, help="config overrides, as for hacrl-fed run")
    p.add_argument("--run-dir", default=None, help="score a run's checkpoint instead of a folder (with --org)")
    p.add_argument("--org", default=None, help="with --run-dir: the org whose checkpoint to score")
    p.add_argument("--round", type=int, default=None, help="with --run-dir: this round's checkpoint (default latest)")
    p.add_argument("--n", type=int, default=None, help="held-out prompts (default: task.eval_size)")
    p.add_argument("--k", type=int, default=4, help="samples per prompt for pass@k (default 4)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the config's)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass (default: the config's)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: generation.eval_max_new_tokens")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--threshold", type=float, default=1.0, help="a sample is correct when its reward is >= this")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--json", default=None, help="also write the metrics to this JSON file")
    return p


def _source(args: argparse.Namespace):
    """``(model, tokenizer, cfg, org id or None)`` for the folder or the checkpoint the arguments name."""
    from hacrl_fed.config import BuildError, load_config
    from hacrl_fed.evaluate import load_exported
    from hacrl_fed.export import EXPORT_INFO, find_checkpoint, load_trained, run_config

    overrides = args.overrides
    if (args.model is None) == (args.run_dir is None):
        raise BuildError("model: give exactly one of MODEL_DIR or --run-dir (with --org)")
    if args.run_dir is not None:
        if args.org is None:
            raise BuildError("--org: required with --run-dir")
        cfg = load_config(args.config, overrides=overrides) if args.config else run_config(Path(args.run_dir))
        _, checkpoint = find_checkpoint(Path(args.run_dir), args.org, args.round)
        model, tokenizer = load_trained(cfg, args.org, checkpoint)
        return model, tokenizer, cfg, args.org
    config, org = args.config, None
    info = Path(args.model) / EXPORT_INFO
    if info.is_file():  # an export: its run's config and org (the org's prompt format, as its worker rendered)
        meta = json.loads(info.read_text())
        config, org = config or meta["config"], meta.get("org")
    if config is None:
        raise BuildError(f"--config: {args.model} is not a hacrl-fed export; name the run config with the task")
    model, tokenizer = load_exported(args.model, args.device)
    cfg = load_config(config, overrides=overrides)
    return model, tokenizer, cfg, org if org in {o.id for o in cfg.orgs} else None


def main(argv: list[str] | None = None) -> int:
    """``hacrl-fed eval``: prints one JSON object of metrics (and writes it to ``--json``). Returns the exit code."""
    args = build_parser().parse_args(argv)
    return run_command(PROG, lambda: _eval(args))


def _style_fields(cfg, org: str) -> dict:
    """The org's prompt format settings (``model.prompt_format`` / ``model.few_shot``), as its worker renders."""
    model = cfg.org(org).model
    return {"prompt_format": model.prompt_format, "few_shot": model.few_shot}


def _eval(args: argparse.Namespace) -> int:
    from hacrl_fed.config import org_generation
    from hacrl_fed.evaluate import EvalSettings, evaluate
    from hacrl_fed.tasks import get_task

    model, tokenizer, cfg, org = _source(args)
    gen = org_generation(cfg, org) if org is not None else cfg.generation
    settings = EvalSettings(
        n=args.n if args.n is not None else cfg.task.eval_size,
        k=args.k,
        temperature=args.temperature if args.temperature is not None else gen.temperature,
        top_p=args.top_p if args.top_p is not None else gen.top_p,
        top_k=gen.top_k,
        max_new_tokens=args.max_new_tokens if args.max_new_tokens is not None else gen.eval_max_new_tokens,
        seed=args.seed,
        threshold=args.threshold,
        batch_size=gen.batch_size,
        **({} if org is None else _style_fields(cfg, org)),
    )
    task = get_task(cfg.task.name, cfg.task.params, seed=cfg.seed)
    metrics = evaluate(model, tokenizer, task, settings)
    text = json.dumps(metrics, sort_keys=True)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text, file=sys.stdout)
    return 0
