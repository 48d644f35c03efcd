"""The Flower deployment targets of ``scripts/fault_run.py``: a SuperNode and the SuperLink.

Each run is a real local deployment (:mod:`hacrl_tools.deploy_local`: ``flower-superlink``, one ``flower-supernode``
and one ``hacrl-fed worker`` per org, ``flwr run`` of this repository's app) of the same two micro orgs and config
as the gRPC targets, on loopback, in its own work folder, every process stopped by PID at the end:

* ``supernode``: SIGKILL org b's SuperNode; a user starts it again with the same command (its port, its worker):
  the run goes on meanwhile (b's rounds ``unreachable``) and takes b back once the ServerApp sees the node again;
* ``superlink``: SIGKILL the SuperLink (its ``flower-superexec`` and the run's ServerApp go with it); a user starts
  it again on the same port, starts the SuperNodes again (the new SuperLink, its state in memory, refuses their
  heartbeats and they exit), and submits the run again with ``resume=true`` into the same ``run-dir``; the
  workers, still running, refuse a round they have already trained (``stale_round``), as they do for the gRPC
  coordinator's resume.

Orphans: processes below the killed one (its ``flower-superexec``, ``flwr-clientapp``, ``flwr-serverapp``) alive
once the deployment has stopped, plus anything the harness started that is still running
(:meth:`~hacrl_tools.deploy_local.Deployment.leftovers`).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hacrl_tools.deploy_local import (
    SUPERNODE_READY,
    Deployment,
    HarnessError,
    Proc,
    descendants,
    identity_overrides,
    process_table,
    start_local,
)

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 900.0


def _stream(dep: Deployment) -> Proc:
    """The ``flwr run --stream`` process of the run submitted last (it exits when the run ends)."""
    return next(p for p in reversed(dep.procs) if p.name.startswith("flwr-run-"))


def _restart(dep: Deployment, target: str, victim: Proc, run_config: dict[str, Any]) -> int:
    """What a user does after the kill (module docstring); the id of the run to wait for."""
    if target == "supernode":
        node = dep.spawn(f"{victim.name}-restarted", victim.argv)
        dep.wait_log(node, SUPERNODE_READY, "SuperNode ID (activation by the restarted SuperLink)")
        return -1
    dep.start_superlink(dep.superlink_port)
    for old in [p for p in dep.procs if p.name.startswith("supernode-") and p.stop_s is None]:
        dep.stop(old)  # exiting already: the new SuperLink (in-memory state) refuses its heartbeat (401)
        node = dep.spawn(f"{old.name}-restarted", old.argv)
        dep.wait_log(node, SUPERNODE_READY, "SuperNode ID (activation by the restarted SuperLink)")
    return dep.submit(REPO, {**run_config, "resume": True})


def deployment_run(
    work: Path,
    config: Path,
    orgs: list[str],
    fault: Callable[[Deployment, Path, Callable[[], bool]], tuple[str, Proc] | None] | None = None,
) -> dict[str, Any]:
    """One deployment run in ``work`` (run dir ``work/run``); ``fault(dep, run_dir, alive)`` picks its moment and
    returns ``(target, victim)`` to SIGKILL (None: nothing killed). Returns ``returncode`` (0: the run, or its
    resume, finished completed), ``injected``, ``orphans``, ``stderr_tail``."""
    run_dir, out = work / "run", {"injected": False, "orphans": 0, "stderr_tail": ""}
    below: dict[int, str] = {}
    with Deployment(work / "dep") as dep:
        try:
            ids = identity_overrides(work / "identity_set", orgs)
            start_local(dep, config, orgs, overrides=ids)
            run_config = {"config-path": str(config), "overrides": " ".join(ids), "run-dir": str(run_dir)}
            run_id = dep.submit(REPO, run_config)
            stream = _stream(dep)
            picked = fault(dep, run_dir, stream.alive) if fault is not None else None
            if picked is not None and picked[1].alive():
                target, victim = picked
                below = descendants(victim.pid)
                os.kill(victim.pid, signal.SIGKILL)
                victim.popen.wait(30)
                out["injected"] = True
                resumed = _restart(dep, target, victim, run_config)
                run_id = run_id if resumed < 0 else resumed
            info = dep.wait_run(run_id, RUN_TIMEOUT_S)
            out["returncode"] = 0 if info.get("status") == "finished:completed" else 1
            if out["returncode"]:
                out["stderr_tail"] = f"{info.get('status')}: {dep.run_log(run_id)[-300:]}"
        except HarnessError as err:
            out["returncode"], out["stderr_tail"] = 1, str(err)[-300:]
    time.sleep(1)
    table = process_table()
    out["orphans"] = len(dep.leftovers()) + sum(1 for p, cmd in below.items() if table.get(p, (0, ""))[1] == cmd)
    out["logs"] = sorted((work / "dep" / "logs").glob("worker-*.log"))
    return out


def victim_of(dep: Deployment, target: str, org: str = "b") -> Proc:
    """The SuperLink, or org ``org``'s SuperNode (the one running now)."""
    if target == "superlink":
        assert dep.superlink is not None
        return dep.superlink
    return next(p for p in reversed(dep.procs) if p.name.startswith(f"supernode-{org}") and p.alive())
