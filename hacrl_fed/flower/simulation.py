"""``hacrl-fed simulate CONFIG [--set k=v ...] [--run-dir DIR]``: the whole federation on Flower's Simulation Engine.

One virtual SuperNode per org (partition ``i`` = ``orgs[i]``), the repository's ``server.app:app`` and
``client.app:app``, Ray as the backend. How it is wired (flwr 1.42):

* ``flwr.simulation.run_simulation`` takes no run config, so the app settings (absolute config path, overrides,
  run dir, ...) travel in the environment variable ``HACRL_FED_FLOWER_RUN_CONFIG`` (see
  :mod:`hacrl_fed.flower.settings`), set before Ray starts so its worker processes inherit it.
* ``server`` / ``client`` are not installed packages: the app directory goes first on ``sys.path``; Flower copies
  ``sys.path`` into the Ray workers' ``PYTHONPATH``.
* Exactly one ClientApp actor (Ray ``num_cpus`` = the actor's ``num_cpus`` = the CPUs this process may use; all
  GPUs too): in-process workers are cached per process, and Ray hands each message to whichever actor is idle.
  Orgs therefore run one after another, each with all cores (Ray sets ``OMP_NUM_THREADS`` to the actor's CPUs).
* A ServerApp exception is re-raised by ``run_simulation``; ``hacrl-fed simulate`` (:mod:`hacrl_fed.cli.simulate`)
  then exits 1.
* Ray is started here (:func:`start_ray`, the init Flower's backend would make) before ``run_simulation``, which
  finds it running, uses it and shuts it down: Ray waits a fixed 30 s for its raylet to register, which a loaded
  machine can exceed, and a start that timed out is retried instead of crashing the simulation.
* Flower's switches of :data:`hacrl_fed.lifecycle.FLOWER_ENV` (no telemetry, update checks or per-run installs)
  are set, where unset, when this module is imported: Flower reads some of them when it is first imported.
* The ServerApp runs the shared run lifecycle (:mod:`hacrl_fed.lifecycle`, transport ``flower-simulation``):
  one log line per round, the same outputs as ``hacrl-fed run``; the final table is printed last.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hacrl_fed.host import available_cpus
from hacrl_fed.lifecycle import FLOWER_ENV, apply_env

apply_env(FLOWER_ENV)  # before anything imports flwr (see the module docstring)

from hacrl_fed.config import load_config, parse_overrides  # noqa: E402
from hacrl_fed.flower.federation import PROGRESS_ENV  # noqa: E402
from hacrl_fed.flower.settings import (  # noqa: E402
    ENV_VAR,
    AppSettings,
    check_run_dir,
    run_dir_of,
    to_run_config,
)
from hacrl_fed.sharded.group import check_in_process  # noqa: E402
from hacrl_fed.worker.pacing import refuse_emulated_slowdown  # noqa: E402

log = logging.getLogger(__name__)


def find_app_dir(explicit: str | Path | None = None) -> Path:
    """The Flower app directory (holding ``server/app.py`` and ``client/app.py``).

    Tried in order: ``explicit``, the current directory, the directory above the ``hacrl_fed`` package (a
    source checkout). Raises ``FileNotFoundError`` naming the places looked at.
    """
    import hacrl_fed

    candidates = [Path(explicit)] if explicit else [Path.cwd(), Path(hacrl_fed.__file__).resolve().parents[1]]
    for cand in candidates:
        if (cand / "server" / "app.py").is_file() and (cand / "client" / "app.py").is_file():
            return cand.resolve()
    raise FileNotFoundError(
        f"no Flower app (server/app.py and client/app.py) in {[str(c) for c in candidates]}; "
        "run from the repository root or pass --app-dir"
    )


def detect_gpus() -> int:
    """Number of CUDA devices torch sees (0 without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def backend_config(num_cpus: int, num_gpus: int) -> dict[str, Any]:
    """Ray backend config giving the single ClientApp actor every CPU and GPU of the (local) Ray cluster."""
    if num_cpus < 1 or num_gpus < 0:
        raise ValueError(f"need num_cpus >= 1 and num_gpus >= 0, got {num_cpus} and {num_gpus}")
    return {
        "client_resources": {"num_cpus": num_cpus, "num_gpus": num_gpus},
        "init_args": {"num_cpus": num_cpus, "num_gpus": num_gpus},
    }


RAY_START_TRIES = 3  # ray's own wait for its raylet is a fixed 30 s (ray/_private/node.py)
RAY_START_TIMEOUT = "timed out during startup"  # what ray raises when that wait ran out


def start_ray(backend: dict[str, Any], tries: int = RAY_START_TRIES) -> None:
    """Start the local Ray cluster as Flower's Ray backend would (``backend["init_args"]``, no dashboard, the
    workers' ``PYTHONPATH`` = this ``sys.path``), retrying a start whose raylet did not register in Ray's fixed
    wait (a loaded machine); any other error, or the last try's, is raised. Nothing happens when Ray is running."""
    import ray

    if ray.is_initialized():
        return
    pythonpath = os.pathsep.join(sys.path)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    os.environ["PYTHONPATH"] = pythonpath  # as Flower sets it: the ClientApp actor imports server/ and client/
    for attempt in range(1, tries + 1):
        try:
            ray.init(
                runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, include_dashboard=False, **backend["init_args"]
            )
            return
        except Exception as exc:
            if RAY_START_TIMEOUT not in str(exc) or attempt == tries:
                raise
            log.warning("Ray did not start (try %d of %d: %s); starting it again", attempt, tries, exc)
            ray.shutdown()


def load_apps(app_dir: Path) -> tuple[Any, Any]:
    """Import ``server.app:app`` and ``client.app:app`` from ``app_dir`` (put first on ``sys.path``)."""
    if str(app_dir) not in sys.path:
        sys.path.insert(0, str(app_dir))
    server = importlib.import_module("server.app")
    client = importlib.import_module("client.app")
    for mod in (server, client):
        if mod.__file__ is None or Path(mod.__file__).resolve().parents[1] != app_dir:
            raise ImportError(f"{mod.__name__} was imported from {mod.__file__}, not from {app_dir}")
    return server.app, client.app


def simulate(
    config_path: str | Path,
    overrides: Sequence[str] = (),
    *,
    run_dir: str | Path | None = None,
    resume: bool = False,
    app_dir: str | Path | None = None,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    worker_factory: str = "",
    discovery_timeout_s: float = 0.0,
    verbose: bool = False,
    progress: bool = False,
) -> Path:
    """Run the federation of ``config_path`` on the Simulation Engine; returns the run directory.

    ``progress`` shows a per-round progress bar on stderr (the ServerApp runs in this process).

    ``worker_factory`` (``module:callable``) replaces :func:`hacrl_fed.worker.build_worker` (tests use fakes).
    Raises whatever the ServerApp raised (config errors, too few orgs, ``FederationError`` ...).
    """
    config_path = Path(config_path).expanduser().resolve()
    cfg = load_config(config_path, parse_overrides(list(overrides)))  # fail early, in this process
    check_in_process(cfg, "Flower simulation")  # its workers are in-process: no ranks (ShardingError, a ConfigError)
    refuse_emulated_slowdown(cfg, "the Flower simulation")  # nor a worker process to pace (a ConfigError)
    settings = AppSettings(
        config_path=str(config_path),
        overrides=" ".join(overrides),
        resume=resume,
        worker_factory=worker_factory,
        discovery_timeout_s=discovery_timeout_s,
        run_dir=str(run_dir or ""),
    )
    run_path = run_dir_of(settings, cfg).resolve()  # Ray workers need absolute paths: their cwd differs
    check_run_dir(run_path, resume)
    if not worker_factory:  # what the ClientApp's workers would refuse (models, task, context): before Ray starts
        from hacrl_fed.memory_estimate import check_memory
        from hacrl_fed.preflight import preflight

        preflight(cfg)
        check_memory(cfg, [o.id for o in cfg.orgs], one_process=False)  # a plan that cannot fit this host
    settings = AppSettings(**{**settings.__dict__, "run_dir": str(run_path)})
    apps = load_apps(find_app_dir(app_dir))
    backend = backend_config(num_cpus or available_cpus(), detect_gpus() if num_gpus is None else num_gpus)
    env = {ENV_VAR: json.dumps(to_run_config(settings)), PROGRESS_ENV: "1" if progress else "0"}
    start = time.perf_counter()
    with _environ(env):
        log.info(
            "simulating %d orgs %s, backend %s, run dir %s", len(cfg.orgs), [o.id for o in cfg.orgs], backend, run_path
        )
        _run_on_ray(apps, len(cfg.orgs), backend, verbose)
    log.info("simulation finished in %.1f s; run dir %s", time.perf_counter() - start, run_path)
    return run_path


def _run_on_ray(apps: tuple[Any, Any], num_supernodes: int, backend: dict[str, Any], verbose: bool) -> None:
    """``run_simulation`` on a Ray cluster :func:`start_ray` started; Flower's backend shuts Ray down, and this does
    where the run failed before the backend took Ray over."""
    import ray
    from flwr.simulation import run_simulation

    start_ray(backend)
    try:
        run_simulation(
            server_app=apps[0],
            client_app=apps[1],
            num_supernodes=num_supernodes,
            backend_config=backend,
            verbose_logging=verbose,
        )
    finally:
        if ray.is_initialized():
            ray.shutdown()


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``env`` set inside the block (the ServerApp reads its settings there), as it was after."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
