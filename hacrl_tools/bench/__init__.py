"""Benchmarks (BENCHMARKS.md), run as ``hacrl-fed bench learning | report | system | trl | agents``
(:mod:`hacrl_fed.cli.bench` parses the arguments and calls the functions named here).

- ``learning`` (:func:`hacrl_tools.bench.learning.run_matrix`): the learning-efficiency matrix
  (:mod:`hacrl_tools.bench.matrix`), settings x methods x seeds, one JSON per cell under ``benchmarks/results/``;
  reruns skip finished cells.
- ``report`` (:func:`hacrl_tools.bench.report.print_report`): Markdown tables and PNG learning curves from those
  JSON files.
- ``system`` (:func:`hacrl_tools.bench.system.run_system`): what federation costs: per-round phases per transport,
  overhead vs in-process, wire bytes, scaling with the number of orgs, the Flower deployment engine's fixed cost per
  round.
- ``trl`` (:func:`hacrl_tools.bench.trl_compare.run_trl`): our GSPO update against TRL's ``GRPOTrainer`` on the same
  work, like for like (:mod:`hacrl_tools.bench.trl_ours`), with the project defaults' cost beside.
- ``agents`` (:mod:`hacrl_tools.bench.agents`): the extra tiny agents some settings need (built on first use).

Paths default to the working directory (``configs/bench/``, ``benchmarks/...``): run from the repository root, or
pass them.
"""
