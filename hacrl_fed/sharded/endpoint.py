"""``hacrl-fed worker`` as one rank of a sharded org (``torchrun --nproc-per-node N -m hacrl_fed.cli worker ...``).

:func:`serve_ranks` runs on every rank: join the group (:func:`~hacrl_fed.sharded.group.init_group`), start the
heartbeat, build this rank's worker (``worker_factory``, default :func:`~hacrl_fed.sharded.dispatch.rank_worker`)
and say so in the store (``done/0/<rank>``). Rank 0 waits until every rank has built its worker, then serves the
org's gRPC endpoint exactly as a plain worker does (:func:`hacrl_fed.cli.worker.serve_endpoint`: the link
rules, TLS, link secret and the one ready line stay on rank 0 alone; the command line passes it in as ``serve``) with a
:class:`~hacrl_fed.sharded.dispatch.RankDispatcher` as the worker. The other ranks run
:func:`~hacrl_fed.sharded.dispatch.rank_loop`; they bind nothing and speak to no one but the group.

Stopping: SIGTERM / SIGINT on rank 0 (or the launcher gone) stops the server gracefully, tells the other ranks to
leave their loops, and every rank exits 0, so torchrun's agent exits 0. The other ranks keep the default action
of SIGTERM (torchrun's agent signals every rank when it stops). After a rank fault rank 0 sends its reply (the
one line naming the rank), stops serving and exits 1 without waiting on the group; torchrun's agent then ends the
remaining ranks. Every rank also stops when torchrun's agent is no longer its parent, and rank 0 when the agent's
own parent is no longer the launcher that started it (``HACRL_FED_PARENT_PID``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from hacrl_fed import failures
from hacrl_fed.config import BuildError
from hacrl_fed.sharded.dispatch import RankDispatcher, close_worker, parent_alive, rank_loop, wait_ack
from hacrl_fed.sharded.group import RankGroup, TorchrunEnv, init_group
from hacrl_fed.sharded.watchdog import Heartbeat, RankFault, post_outcome
from hacrl_fed.wire.bounds import worker_limits
from hacrl_fed.worker.orphan_guard import PARENT_PID_ENV

log = logging.getLogger("hacrl_fed.wire.grpc_server")
_BUILD_SEQ = 0


def _ppid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def group_alive(environ: dict[str, str] | Any = os.environ) -> Callable[[], bool]:
    """True while torchrun's agent is this process's parent and, when the launcher set ``HACRL_FED_PARENT_PID``,
    the agent's parent is still that launcher (read from ``/proc``; not checked where there is none)."""
    agent, launcher = os.getppid(), environ.pop(PARENT_PID_ENV, None)
    own = parent_alive(agent)
    if launcher is None or _ppid_of(agent) is None:
        return own
    return lambda: own() and _ppid_of(agent) == int(launcher)


def _serve_other_rank(
    group: RankGroup, heartbeat: Heartbeat, build: Callable[[], Any], cfg: Any, alive: Callable[[], bool]
) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    store = group.connect()
    try:
        worker = build()
    except Exception as err:  # rank 0 reports it, naming this rank
        log.error("rank %d of %s: build failed: %s", group.rank, group.org_id, failures.describe(err))
        post_outcome(store, _BUILD_SEQ, group.rank, {"fault": f"build failed ({failures.describe(err)})"})
        wait_ack(store, group.rank)
        return 2
    post_outcome(store, _BUILD_SEQ, group.rank, {})
    limits = worker_limits(cfg)
    code = rank_loop(group, worker, heartbeat, limits, alive)
    if code == 0:  # a clean stop; after a fault torchrun's agent ends this process
        close_worker(worker)
        heartbeat.stop()
        group.close()
    return code


def serve_ranks(
    cfg: Any,
    org_id: str,
    env: TorchrunEnv,
    *,
    build: Callable[[], Any],
    serve: Callable[[Any, Callable[[], bool]], int],
) -> int:
    """One rank of ``org_id``'s sharded worker (module docstring); returns the process's exit code.

    ``build()`` builds this rank's worker (``hacrl-fed worker`` passes its ``rank_worker`` factory; tests pass
    stand-ins); ``serve(dispatcher, halt)`` is rank 0's endpoint, serving ``dispatcher`` until stopped or
    ``halt()`` (:func:`hacrl_fed.cli.worker.serve_endpoint`)."""
    from hacrl_fed.wire.grpc_server import describe_worker

    alive = group_alive()
    group = init_group(cfg, org_id, env)
    heartbeat = Heartbeat(group).start()
    if group.rank != 0:
        return _serve_other_rank(group, heartbeat, build, cfg, alive)
    dispatcher = RankDispatcher(group, build(), heartbeat)
    try:
        dispatcher.watchdog.wait(_BUILD_SEQ, "build", lambda: {}, None)
    except RankFault as fault:
        dispatcher.watchdog.ack(fault.rank)
        raise BuildError(str(fault)) from None
    what = describe_worker(dispatcher.worker)
    log.info("hacrl-fed worker serves %s, on %d ranks (%s)", what, env.world_size, group.backend)
    code = serve(dispatcher, lambda: dispatcher.failed.is_set() or not alive())
    if dispatcher.failed.is_set():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # the group cannot be trusted: no teardown that could wait on a dead or hung rank
    return code
