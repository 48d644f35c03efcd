"""Benchmarks (BENCHMARKS.md): ``hacrl-fed bench learning | report | system | peer | agents``.

- ``learning`` (:mod:`hacrl_fed.bench.learning`): the learning-efficiency matrix, settings x methods x seeds, one
  JSON per cell under ``benchmarks/results/``; reruns skip finished cells.
- ``report`` (:mod:`hacrl_fed.bench.report`): Markdown tables and PNG learning curves from those JSON files.
- ``system`` (:mod:`hacrl_fed.bench.system`): what federation costs: per-round phases per transport, overhead vs
  in-process, wire bytes, scaling with the number of orgs, the Flower deployment engine's fixed cost per round.
- ``peer`` (:mod:`hacrl_fed.bench.peer`): our GSPO update against TRL's ``GRPOTrainer`` on the same work.
- ``agents`` (:mod:`hacrl_fed.bench.agents`): the extra tiny agents some settings need (built on first use).
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "learning": ("hacrl_fed.bench.learning", "main_learning", "the learning-efficiency matrix (one JSON per cell)"),
    "report": ("hacrl_fed.bench.report", "main_report", "Markdown tables + PNG curves from the learning results"),
    "system": ("hacrl_fed.bench.system", "main_system", "transport overhead, phases, wire bytes, scaling, deployment"),
    "peer": ("hacrl_fed.bench.peer", "main_peer", "our GSPO vs TRL's GRPOTrainer (sequence-level IS) on the same work"),
    "agents": ("hacrl_fed.bench.agents", "main_agents", "build or list the benchmark's extra tiny agents"),
}


def main_bench(argv: list[str] | None = None) -> int:
    """``hacrl-fed bench COMMAND ...``; returns the command's exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print("usage: hacrl-fed bench COMMAND [ARGS] (COMMAND --help for its options)\n", file=sys.stderr)
        for name, (_, _, help_text) in COMMANDS.items():
            print(f"  {name:9s} {help_text}", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    module, func, _ = COMMANDS[argv[0]]
    return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)
