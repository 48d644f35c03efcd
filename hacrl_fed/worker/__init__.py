"""The organization side: the policy worker that owns a private model (see ``api.WorkerAPI``)."""

from __future__ import annotations

from pathlib import Path

from hacrl_fed.worker.api import WorkerAPI


def build_worker(cfg, org_id: str, *, run_dir: str | Path = "runs/default", resume: bool = False):
    """Build the in-process :class:`~hacrl_fed.worker.policy_worker.PolicyWorker` of ``org_id`` from a RunConfig."""
    from hacrl_fed.worker.policy_worker import PolicyWorker

    return PolicyWorker(cfg, org_id, run_dir=run_dir, resume=resume)


__all__ = ["WorkerAPI", "build_worker"]
