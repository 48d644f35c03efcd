"""``hacrl-fed export RUN_DIR --org ORG --out DIR [--round N] [--adapter-only] [--dtype D] [--overwrite]
[--config RUN.yaml [--set K=V ...]]``: one org's trained model as a folder transformers and vLLM load
(:func:`hacrl_fed.export.export_model`). Exits 2 with one line naming the argument or config field for bad input.
"""

from __future__ import annotations

import argparse

from hacrl_fed.cli.common import add_set_flag, parser, run_command

PROG = "hacrl-fed export"


def build_parser() -> argparse.ArgumentParser:
    p = parser(
        "export",
        "Write one org's trained model as a folder transformers and vLLM load "
        "(config, weights, tokenizer, chat template, generation config).",
    )
    p.add_argument("run_dir", help="the run directory (hacrl-fed run / simulate / deploy-local output)")
    p.add_argument("--org", required=True, help="the org whose model to export")
    p.add_argument("--out", required=True, help="the folder to write (must not exist or be empty)")
    p.add_argument("--round", type=int, default=None, help="the checkpoint of this round (default: the latest)")
    p.add_argument("--adapter-only", action="store_true", help="LoRA runs: write the adapter alone, not merged weights")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--config", default=None, help="the run config (default: RUN_DIR/config.yaml)")
    add_set_flag(p, help="overrides of --config, as for hacrl-fed run")
    return p


def main(argv: list[str] | None = None) -> int:
    """``hacrl-fed export``: prints the folder written. Returns the exit code."""
    args = build_parser().parse_args(argv)
    return run_command(PROG, lambda: _export(args))


def _export(args: argparse.Namespace) -> int:
    from hacrl_fed.export import export_model

    out = export_model(
        args.run_dir,
        args.org,
        args.out,
        round=args.round,
        adapter_only=args.adapter_only,
        dtype=args.dtype,
        overwrite=args.overwrite,
        config=args.config,
        overrides=args.overrides,
    )
    print(out)
    return 0
