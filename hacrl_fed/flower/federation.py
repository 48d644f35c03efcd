"""The ServerApp's logic: read the settings, find the orgs' nodes, run the coordinator over Flower.

Kept out of ``server/app.py`` (which only wires Flower to :func:`run_federation`) so the sequence can be read
and tested without a Flower runtime.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hacrl_fed.config import ConfigError
from hacrl_fed.flower.settings import (
    ENV_VAR,
    SettingsError,
    discovery_timeout_of,
    load_run_config,
    read_settings,
    run_dir_of,
)
from hacrl_fed.flower.transport import FlowerTransport, discover_orgs
from hacrl_fed.lifecycle import CLI_KEYS, FLWR_KEYS, Run, RunDirError, check_run_dir, setup_logging
from hacrl_fed.security.keyring import check_worker_keys

log = logging.getLogger(__name__)

PROGRESS_ENV = "HACRL_FED_PROGRESS"  # "1": the ServerApp shares a terminal with the user (hacrl-fed simulate)


class RunRefused(SettingsError):
    """A run the ServerApp refuses before it starts (bad settings or config, a used or empty run dir). The message
    says what to change; Flower logs it without a traceback (:func:`quiet_refusals`)."""


def _drop_refusal_traceback(record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if isinstance(record.exc_info, tuple) else record.exc_info
    if isinstance(exc, RunRefused):
        record.exc_info, record.exc_text = None, None
    return True


def quiet_refusals() -> None:
    """Make Flower log a :class:`RunRefused` of the ServerApp as one line (``ServerApp raised an exception``) with
    no traceback: the ServerApp has logged the reason itself, and ``flwr list`` shows it in the status details."""
    flwr_log = logging.getLogger("flwr")
    if _drop_refusal_traceback not in flwr_log.filters:
        flwr_log.addFilter(_drop_refusal_traceback)


def _is_simulation(grid: Any) -> bool:
    """The Simulation Engine's in-memory grid, or a run started by ``hacrl-fed simulate``."""
    return ENV_VAR in os.environ or type(grid).__name__ == "InMemoryGrid"


def run_federation(grid: Any, run_config: Mapping[str, Any], *, app_dir: Path, flower_run_id: int | None = None) -> Any:
    """Run a whole hacrl-fed run over ``grid`` and return the coordinator's ``RunSummary``.

    1. settings from ``run_config`` (and ``HACRL_FED_FLOWER_RUN_CONFIG``), then the YAML run config, then the run
       dir (a new run needs an unused one, ``resume`` a used one): any problem raises :class:`RunRefused`, logged
       as one line naming the keys of ``flwr run`` (``resume=true``, ``run-dir=``);
    2. wait up to ``discovery-timeout`` for the configured orgs' nodes (``query.health`` tells each node's org;
       at least ``federation.min_orgs`` must answer), and check the signing keys their workers report against the
       roster (:func:`~hacrl_fed.security.keyring.check_worker_keys`);
    3. :class:`~hacrl_fed.coordinator.loop.Coordinator` over a :class:`FlowerTransport`, inside the run lifecycle
       every entry point shares (:class:`hacrl_fed.lifecycle.Run`, transport ``flower-simulation`` or
       ``flower-deployment``, ``flower_run_id`` recorded next to the hacrl run id): one log line per round, the
       eval table after each evaluation, the final table at the end.

    Any failure raises: the Flower runtime then marks the run failed (``run_simulation`` re-raises it).
    """
    setup_logging(None, others=None)  # flwr run shows the ServerApp's stderr; Flower configured the rest itself
    quiet_refusals()
    simulation = _is_simulation(grid)
    keys = CLI_KEYS if ENV_VAR in os.environ else FLWR_KEYS  # hacrl-fed simulate / flwr run
    settings, cfg, run_dir = _accept_run(run_config, app_dir, keys)
    progress = os.environ.get(PROGRESS_ENV) == "1"
    run = Run(
        cfg,
        run_dir,
        transport="flower-simulation" if simulation else "flower-deployment",
        resume=settings.resume,
        keys=keys,
        progress=progress,
        flower_run_id=flower_run_id,
        entry="hacrl-fed simulate" if ENV_VAR in os.environ else "flwr run (ServerApp)",
    )
    with run:
        summary = _execute(run, grid, settings, cfg, run_dir)
    if progress:  # hacrl-fed simulate prints the table itself, last
        log.info("hacrl-fed: run %s finished; outputs in %s", summary.run_id, run.run_dir)
    else:
        log.info("hacrl-fed: run %s finished\n%s", summary.run_id, run.table)
    return summary


def _accept_run(run_config: Mapping[str, Any], app_dir: Path, keys: Any) -> tuple[Any, Any, Path]:
    """Step 1 of :func:`run_federation`: the settings, the run config and the run dir, or :class:`RunRefused`."""
    try:
        settings = read_settings(run_config)
        cfg = load_run_config(settings, app_dir)
        run_dir = run_dir_of(settings, cfg)
        check_run_dir(run_dir, settings.resume, keys)
    except (SettingsError, ConfigError, RunDirError) as err:
        log.error("hacrl-fed: the run is refused: %s", err)
        raise RunRefused(str(err)) from None
    return settings, cfg, run_dir


def _execute(run: Run, grid: Any, settings: Any, cfg: Any, run_dir: Path) -> Any:
    """Steps 2-3 of :func:`run_federation`: discover the orgs' nodes, check their workers' keys against the
    roster (keys that do not match stop the run before round 1), then run the coordinator over Flower."""
    expected = [o.id for o in cfg.orgs]
    timeout = discovery_timeout_of(settings, cfg)
    log.info("hacrl-fed: waiting up to %g s for orgs %s", timeout, expected)
    poll = settings.reply_poll_s
    org_by_node = discover_orgs(grid, expected, timeout, min_orgs=cfg.federation.min_orgs, max_poll_s=poll)
    log.info("hacrl-fed: nodes %s", org_by_node)
    transport = FlowerTransport(grid, org_by_node, expected_orgs=expected, max_poll_s=poll)
    try:
        check_worker_keys(cfg, run_dir, transport.health(sorted(set(org_by_node.values())), timeout))
        return run.execute(transport)
    finally:
        transport.close()
