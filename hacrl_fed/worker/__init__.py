"""The organization side: the policy worker that owns a private model (see ``api.WorkerAPI``)."""

from __future__ import annotations

from pathlib import Path

from hacrl_fed.worker.api import WorkerAPI


def build_worker(cfg, org_id: str, *, run_dir: str | Path = "runs/default", resume: bool = False):
    """Build the in-process :class:`~hacrl_fed.worker.policy_worker.PolicyWorker` of ``org_id`` from a RunConfig.

    A problem with what the config names (model, tokenizer, task, data files, context) is a
    :class:`~hacrl_fed.config.BuildError` whose message starts with the org (``org 'acme': model.path=...``)."""
    from hacrl_fed.config import BuildError
    from hacrl_fed.worker.policy_worker import PolicyWorker

    try:
        return PolicyWorker(cfg, org_id, run_dir=run_dir, resume=resume)
    except BuildError as err:
        if str(err).startswith(f"org {org_id!r}:"):
            raise
        raise BuildError(f"org {org_id!r}: {err}") from err


__all__ = ["WorkerAPI", "build_worker"]
