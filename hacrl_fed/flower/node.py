"""The ClientApp's logic: which org a Flower node is, which worker serves it, and one request -> reply.

How a node learns its mode and org (``context.node_config``):

* **deployment** (``flower-supernode --node-config 'org="acme" worker="unix:/run/hacrl/acme.sock"'``): ``worker``
  is present. The org is ``org``; every request is forwarded over gRPC to the long-lived ``hacrl-fed worker`` at
  ``worker`` (:class:`~hacrl_fed.wire.grpc_client.GrpcWorkerClient`). No model is ever loaded here: Flower starts a
  fresh ClientApp process per message. Optional ``max-message-mb`` (default 256) caps gRPC message sizes.
  ``worker-ca``, ``worker-cert``, ``worker-key`` (PEM paths, all three or none; optional ``worker-server-name``)
  switch the channel to mutual TLS; without them ``worker`` must be a ``unix:`` socket or a loopback address, and
  ``worker-secret-file`` names the link secret of a worker started with ``--insecure``.
* **simulation** (Flower Simulation Engine): node_config holds only ``partition-id`` / ``num-partitions``.
  Partition ``i`` is the ``i``-th org of the run config (``config-path`` in the run config, see
  :mod:`hacrl_fed.flower.settings`). The worker is in-process, built once per (run, org) by the
  ``worker-factory`` and cached in this module: several virtual nodes share one Ray actor process.

Simulation needs exactly one ClientApp actor: Ray hands each message to whichever actor is idle, so with two
actors an org's generate and train could run in two processes holding two diverging copies of its model. The
first message of a node records the serving process id in ``context.state``; a later message of that node
arriving in another process fails with a :class:`NodeError` that says how to fix the backend config.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import ConfigRecord, Context, RecordDict

from hacrl_fed.flower import records
from hacrl_fed.flower.settings import (
    DEFAULT_WORKER_FACTORY,
    AppSettings,
    load_run_config,
    read_settings,
    run_dir_of,
)
from hacrl_fed.limits import MAX_MESSAGE_MB
from hacrl_fed.wire import operations as ops
from hacrl_fed.wire.operations import Operation

if TYPE_CHECKING:
    from hacrl_fed.config import RunConfig
    from hacrl_fed.worker.api import (
        WorkerAPI,  # deployment mode never needs the run config: keep it out of the per-message ClientApp process
    )

log = logging.getLogger(__name__)

ORG_KEY, WORKER_KEY, MAX_MB_KEY = "org", "worker", "max-message-mb"
TLS_KEYS = ("worker-ca", "worker-cert", "worker-key")  # mutual TLS to the worker: CA, client cert, client key
SERVER_NAME_KEY = "worker-server-name"
SECRET_KEY = "worker-secret-file"  # the link secret of a worker started with --insecure (hacrl_fed.wire.link_secret)
PARTITION_KEY = "partition-id"
STATE_KEY = "hacrl.simulation"  # context.state config record: the process serving this node's org

MODE_DEPLOYMENT, MODE_SIMULATION = "deployment", "simulation"

_SIM_CONFIGS: dict[int, tuple[AppSettings, RunConfig]] = {}  # run id -> settings and config
_SIM_WORKERS: dict[tuple[int, str], Any] = {}  # (run id, org id) -> in-process worker


class NodeError(RuntimeError):
    """A request this node could not serve; the message names org and operation."""


def node_mode(node_config: Mapping[str, Any]) -> str:
    """``deployment`` if ``worker`` is set, ``simulation`` if only ``partition-id`` is, else :class:`NodeError`."""
    if WORKER_KEY in node_config:
        if not isinstance(node_config.get(ORG_KEY), str) or not node_config[ORG_KEY]:
            raise NodeError(
                f"node_config has {WORKER_KEY!r} but no non-empty {ORG_KEY!r}: start the SuperNode "
                f'with --node-config \'org="ORG" worker="unix:/PATH"\''
            )
        return MODE_DEPLOYMENT
    if PARTITION_KEY in node_config:
        return MODE_SIMULATION
    raise NodeError(
        f"node_config {dict(node_config)} names no worker: start the SuperNode with "
        f'--node-config \'org="ORG" worker="unix:/PATH"\''
    )


def load_factory(spec: str) -> Callable[..., Any]:
    """``"package.module:callable"`` -> the callable."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise NodeError(f"worker-factory {spec!r} must look like 'package.module:callable'")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise NodeError(f"worker-factory {spec!r} cannot be loaded: {err}") from None
    if not callable(factory):
        raise NodeError(f"worker-factory {spec!r} is not callable")
    return factory


def _simulation_config(context: Context, app_dir: Path) -> tuple[AppSettings, RunConfig]:
    if context.run_id not in _SIM_CONFIGS:
        settings = read_settings(context.run_config)
        _SIM_CONFIGS[context.run_id] = (settings, load_run_config(settings, app_dir))
    return _SIM_CONFIGS[context.run_id]


def simulation_org(context: Context, cfg: RunConfig) -> str:
    """Org of a simulated node: ``orgs[partition-id]`` of the run config."""
    partition = context.node_config[PARTITION_KEY]
    orgs = [o.id for o in cfg.orgs]
    if not isinstance(partition, int) or not 0 <= partition < len(orgs):
        raise NodeError(
            f"simulated node has partition-id {partition!r} but the config has {len(orgs)} orgs "
            f"{orgs}: run the simulation with num-supernodes = {len(orgs)}"
        )
    return orgs[partition]


def _check_same_process(context: Context, org: str) -> None:
    here: dict[str, int | str] = {"pid": os.getpid(), "host": socket.gethostname()}
    record = context.state.config_records.get(STATE_KEY)
    if record is None:
        context.state.config_records[STATE_KEY] = ConfigRecord(here)  # type: ignore[arg-type]  # flwr wants its exact value union
        return
    seen = {"pid": record.get("pid"), "host": record.get("host")}
    if seen != here:
        raise NodeError(
            f"org {org!r}: its in-process worker lives in process {seen} but this message reached {here}. The "
            "simulation must run exactly one ClientApp actor: set the backend's client-resources num-cpus equal "
            "to init-args num-cpus (hacrl-fed simulate does this)"
        )


def simulation_worker(context: Context, app_dir: Path) -> tuple[str, Any]:
    """``(org, worker)`` of a simulated node, building and caching the worker on first use."""
    settings, cfg = _simulation_config(context, app_dir)
    org = simulation_org(context, cfg)
    from hacrl_fed.sharded.group import check_in_process
    from hacrl_fed.worker.pacing import refuse_emulated_slowdown

    check_in_process(cfg, "Flower simulation")  # flwr run without hacrl-fed simulate: the same refusals
    refuse_emulated_slowdown(cfg, "the Flower simulation")
    _check_same_process(context, org)
    key = (context.run_id, org)
    if key not in _SIM_WORKERS:
        factory = load_factory(settings.worker_factory or DEFAULT_WORKER_FACTORY)
        log.info("building in-process worker for org %s (pid %d)", org, os.getpid())
        _SIM_WORKERS[key] = factory(cfg, org, run_dir=run_dir_of(settings, cfg), resume=settings.resume)
    return org, _SIM_WORKERS[key]


def release_simulation_workers(run_id: int | None = None) -> int:
    """Drop cached in-process workers (of one run, or all); returns how many were dropped."""
    keys = [k for k in _SIM_WORKERS if run_id is None or k[0] == run_id]
    for key in keys:
        close = getattr(_SIM_WORKERS.pop(key), "close", None)
        if callable(close):
            close()
    for rid in [r for r in _SIM_CONFIGS if run_id is None or r == run_id]:
        del _SIM_CONFIGS[rid]
    return len(keys)


def _text(node_config: Mapping[str, Any], key: str) -> str:
    value = node_config[key]
    if not isinstance(value, str) or not value:
        raise NodeError(f"node_config {key!r}: expected a non-empty string, got {value!r}")
    return value


def worker_tls(node_config: Mapping[str, Any]) -> Any:
    """The :class:`~hacrl_fed.wire.grpc_client.ClientTLS` the node_config asks for, or None (plaintext).

    Plaintext is allowed only to a ``unix:`` or loopback ``worker``; :class:`NodeError` otherwise, or when only
    some of ``worker-ca`` / ``worker-cert`` / ``worker-key`` are set.
    """
    from hacrl_fed.wire.grpc_client import ClientTLS
    from hacrl_fed.wire.grpc_server import is_local_address

    given = [key for key in TLS_KEYS if key in node_config]
    if not given:
        address = _text(node_config, WORKER_KEY)
        if not is_local_address(address):
            raise NodeError(
                f"worker {address!r} is neither a unix: socket nor loopback: set worker-ca, worker-cert "
                "and worker-key in --node-config (mutual TLS)"
            )
        return None
    if len(given) != len(TLS_KEYS):
        raise NodeError(
            f"node_config sets {given} but not {[k for k in TLS_KEYS if k not in given]}: mutual TLS "
            f"needs all of {list(TLS_KEYS)}"
        )
    ca, cert, key = (_text(node_config, k) for k in TLS_KEYS)
    server_name = _text(node_config, SERVER_NAME_KEY) if SERVER_NAME_KEY in node_config else None
    return ClientTLS(ca=ca, cert=cert, key=key, server_name=server_name)


def _deployment_worker(node_config: Mapping[str, Any], deadline_s: float | None) -> tuple[str, Any]:
    from hacrl_fed.wire.grpc_client import GrpcWorkerClient  # grpc only where it is used

    max_mb = node_config.get(MAX_MB_KEY, MAX_MESSAGE_MB)
    if not isinstance(max_mb, int) or isinstance(max_mb, bool) or max_mb < 1:
        raise NodeError(f"node_config {MAX_MB_KEY!r}: expected a positive int, got {max_mb!r}")
    org = node_config[ORG_KEY]
    secret = None
    if SECRET_KEY in node_config:
        from hacrl_fed.wire.link_secret import read_secret_file

        try:
            secret = read_secret_file(_text(node_config, SECRET_KEY))
        except ValueError as err:
            raise NodeError(f"node_config {SECRET_KEY!r}: {err}") from None
    client = GrpcWorkerClient(
        _text(node_config, WORKER_KEY),
        org_id=org,
        timeout_s=deadline_s,
        max_message_mb=max_mb,
        tls=worker_tls(node_config),
        secret=secret,
    )
    return org, client


def _call(op: Operation, worker: WorkerAPI, request: Any, org: str, mode: str) -> Any:
    """Run ``op`` on ``worker``; returns its reply as a protobuf message. A reply naming another org fails."""
    reply = op.call(worker, request)
    if op is ops.HEALTH:
        info = dict(reply)
        if info.get("org_id", org) != org:
            raise NodeError(f"the worker reports org {info['org_id']!r}; this node serves {org!r}")
        reply = {**info, "org_id": org, "node_mode": mode}
    # RolloutBatch / TrainReport / EvalReport name their org, and so do the parts of a StepReply
    for part in (reply, *(getattr(reply, name, None) for name in ("report", "batch", "eval_report"))):
        if (answered := getattr(part, "org_id", org)) != org:
            raise NodeError(f"the worker answered as org {answered!r}; this node serves {org!r}")
    return op.encode_reply(reply)


def _serve(op: Operation, content: RecordDict, org: str, mode: str, worker: WorkerAPI) -> RecordDict:
    return records.pack(_call(op, worker, records.unpack(content, op.request_kind), org, mode))


def handle(
    op: Operation, content: RecordDict, context: Context, *, app_dir: Path, deadline_s: float | None = None
) -> RecordDict:
    """Serve one request of this node: unpack ``content``, call the org's worker, pack the reply.

    ``deadline_s`` bounds gRPC calls (deployment); any failure raises :class:`NodeError` naming org and operation.
    """
    org = "?"
    try:
        mode = node_mode(context.node_config)
        if mode == MODE_DEPLOYMENT:
            org, worker = _deployment_worker(context.node_config, deadline_s)
            try:
                return _serve(op, content, org, mode, worker)
            finally:
                worker.close()
        org, worker = simulation_worker(context, app_dir)
        return _serve(op, content, org, mode, worker)
    except Exception as err:
        where = f"{op.name} on org {org!r}" if org != "?" else op.name
        detail = str(err) if isinstance(err, NodeError) else f"{type(err).__name__}: {err}"
        raise NodeError(f"{where}: {detail}") from err
