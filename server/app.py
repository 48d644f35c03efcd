"""Flower ServerApp: read the run config, find which node serves which org, run the hacrl-fed coordinator.

Run config keys (``[tool.flwr.app.config]``): ``config-path``, ``overrides``, ``run-dir``, ``resume``,
``discovery-timeout``, ``worker-factory`` (simulation); see :mod:`hacrl_fed.flower.settings`. The whole logic is
:func:`hacrl_fed.flower.federation.run_federation` (the run lifecycle every entry point shares, with Flower's run
id recorded next to hacrl's); an exception there fails the Flower run, a refused run (bad settings, a used run
dir) with one log line and no traceback.
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from hacrl_fed.flower.federation import run_federation

APP_DIR = Path(__file__).resolve().parents[1]

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_federation(grid, context.run_config, app_dir=APP_DIR, flower_run_id=context.run_id)
