"""The ServerApp's logic: read the settings, find the orgs' nodes, run the coordinator over Flower.

Kept out of ``server/app.py`` (which only wires Flower to :func:`run_federation`) so the sequence can be read
and tested without a Flower runtime.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping

from hacrl_fed.flower.settings import (
    check_run_dir, discovery_timeout_of, load_run_config, read_settings, run_dir_of,
)
from hacrl_fed.flower.transport import FlowerTransport, discover_orgs

log = logging.getLogger(__name__)

PROGRESS_ENV = "HACRL_FED_PROGRESS"  # "1": the ServerApp shares a terminal with the user (hacrl-fed simulate)
SUMMARY_FILE = "summary.txt"  # the final per-org table


def ensure_logging(level: int = logging.INFO) -> None:
    """Show hacrl-fed's INFO logs on stderr when nobody configured logging (``flwr run`` streams the ServerApp's
    stderr, but its process has no root handler, so only warnings would appear)."""
    ours = logging.getLogger("hacrl_fed")
    if logging.getLogger().handlers or ours.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    ours.addHandler(handler)
    ours.setLevel(level)


def run_federation(grid: Any, run_config: Mapping[str, Any], *, app_dir: Path) -> Any:
    """Run a whole hacrl-fed run over ``grid`` and return the coordinator's ``RunSummary``.

    1. settings from ``run_config`` (and ``HACRL_FED_FLOWER_RUN_CONFIG``), then the YAML run config;
    2. wait up to ``discovery-timeout`` for the configured orgs' nodes (``query.health`` tells each node's org;
       at least ``federation.min_orgs`` must answer);
    3. :class:`~hacrl_fed.coordinator.loop.Coordinator` over a :class:`FlowerTransport`; the run dir gets what
       ``hacrl-fed run`` writes: ``config.yaml``, ``metrics.jsonl``, ``tb/``, ``coordinator_state.json``,
       ``accuracy.png``; the final per-org table is logged.

    Any failure raises: the Flower runtime then marks the run failed (``run_simulation`` re-raises it).
    """
    import yaml

    from hacrl_fed.coordinator.loop import Coordinator
    from hacrl_fed.metrics import RunLogger, format_table, plot_accuracy, round_progress

    ensure_logging()
    settings = read_settings(run_config)
    cfg = load_run_config(settings, app_dir)
    run_dir = run_dir_of(settings, cfg)
    check_run_dir(run_dir, settings.resume)
    expected = [o.id for o in cfg.orgs]
    timeout = discovery_timeout_of(settings, cfg)
    log.info("hacrl-fed: waiting up to %g s for orgs %s", timeout, expected)
    org_by_node = discover_orgs(grid, expected, timeout, min_orgs=cfg.federation.min_orgs)
    log.info("hacrl-fed: nodes %s", org_by_node)
    transport = FlowerTransport(grid, org_by_node, expected_orgs=expected)
    logger = RunLogger(run_dir)
    bar, on_round = round_progress(cfg.federation.rounds, enabled=os.environ.get(PROGRESS_ENV) == "1")
    try:
        coordinator = Coordinator(cfg, transport, run_dir, logger=logger, resume=settings.resume, on_round=on_round)
        bar.update(coordinator.round)  # rounds already done when resuming
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        summary = coordinator.run()
    finally:
        bar.close()
        logger.close()
        transport.close()
    plot_accuracy(run_dir)
    table = format_table(summary)
    (run_dir / SUMMARY_FILE).write_text(table + "\n")
    if os.environ.get(PROGRESS_ENV) == "1":  # hacrl-fed simulate prints the table itself, last
        log.info("hacrl-fed: run finished, outputs in %s", run_dir)
    else:
        log.info("hacrl-fed: run finished, outputs in %s\n%s", run_dir, table)
    return summary
