"""The ranks of one org's worker: torchrun's environment, the launch checks, the process group and the rank store.

An org with ``orgs[i].sharding.ranks = N > 1`` runs ``hacrl-fed worker`` as ``N`` processes started by torch's own
launcher (``torchrun --nproc-per-node N -m hacrl_fed.cli worker ...``, or several nodes through torchrun's
rendezvous). Each process reads its place from the environment torchrun sets (:func:`torchrun_env`: ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); :func:`check_launch` refuses, in one line naming
the field, a world size other than ``ranks`` and a sharded org started without torchrun (the line gives the
torchrun command); :func:`check_in_process` refuses a sharded org where every worker is built in one process
(the ``inprocess`` transport, the Flower simulation). :func:`init_group` joins the ``torch.distributed`` group:
backend ``auto`` = ``nccl`` on CUDA (each rank on its ``LOCAL_RANK`` device) else ``gloo``; collectives time out
``hang_timeout_s +`` :data:`COLLECTIVE_MARGIN_S` (after the watchdog of :mod:`hacrl_fed.sharded.watchdog` has named
the rank that hung). The group's TCPStore (torchrun's agent store, or rank 0's when torchrun hosts none) also
carries the endpoint's own keys under ``hacrl_fed/`` (:meth:`RankGroup.connect`): requests, heartbeats, outcomes.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from hacrl_fed.config import ConfigError
from hacrl_fed.refusals import check_sharded_org, org_field

COLLECTIVE_MARGIN_S = 30.0  # a collective waits this much longer than the watchdog's hang_timeout_s
STORE_CONNECT_S = 120.0  # how long a rank waits for the store (a slow node of a multi-node rendezvous)
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class ShardingError(ConfigError):
    """A sharded worker started the wrong way (one line naming the field or saying the torchrun command)."""


@dataclass(frozen=True)
class TorchrunEnv:
    """Where this process stands in the group, as torchrun (or any launcher setting its variables) says."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    agent_store: bool  # TORCHELASTIC_USE_AGENT_STORE: the agent hosts the store, every rank is a client


def torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv | None:
    """This process's :class:`TorchrunEnv`, or None when not started by torchrun (``RANK`` / ``WORLD_SIZE`` /
    ``MASTER_ADDR`` / ``MASTER_PORT`` unset). ShardingError for values that are not numbers."""
    env = os.environ if environ is None else environ
    if not all(env.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    try:
        rank, world, local, port = (int(env.get(k) or 0) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"))
    except ValueError:
        raise ShardingError(f"torchrun environment: {', '.join(_ENV)} must be integers (but MASTER_ADDR)") from None
    if not 0 <= rank < world:
        raise ShardingError(f"torchrun environment: RANK={rank} is outside WORLD_SIZE={world}")
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return TorchrunEnv(rank, world, local, str(env["MASTER_ADDR"]), port, agent)


def ranks_field(cfg: Any, org_id: str) -> str:
    """``orgs[<index>].sharding.ranks``: the field that sets how many ranks ``org_id`` runs on."""
    return org_field(cfg, org_id, "sharding.ranks")


def torchrun_command(ranks: int, worker_argv: Sequence[str]) -> str:
    """The command that starts ``hacrl-fed worker <worker_argv>`` as ``ranks`` processes on this node."""
    return shlex.join(["torchrun", "--nproc-per-node", str(ranks), "-m", "hacrl_fed.cli", "worker", *worker_argv])


def check_launch(cfg: Any, org_id: str, env: TorchrunEnv | None, worker_argv: Sequence[str]) -> bool:
    """Whether this process is one rank of a sharded worker (True) or a plain worker (False, ``ranks = 1`` and no
    torchrun, or torchrun with one process); ShardingError when the launch and the org's ``sharding.ranks``
    disagree, or the org's settings cannot run sharded (:func:`hacrl_fed.refusals.check_sharded_org`)."""
    ranks, field = cfg.org(org_id).sharding.ranks, ranks_field(cfg, org_id)
    try:
        check_sharded_org(cfg, org_id)  # the rule the coordinator's preflight checks too (hacrl_fed.refusals)
    except ConfigError as err:
        raise ShardingError(str(err)) from err
    if env is None:
        if ranks > 1:
            raise ShardingError(
                f"{field}={ranks} (org {org_id!r}): a sharded worker runs its ranks under torchrun; start it with "
                f"`{torchrun_command(ranks, worker_argv)}`"
            )
        return False
    if env.world_size != ranks:
        raise ShardingError(
            f"{field}={ranks} (org {org_id!r}) but torchrun started {env.world_size} processes (WORLD_SIZE): "
            f"give torchrun --nproc-per-node {ranks} (in all, over its nodes) or set {field}={env.world_size}"
        )
    return ranks > 1


def check_in_process(cfg: Any, transport: str) -> None:
    """ShardingError for an org with ``sharding.ranks > 1`` in a transport that builds every worker in one process
    (``inprocess``, the Flower simulation): its ranks need torchrun, i.e. a worker process of their own."""
    for i, org in enumerate(cfg.orgs):
        if org.sharding.ranks > 1:
            raise ShardingError(
                f"orgs[{i}].sharding.ranks={org.sharding.ranks} (org {org.id!r}): the {transport} transport builds "
                "every worker in this process, and a sharded worker runs as ranks under torchrun; use --transport "
                "grpc (hacrl-fed run starts the ranks), or a Flower deployment whose SuperNode reaches a worker "
                "started by torchrun"
            )


def resolve_backend(backend: str, cuda: bool | None = None) -> str:
    """``auto`` -> ``nccl`` when CUDA is available, else ``gloo``; ``nccl`` without CUDA is a ShardingError."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if backend == "auto":
        return "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise ShardingError("sharding.backend=nccl needs CUDA devices; use gloo (or auto) on CPU")
    return backend


@dataclass
class RankGroup:
    """This process's place in its org's group once :func:`init_group` joined it."""

    org_id: str
    env: TorchrunEnv
    backend: str
    hang_timeout_s: float

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    def connect(self) -> Any:
        """A new client of the group's TCPStore, its keys under ``hacrl_fed/`` (one per thread that uses it)."""
        from torch.distributed import PrefixStore

        return PrefixStore("hacrl_fed/", _tcp_store(self.env, master=False))

    def close(self) -> None:
        """Leave the process group (a clean stop; after a fault the process just exits)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _tcp_store(env: TorchrunEnv, *, master: bool) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=master,
        timeout=timedelta(seconds=STORE_CONNECT_S),
        multi_tenant=True,
    )


def init_group(cfg: Any, org_id: str, env: TorchrunEnv) -> RankGroup:
    """Join the org's ``torch.distributed`` group (module docstring): the backend, the CUDA device for nccl, the
    collective timeout. Rank 0 hosts the store when torchrun's agent does not."""
    import torch
    import torch.distributed as dist

    sharding = cfg.org(org_id).sharding
    backend = resolve_backend(sharding.backend)
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank)
    store = _tcp_store(env, master=env.rank == 0 and not env.agent_store)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("pg/", store),
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=sharding.hang_timeout_s + COLLECTIVE_MARGIN_S),
    )
    return RankGroup(org_id, env, backend, float(sharding.hang_timeout_s))
