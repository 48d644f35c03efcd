"""InFlight: single step messages pushed over a grid, their replies pulled as they come (hacrl_fed/flower/inflight.py).
A scripted grid; :meth:`InFlight.pull_once` is called by hand, so nothing waits on the pulling thread."""

from __future__ import annotations

import time
from collections import Counter
from types import SimpleNamespace

from hacrl_fed.coordinator.transport import TransportTimeout
from hacrl_fed.flower.inflight import InFlight, LockedGrid
from hacrl_fed.flower.transport import OrgUnavailable


def _msg(mid: str, node: int = 1):
    return SimpleNamespace(metadata=SimpleNamespace(message_id=mid, message_type="train.step", dst_node_id=node))


def _reply(to: str, src: int, error: bool = False):
    return SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=to, src_node_id=src), has_error=lambda: error)


class Grid:
    def __init__(self, refuse=()):
        self.refuse, self.replies, self.pulled = set(refuse), [], []

    def push_messages(self, messages):
        return [m.metadata.message_id for m in messages if m.metadata.message_id not in self.refuse]

    def pull_messages(self, ids):
        self.pulled.append(sorted(ids))
        out, self.replies = self.replies, []  # whatever is queued, asked for or not (a hostile or buggy SuperLink)
        return out


def _inflight(grid):
    return InFlight(LockedGrid(grid), poll_s=60.0, ignored=Counter(), unavailable=OrgUnavailable)


def test_a_reply_settles_its_message_and_only_its_message():
    grid = Grid()
    box = _inflight(grid)
    first = box.push(1, _msg("m1", 1), 30.0, lambda r, s: ("decoded", r.metadata.src_node_id))
    second = box.push(2, _msg("m2", 2), 30.0, lambda r, s: r)
    grid.replies = [_reply("m1", 1), _reply("m2", 7), _reply("zz", 2)]  # m2's from the wrong node; zz: no such
    box.pull_once()
    assert first.done() and first.result()[0] == ("decoded", 1) and first.result()[1] >= 0
    assert not second.done() and box.ignored == Counter({"wrong_node": 1, "unknown": 1})
    assert grid.pulled == [["m1", "m2"]]
    grid.replies = [_reply("m2", 0, error=True)]  # Flower's own error replies come from the SuperLink: taken
    box.pull_once()
    assert second.result()[0].has_error() and grid.pulled[-1] == ["m2"]
    box.pull_once()  # nothing in flight: no pull
    assert len(grid.pulled) == 2
    box.close()


def test_a_refused_push_and_a_late_reply_settle_as_errors():
    grid = Grid(refuse={"m1"})
    box = _inflight(grid)
    refused = box.push(1, _msg("m1"), 30.0, lambda r, s: r)
    assert isinstance(refused.result(timeout=0)[0], OrgUnavailable)
    late = box.push(2, _msg("m2", 2), 0.01, lambda r, s: r)
    time.sleep(0.02)
    box.pull_once()
    reply, seconds = late.result(timeout=0)
    assert isinstance(reply, TransportTimeout) and seconds >= 0.01
    grid.replies = [_reply("m2", 2)]  # its reply after the deadline: never pulled (its id is no longer asked for)
    box.pull_once()
    assert grid.pulled == [["m2"]]
    pending = box.push(3, _msg("m3", 3), 30.0, lambda r, s: r)
    box.close()  # what is still in flight settles as a timeout
    assert isinstance(pending.result(timeout=0)[0], TransportTimeout)
