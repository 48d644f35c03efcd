"""Every rank's heartbeat, and rank 0's watch over one request: the rank that dies, hangs or runs out of memory
fails the org's reply with one line naming it.

Each rank runs a :class:`Heartbeat` thread that writes ``hb/<rank>`` in the group's store every
:data:`HEARTBEAT_S`: a counter, the request it is in (``seq``, operation) and whether its request thread waits in
``torch.distributed`` (a collective) or not. At start it writes ``rank/<rank>``: its pid and host. A rank ends each
request by writing its outcome, ``done/<seq>/<rank>`` (:func:`post_outcome`, :func:`outcome`): ok, the error
it raised, or a *fault*, which it does not survive: out of memory (``torch.OutOfMemoryError`` / ``MemoryError``,
raised or in a step part's failure). After a fault the rank waits up to :data:`ACK_WAIT_S` for rank 0's
``ack/<rank>``, then exits. Rank 0 reads the outcomes once the ``ndone/<seq>`` counter says all are in or
``faulted/<seq>`` is set (one look per poll, however many ranks).

Rank 0's :meth:`Watchdog.wait` polls the store (pauses doubling up to :data:`POLL_S`) while its own share of the
request runs in a thread, and raises :class:`RankFault` (``rank 1 of acme: out of memory in train (CUDA out of
memory ...)``) as soon as one of these holds, in this order of blame:

* a rank *died*: its pid is gone (a rank on rank 0's host), or its counter has not moved for :data:`DEAD_AFTER_S`
  (a rank on another host);
* a rank reported a fault;
* a rank *hung*: the request has run ``sharding.hang_timeout_s`` and the rank is not done; of several such ranks
  the one not waiting in a collective is blamed (the others wait for it);
* a rank ``r > 0`` raised where rank 0 did not (the ranks no longer hold the same state).

The watchdog does not count on torch.distributed: a dead rank's peers may be stuck in a collective until its
timeout (``hang_timeout_s +`` :data:`~hacrl_fed.sharded.group.COLLECTIVE_MARGIN_S`), and the reply fails first.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

HEARTBEAT_S = 0.5
DEAD_AFTER_S = 30.0  # a remote rank whose counter has not moved this long is gone (a local one: by its pid)
POLL_S = 0.05
ACK_WAIT_S = 10.0
_COLLECTIVE = f"{os.sep}torch{os.sep}distributed{os.sep}"
MAX_CAUSE_CHARS = 300


class RankFault(RuntimeError):
    """One rank failed the org's request; the message is the one line ``rank R of ORG: CAUSE``. The group can no
    longer be trusted: rank 0 replies with this and stops every rank."""

    def __init__(self, org_id: str, rank: int, cause: str) -> None:
        super().__init__(f"rank {rank} of {org_id}: {cause}")
        self.rank, self.cause = rank, cause


def poll_pauses(first_s: float = 0.002) -> Iterator[float]:
    """Pauses between polls of the store: ``first_s``, doubling up to :data:`POLL_S` (a short request is seen
    within milliseconds, a long wait costs one look every POLL_S)."""
    pause = first_s
    while True:
        yield pause
        pause = min(POLL_S, pause * 2)


def _short(text: str) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= MAX_CAUSE_CHARS else line[: MAX_CAUSE_CHARS - 3] + "..."


def _is_oom(err: BaseException) -> bool:
    if isinstance(err, MemoryError):
        return True
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return oom is not None and isinstance(err, oom)


def outcome(op: str, result: Any = None, error: BaseException | None = None) -> dict[str, str]:
    """What one rank's share of operation ``op`` came to: ``{}`` (ok), ``{"error": text}`` (it raised; the
    request's own failure) or ``{"fault": cause}`` (out of memory, raised or as a step part's failure in
    ``result.raised``)."""
    from hacrl_fed import failures

    if error is not None:
        if _is_oom(error):
            return {"fault": f"out of memory in {op} ({_short(str(error))})"}
        return {"error": _short(failures.describe(error))}
    for part, err in (getattr(result, "raised", None) or {}).items():
        if _is_oom(err):
            return {"fault": f"out of memory in {part} ({_short(str(err))})"}
    return {}


def post_outcome(store: Any, seq: int, rank: int, state: dict[str, str]) -> None:
    """Rank ``rank``'s outcome of request ``seq`` (:func:`outcome`): ``done/<seq>/<rank>``, one more on the
    ``ndone/<seq>`` counter, and ``faulted/<seq>`` for a fault."""
    store.set(f"done/{seq}/{rank}", json.dumps(state))
    store.add(f"ndone/{seq}", 1)
    if "fault" in state:
        store.set(f"faulted/{seq}", str(rank))


def _where(thread_id: int | None) -> str:
    """``collective`` when that thread's innermost Python frame is torch.distributed code, else ``compute``."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    if frame is None:
        return "idle"
    return "collective" if _COLLECTIVE in frame.f_code.co_filename else "compute"


class Heartbeat:
    """This rank's heartbeat thread (module docstring); :meth:`enter` / :meth:`leave` mark a request."""

    def __init__(self, group: Any, interval_s: float = HEARTBEAT_S) -> None:
        self.group, self.interval_s = group, interval_s
        self._seq, self._op = 0, "idle"
        self._thread_id: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-rank{group.rank}", daemon=True)

    def start(self) -> Heartbeat:
        store = self.group.connect()
        store.set(f"rank/{self.group.rank}", json.dumps({"pid": os.getpid(), "host": host_id()}))
        self._store = store
        self._beat(0)
        self._thread.start()
        return self

    def enter(self, seq: int, op: str, thread_id: int | None = None) -> None:
        self._seq, self._op, self._thread_id = seq, op, thread_id or threading.get_ident()

    def leave(self) -> None:
        self._op, self._thread_id = "idle", None

    def _beat(self, n: int) -> None:
        state = {"n": n, "seq": self._seq, "op": self._op, "where": _where(self._thread_id)}
        self._store.set(f"hb/{self.group.rank}", json.dumps(state))

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(self.interval_s):
            n += 1
            try:
                self._beat(n)
            except Exception:  # the store is gone: the group is being torn down
                return

    def stop(self) -> None:
        self._stop.set()


def host_id() -> str:
    """This host and pid namespace (``name/pid:[inode]``): pids are comparable only between equal ids."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()}/{namespace}"


def pid_gone(pid: int) -> bool:
    """Whether process ``pid`` of this host has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


class Watchdog:
    """Rank 0's watch over the ranks' outcomes of one request at a time (module docstring)."""

    def __init__(self, group: Any, store: Any) -> None:
        self.group, self.store, self.host = group, store, host_id()
        self._pids: dict[int, int | None] = {}  # rank -> its pid when it runs on this host, else None
        self._beats: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)
        self._where: dict[int, str] = {}
        self._next_beat_check = 0.0

    def wait(
        self, seq: int, op: str, own: Callable[[], dict[str, str] | None], deadline_s: float | None
    ) -> dict[int, dict[str, str]]:
        """Every rank's outcome of request ``seq`` (rank 0's from ``own()``, None while it runs); RankFault as soon
        as a rank dies, reports a fault, outlives ``deadline_s`` or raised where rank 0 did not."""
        start, outcomes, pauses = time.monotonic(), dict[int, dict[str, str]](), poll_pauses()
        while True:
            self._collect(seq, outcomes)
            if 0 not in outcomes and (mine := own()) is not None:
                outcomes[0] = mine
            now = time.monotonic()
            faults = self._faults(outcomes, op, now)
            if not faults and deadline_s is not None and now - start > deadline_s:
                self._collect(seq, outcomes, full=True)
                faults = self._hung(outcomes, op, now - start)
            if not faults and len(outcomes) == self.group.world_size:
                faults = self._diverged(outcomes, op)
                if not faults:
                    return outcomes
            if faults:
                _, rank, cause = min(faults)
                raise RankFault(self.group.org_id, rank, cause)
            time.sleep(next(pauses))

    def ack(self, rank: int) -> None:
        """Let a rank that reported a fault exit now (it waits for this up to :data:`ACK_WAIT_S`)."""
        try:
            self.store.set(f"ack/{rank}", "1")
        except Exception:  # the store is gone with its host: nothing waits any more
            pass

    def forget(self, seq: int) -> None:
        """Drop request ``seq``'s keys once every rank is done with it."""
        keys = [f"req/{seq}", f"ndone/{seq}", f"faulted/{seq}"]
        for key in keys + [f"done/{seq}/{r}" for r in range(1, self.group.world_size)]:
            self.store.delete_key(key)

    def _collect(self, seq: int, outcomes: dict[int, dict[str, str]], full: bool = False) -> None:
        """Read the ranks' outcomes once all are in, a fault is flagged, or ``full``: one counter read per poll,
        however many ranks."""
        others = self.group.world_size - 1
        if not full and self.store.add(f"ndone/{seq}", 0) < others and not self.store.check([f"faulted/{seq}"]):
            return
        for r in range(1, self.group.world_size):
            key = f"done/{seq}/{r}"
            if r not in outcomes and self.store.check([key]):
                outcomes[r] = json.loads(self.store.get(key))

    def _faults(self, outcomes: dict[int, dict[str, str]], op: str, now: float) -> list[tuple[int, int, str]]:
        faults = [(1, r, o["fault"]) for r, o in outcomes.items() if "fault" in o]
        if now >= self._next_beat_check:
            self._next_beat_check = now + HEARTBEAT_S
            for r in range(1, self.group.world_size):
                if r not in outcomes and (why := self._died(r, now)):
                    faults.append((0, r, f"died ({why}) in {op}"))
        return faults

    def _hung(self, outcomes: dict[int, dict[str, str]], op: str, elapsed: float) -> list[tuple[int, int, str]]:
        pending = [r for r in range(self.group.world_size) if r not in outcomes]
        self._read_beats(pending, time.monotonic())
        working = [r for r in pending if self._where.get(r) != "collective"] or pending
        return [(2, r, f"hung in {op} for {elapsed:.0f} s") for r in working]

    @staticmethod
    def _diverged(outcomes: dict[int, dict[str, str]], op: str) -> list[tuple[int, int, str]]:
        if "error" in outcomes[0]:
            return []
        return [(3, r, f"failed in {op} ({o['error']})") for r, o in outcomes.items() if "error" in o]

    def _died(self, rank: int, now: float) -> str:
        if rank not in self._pids and self.store.check([f"rank/{rank}"]):
            info = json.loads(self.store.get(f"rank/{rank}"))
            self._pids[rank] = int(info["pid"]) if info.get("host") == self.host else None
        pid = self._pids.get(rank)
        if pid is not None:  # on this host the pid says it (a busy rank may hold its GIL past DEAD_AFTER_S)
            return f"process {pid} exited" if pid_gone(pid) else ""
        self._read_beats([rank], now)
        count, moved = self._beats[rank]
        return f"no heartbeat for {now - moved:.1f} s" if now - moved > DEAD_AFTER_S else ""

    def _read_beats(self, ranks: list[int], now: float) -> None:
        for r in ranks:
            if not self.store.check([f"hb/{r}"]):  # not started yet: silent from the first look on
                self._beats.setdefault(r, (-1, now))
                continue
            state = json.loads(self.store.get(f"hb/{r}"))
            self._where[r] = state.get("where", "")
            if r not in self._beats or self._beats[r][0] != state["n"]:
                self._beats[r] = (state["n"], now)
