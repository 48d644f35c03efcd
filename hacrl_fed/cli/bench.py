"""``hacrl-fed bench learning | report | system | trl | agents``: the benchmarks (BENCHMARKS.md), a tool
(:mod:`hacrl_tools.bench`, loaded here only, with one line if it is absent). This module parses each command's
arguments and calls the tool's function; the tool's defaults are paths relative to the working directory (run from
a checkout, or pass them).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from hacrl_fed.cli.common import UsageError, add_set_flag, load_tools, parser, run_command

PROG = "hacrl-fed bench"

# command -> (tools module, help)
COMMANDS = {
    "learning": ("bench.learning", "the learning-efficiency matrix (one JSON per cell)"),
    "report": ("bench.report", "Markdown tables + PNG curves from the learning results"),
    "system": ("bench.system", "transport overhead, phases, wire bytes, scaling, deployment"),
    "trl": ("bench.trl_compare", "our GSPO vs TRL's GRPOTrainer (sequence-level IS) on the same work"),
    "agents": ("bench.agents", "build or list the benchmark's extra tiny agents"),
}


def learning_parser(tool: ModuleType) -> argparse.ArgumentParser:
    p = parser("bench learning", "The learning-efficiency matrix (settings x methods x seeds), one JSON per cell.")
    paths = load_tools("bench.matrix", PROG)  # the matrix's default paths
    p.add_argument("--matrix", type=Path, default=paths.MATRIX, help=f"matrix YAML (default {paths.MATRIX})")
    p.add_argument(
        "--results",
        type=Path,
        default=None,
        help=f"results dir (default {paths.RESULTS}, with --quick {paths.QUICK_RESULTS})",
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="SETTING[/METHOD]",
        help="run only these cells: a setting, a group, or setting/method (shell patterns; repeatable)",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default: the matrix's seeds")
    p.add_argument("--rounds", type=int, default=None, help="override federation.rounds of every cell")
    p.add_argument("--quick", action="store_true", help="the matrix's reduced 'quick' selection")
    add_set_flag(p, help="override a config field in every cell (part of the cell's config hash)")
    p.add_argument("--list", dest="list_only", action="store_true", help="print the plan and exit")
    p.add_argument("--no-build", action="store_true", help="skip cells whose bench agents are not built yet")
    p.add_argument("--no-report", action="store_true", help="do not rewrite the report at the end")
    p.add_argument(
        "--keep-runs",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep each cell's run dir (metrics.jsonl, checkpoints) as DIR/<setting>/<method>/seed<k>; keep DIR "
        "outside the repository (flwr run packages it)",
    )
    p.add_argument("--max-cells", type=int, default=None, help="stop after running this many cells")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, i.e. all cores)")
    return p


def report_parser(tool: ModuleType) -> argparse.ArgumentParser:
    p = parser("bench report", "The learning matrix's JSON results as Markdown tables and PNG learning curves.")
    paths = load_tools("bench.matrix", PROG)
    p.add_argument("--results", type=Path, default=paths.RESULTS)
    p.add_argument("--matrix", type=Path, default=paths.MATRIX)
    p.add_argument("--no-plots", action="store_true")
    return p


def system_parser(tool: ModuleType) -> argparse.ArgumentParser:
    p = parser("bench system", "What federation costs, measured side by side on one machine.")
    p.add_argument("--config", type=Path, default=tool.DEMO, help=f"the transport comparison's config ({tool.DEMO})")
    p.add_argument("--rounds", type=int, default=4, help="rounds per transport run")
    p.add_argument("--repeats", type=int, default=2, help="runs per transport (order rotated each repeat)")
    p.add_argument("--eval-size", type=int, default=20, help="held-out prompts evaluated before and after")
    p.add_argument(
        "--transports",
        nargs="*",
        choices=tool.TRANSPORTS,
        default=list(tool.TRANSPORTS),
        help="transports to compare (none: skip the comparison)",
    )
    p.add_argument("--scale-orgs", type=int, nargs="*", default=[2, 4, 8], help="org counts (none: skip)")
    p.add_argument("--scale-rounds", type=int, default=3)
    p.add_argument(
        "--scale-transport",
        nargs="+",
        type=tool.parse_scale_transport,
        default=[("grpc", None)],
        metavar="TRANSPORT[:MAX_ORGS]",
        help="grpc and/or inprocess, run in this order; after a colon the largest org count on that transport "
        "(inprocess grpc:16)",
    )
    p.add_argument(
        "--scale-selection",
        nargs="*",
        default=[],
        metavar="RULE[:MULTIPLE[:SPLIT]]",
        help="run the scaling case once per trainer.selection: the rule, then budget_multiple (none: no budget) "
        "and budget_split (default pooled) after colons, e.g. all successes:1 peer_sample:1 "
        "successes:0.5:per_source; no spec: the config's own",
    )
    p.add_argument("--deploy-rounds", type=int, default=3, help="rounds on the deployment engine (0: skip)")
    p.add_argument(
        "--deploy-variants",
        nargs="+",
        type=tool.parse_variant,
        default=[(None, None)],
        metavar="TASK/REPLY",
        help="deployment runs, one per TASK/REPLY: the SuperExec task poll and the ServerApp reply poll in seconds "
        "('default' for either or both), e.g. 1.0/0.2 default; run in this order",
    )
    add_set_flag(p, help="extra overrides of the transport comparison's config")
    p.add_argument("--out", type=Path, default=tool.OUT, help=f"where system.json goes (default {tool.OUT})")
    p.add_argument("--keep-work", action="store_true", help="keep the run dirs (a temp dir, printed)")
    return p


def trl_parser(tool: ModuleType) -> argparse.ArgumentParser:
    p = parser("bench trl", "Our GSPO update against TRL's GRPOTrainer on the same work, side by side.")
    p.add_argument(
        "--model",
        default="qwen-char",
        help="zoo agent, packaged real checkpoint (smollm2-135m, gemma3-270m) or model dir (default qwen-char)",
    )
    p.add_argument("--prompts", type=int, default=16, help="prompts per batch (B)")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per batch")
    p.add_argument("--batches", type=int, default=6, help="batches per run (the first is warm-up)")
    p.add_argument("--repeats", type=int, default=3, help="runs per side, alternating")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", choices=("fast", "hf"), default="fast", help="our generation engine (default fast)")
    p.add_argument("--threads", type=int, default=None, help="torch threads on both sides (default: all cores)")
    p.add_argument(
        "--venv",
        type=Path,
        default=None,
        help="the TRL venv (default ~/.cache/hacrl_fed/peer-trl-venv; created when missing)",
    )
    p.add_argument("--trl", default=tool.TRL_PIN, help=f"TRL requirement (default {tool.TRL_PIN})")
    p.add_argument(
        "--sides",
        nargs="+",
        choices=("ours", "trl", "defaults"),
        default=["ours", "trl", "defaults"],
        help="ours: like for like with TRL; defaults: ours with the project's defaults (their cost, beside)",
    )
    p.add_argument("--out", type=Path, default=tool.OUT, help=f"where the JSON goes (default {tool.OUT})")
    return p


def agents_parser(tool: ModuleType) -> argparse.ArgumentParser:
    p = parser("bench agents", "Build or list the benchmark's extra agents.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="recipes, hashes, and whether each is built")
    b = sub.add_parser("build", help="build agents (SFT warm start) into benchmarks/agents/")
    b.add_argument("names", nargs="+", help=f"names or 'all' ({', '.join(tool.BENCH_AGENTS)})")
    b.add_argument("--out", type=Path, help="write DIR/<name> instead of benchmarks/agents/<name>")
    return p


def learning(tool: ModuleType, args: argparse.Namespace) -> int:
    return int(tool.run_matrix(tool.LearningOptions(**vars(args))))


def report(tool: ModuleType, args: argparse.Namespace) -> int:
    return int(tool.print_report(args.results, args.matrix, plots=not args.no_plots))


def system(tool: ModuleType, args: argparse.Namespace) -> int:
    return int(tool.run_system(tool.SystemOptions(**vars(args))))


def trl(tool: ModuleType, args: argparse.Namespace) -> int:
    if (args.prompts * args.samples) % args.steps:
        raise UsageError("--prompts x --samples must divide into --steps optimizer steps")
    return int(tool.run_trl(tool.TrlOptions(**vars(args))))


def agents(tool: ModuleType, args: argparse.Namespace) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.cmd == "list":
        return int(tool.list_agents())
    try:
        return int(tool.build_agents(args.names, args.out))
    except KeyError as err:
        raise UsageError(err.args[0]) from None


PARSERS: dict[str, Callable[[ModuleType], argparse.ArgumentParser]] = {
    "learning": learning_parser,
    "report": report_parser,
    "system": system_parser,
    "trl": trl_parser,
    "agents": agents_parser,
}
RUNS: dict[str, Callable[[ModuleType, argparse.Namespace], int]] = {
    "learning": learning,
    "report": report,
    "system": system,
    "trl": trl,
    "agents": agents,
}


def usage() -> str:
    lines = [f"usage: {PROG} COMMAND [ARGS] (COMMAND --help for its options)", ""]
    lines += [f"  {name:9s} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``hacrl-fed bench COMMAND ...``; returns the command's exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(usage(), file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    name, rest = argv[0], argv[1:]
    prog = f"{PROG} {name}"

    def work() -> int:
        tool = load_tools(COMMANDS[name][0], prog)  # its defaults (paths under the working directory) and choices
        return RUNS[name](tool, PARSERS[name](tool).parse_args(rest))

    return run_command(prog, work)
