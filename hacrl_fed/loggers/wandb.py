"""Weights & Biases as a metrics sink (config section ``wandb``; ``pip install 'hacrl-fed[wandb]'``).

:func:`open_wandb` starts one W&B run per hacrl run dir with the configured project, entity, name (default: the
run's ``name``), tags and mode, the resolved run config as its W&B config, and its files under
``<run dir>/wandb``. Every round's metrics go to it with exactly the keys of ``metrics.jsonl`` (non-finite values,
written there as ``null``, are left out) and ``step = round``. The W&B run id is kept in
``<run dir>/wandb/hacrl_wandb_id``, so a resumed hacrl run continues the same W&B run. At the end of a run the
orgs' rollout samples (``samples.jsonl``, the run report's viewer) go to it as the table ``samples``.

``mode: offline`` needs no network or account (upload later with ``wandb sync <run dir>/wandb/offline-run-*``).
A W&B failure while logging is warned about once and never stops the run; one while starting is a
:class:`~hacrl_fed.config.BuildError` naming the ``wandb`` section.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hacrl_fed.config import BuildError

log = logging.getLogger(__name__)
ID_FILE = "hacrl_wandb_id"
SAMPLE_COLUMNS = (
    "org", "kind", "round", "source", "learner", "fate", "stage", "reason", "reward", "stop_reason", "length", "prompt",
    "response",
)  # fmt: skip


class WandbSink:
    """One W&B run; :meth:`log` records a round's metrics, :meth:`close` finishes the run."""

    def __init__(self, run: Any) -> None:
        self.run, self.failures = run, 0

    def log(self, round: int, metrics: Mapping[str, float | None]) -> None:
        data = {k: v for k, v in metrics.items() if v is not None}
        try:
            self.run.log(data, step=int(round))
        except Exception as err:  # a logging backend never stops a run
            self.failures += 1
            if self.failures == 1:
                log.warning(
                    "wandb: logging round %d failed (%s: %s); further failures are silent",
                    round,
                    type(err).__name__,
                    err,
                )

    def log_samples(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """The orgs' samples (``samples.jsonl`` rows, :mod:`hacrl_fed.worker.samples`) as the W&B table
        ``samples``, one row each with :data:`SAMPLE_COLUMNS`."""
        if self.run is None or not rows:
            return
        try:
            import wandb

            table = wandb.Table(columns=list(SAMPLE_COLUMNS), data=[[r.get(c) for c in SAMPLE_COLUMNS] for r in rows])
            self.run.log({"samples": table})
        except Exception as err:  # a logging backend never stops a run
            log.warning("wandb: logging the samples table failed: %s: %s", type(err).__name__, err)

    def close(self) -> None:
        if self.run is not None:
            try:
                self.run.finish()
            except Exception as err:
                log.warning("wandb: finishing the run failed: %s: %s", type(err).__name__, err)
            self.run = None


def open_wandb(cfg: Any, run_dir: str | Path, *, resume: bool = False) -> WandbSink:
    """Start (or on ``resume`` continue) the W&B run of ``run_dir`` for ``cfg.wandb`` (module docstring)."""
    w = cfg.wandb
    try:
        import wandb
    except ImportError:
        raise BuildError("wandb.enabled: needs the wandb package: pip install 'hacrl-fed[wandb]'") from None
    folder = Path(run_dir) / "wandb"
    folder.mkdir(parents=True, exist_ok=True)
    id_file = folder / ID_FILE
    run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        run = wandb.init(
            project=w.project,
            entity=w.entity,
            name=w.name or cfg.name,
            tags=list(w.tags),
            mode=w.mode,
            dir=str(Path(run_dir)),
            config=cfg.model_dump(mode="json"),
            id=run_id or secrets.token_hex(4),
            resume="allow" if run_id else None,
            reinit="create_new",
        )
    except Exception as err:
        first = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
        raise BuildError(
            f"wandb: could not start a W&B run (mode={w.mode}): {type(err).__name__}: {first}; "
            "log in (wandb login) or set wandb.mode: offline"
        ) from err
    id_file.write_text(run.id + "\n")
    return WandbSink(run)
