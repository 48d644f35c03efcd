"""What a Flower deployment message costs on our side: the ServerApp's push/pull loop (:func:`exchange`, over a fake
Grid and a fake clock: no wall time), the ``reply-poll`` setting, the harness's SuperExec poll setting, the
SuperNode log timeline of ``bench system``, and the ClientApp module staying free of torch."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from uuid import uuid4

import pytest

from hacrl_tools.bench import deploy_timeline
from hacrl_fed.coordinator.transport import TransportTimeout
from hacrl_tools.deploy_local import FAST_POLL_ENV, Deployment
from hacrl_fed.flower import records
from hacrl_fed.wire import operations as ops
from hacrl_fed.flower.settings import REPLY_POLL_S, SettingsError, read_settings, to_run_config
from hacrl_fed.flower.transport import FIRST_POLL_S, OrgUnavailable, exchange
from hacrl_fed.wire import codec

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def flower_identity():
    """Let ``flwr.app.Message(...)`` be built outside a Flower runtime (it reads the process's task identity)."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 4242, 0
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


class Clock:
    """A fake monotonic clock that only ``sleep`` moves."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


def reply(to: str, src: int, *, error: bool = False, tag: str = "") -> SimpleNamespace:
    meta = SimpleNamespace(reply_to_message_id=to, src_node_id=src, message_id=uuid4().hex)
    return SimpleNamespace(metadata=meta, has_error=lambda: error, tag=tag)


class ScriptedGrid:
    """A Grid whose replies appear at scripted fake times.

    ``script(pushed) -> [(at, reply)]`` is called once with ``{node: message_id}`` after the push; every pull returns
    (once) the scripted replies due by then whose ids were asked for, or with ``loose`` (a hostile SuperLink) every
    reply due. Pushes to ``refuse`` nodes get no id.
    """

    def __init__(self, clock: Clock, script, *, refuse=(), loose=False):
        self.clock, self.script, self.refuse, self.loose = clock, script, set(refuse), loose
        self.due: list[tuple[float, SimpleNamespace]] = []
        self.pulls: list[float] = []

    def get_node_ids(self):
        return [1, 2, 3]

    def push_messages(self, messages):
        ids, by_node = [], {}
        for msg in messages:
            mid = uuid4().hex
            msg.metadata.__dict__["_message_id"] = mid
            if msg.metadata.dst_node_id in self.refuse:
                ids.append("")
            else:
                ids.append(mid)
                by_node[msg.metadata.dst_node_id] = mid
        self.due = [(self.clock() + at, r) for at, r in self.script(by_node)]
        return ids

    def pull_messages(self, message_ids):
        self.pulls.append(self.clock())
        asked = set(message_ids)
        out, keep = [], []
        for at, r in self.due:
            if at <= self.clock() and (self.loose or r.metadata.reply_to_message_id in asked):
                out.append(r)
            else:
                keep.append((at, r))
        self.due = keep
        return out


def run(grid, clock, nodes=(1, 2), timeout_s=3.0, **kw):
    """:func:`exchange` of a health query to ``nodes`` on the fake clock; ``(replies, ignored counts)``."""
    contents = {n: records.pack(codec.health_request()) for n in nodes}
    ignored: Counter[str] = Counter()
    out = exchange(grid, ops.HEALTH, contents, timeout_s, clock=clock, sleep=clock.sleep, ignored=ignored, **kw)
    return out, ignored


def test_replies_out_of_order_are_matched_to_their_requests():
    clock = Clock()
    grid = ScriptedGrid(clock, lambda ids: [(0.2, reply(ids[2], 2, tag="for-2")), (0.5, reply(ids[1], 1, tag="for-1"))])
    out, ignored = run(grid, clock)
    assert out[1][0].tag == "for-1" and out[2][0].tag == "for-2"
    assert out[2][1] < out[1][1] <= 0.5 + 0.1  # seconds until pulled; noticed within one max poll
    assert not ignored
    assert clock.now - 100.0 < 3.0  # stopped as soon as every reply was in


def test_missing_and_late_replies_time_out_at_the_deadline_of_the_fake_clock():
    clock = Clock()
    grid = ScriptedGrid(clock, lambda ids: [(0.1, reply(ids[1], 1)), (3.5, reply(ids[2], 2))])  # 2 is late
    out, ignored = run(grid, clock, nodes=(1, 2, 3), timeout_s=3.0)
    assert not isinstance(out[1][0], Exception)
    for node in (2, 3):  # late (after the deadline) and missing alike
        assert isinstance(out[node][0], TransportTimeout) and out[node][1] == 3.0
    assert grid.pulls[-1] == pytest.approx(103.0)  # one last pull exactly at the deadline, none after
    assert clock.now == pytest.approx(103.0)
    assert sum(clock.sleeps) == pytest.approx(3.0)
    assert not ignored


def test_a_reply_due_exactly_at_the_deadline_is_taken():
    clock = Clock()
    grid = ScriptedGrid(clock, lambda ids: [(2.0, reply(ids[1], 1))])
    out, _ = run(grid, clock, nodes=(1,), timeout_s=2.0)
    assert not isinstance(out[1][0], Exception) and out[1][1] == pytest.approx(2.0)


def test_poll_backs_off_from_50_ms_to_the_configured_cap():
    clock = Clock()
    grid = ScriptedGrid(clock, lambda ids: [])
    run(grid, clock, nodes=(1,), timeout_s=1.0, max_poll_s=0.1)
    assert clock.sleeps[0] == FIRST_POLL_S
    assert clock.sleeps[1] == pytest.approx(FIRST_POLL_S * 1.5)
    assert max(clock.sleeps) == pytest.approx(0.1)
    assert all(b >= a or b == clock.sleeps[-1] for a, b in zip(clock.sleeps, clock.sleeps[1:]))
    clock2 = Clock()
    run(ScriptedGrid(clock2, lambda ids: []), clock2, nodes=(1,), timeout_s=1.0, max_poll_s=0.02)
    assert max(clock2.sleeps) == pytest.approx(0.02)  # a cap below the first poll wins


def test_duplicate_unknown_and_wrong_node_replies_are_counted_and_ignored():
    clock = Clock()

    def script(ids):
        return [
            (0.1, reply(ids[2], 1, tag="impostor")),  # content from node 1 answering node 2's message
            (0.1, reply("no-such-id", 1)),  # answers no message of this call
            (0.2, reply(ids[1], 1, tag="first")),
            (0.2, reply(ids[1], 1, tag="again")),  # a second reply to the same message, same pull
            (0.6, reply(ids[1], 1, tag="later")),  # ... and in a later pull
            (0.7, reply(ids[2], 2, tag="real")),
        ]

    out, ignored = run(ScriptedGrid(clock, script, loose=True), clock, timeout_s=3.0)
    assert out[1][0].tag == "first" and out[2][0].tag == "real"
    assert ignored == {"wrong_node": 1, "unknown": 1, "duplicate": 2}


def test_flower_error_replies_from_the_superlink_are_accepted():
    clock = Clock()
    grid = ScriptedGrid(clock, lambda ids: [(0.1, reply(ids[1], 0, error=True))])  # NODE_UNAVAILABLE, src 0
    out, ignored = run(grid, clock, nodes=(1,))
    assert out[1][0].has_error() and not ignored


def test_refused_pushes_are_unavailable_without_waiting():
    clock = Clock()
    grid = ScriptedGrid(clock, lambda ids: [], refuse={1, 2})
    out, _ = run(grid, clock)
    assert all(isinstance(out[n][0], OrgUnavailable) for n in (1, 2))
    assert not grid.pulls and not clock.sleeps


def test_done_stops_waiting_early():
    clock = Clock()
    grid = ScriptedGrid(clock, lambda ids: [(0.1, reply(ids[1], 1))])
    out, _ = run(grid, clock, timeout_s=10.0, done=lambda got: 1 in got)
    assert isinstance(out[2][0], TransportTimeout) and clock.now - 100.0 < 1.0


# ------------------------------------------------------------------------------------------------ settings


def test_reply_poll_setting():
    assert read_settings({"config-path": "c.yaml"}, environ={}).reply_poll_s == REPLY_POLL_S
    assert read_settings({"config-path": "c.yaml", "reply-poll": 0.05}, environ={}).reply_poll_s == 0.05
    for bad in (0, -1.0, 11.0, float("nan")):
        with pytest.raises(SettingsError, match="reply-poll"):
            read_settings({"config-path": "c.yaml", "reply-poll": bad}, environ={})
    with pytest.raises(SettingsError, match="reply-poll"):
        read_settings({"config-path": "c.yaml", "reply-poll": "fast"}, environ={})
    settings = read_settings({"config-path": "c.yaml", "reply-poll": 0.3}, environ={})
    assert to_run_config(settings)["reply-poll"] == 0.3


def test_pyproject_declares_every_run_config_key():
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    settings = read_settings({"config-path": "c.yaml"}, environ={})
    assert set(to_run_config(settings)) == set(declared)  # flwr rejects run-config keys not declared there
    assert declared["reply-poll"] == REPLY_POLL_S


def test_harness_sets_a_short_superexec_poll_unless_the_environment_does(tmp_path, monkeypatch):
    key = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"
    monkeypatch.delenv(key, raising=False)
    assert Deployment(tmp_path).env("supernode-a")[key] == FAST_POLL_ENV[key] == "0.1"
    monkeypatch.setenv(key, "0.5")
    assert Deployment(tmp_path).env("supernode-a")[key] == "0.5"  # the user's setting wins
    assert Deployment(tmp_path, extra_env={key: "1.0"}).env("supernode-a")[key] == "1.0"  # the bench's wins
    assert 0.01 <= float(FAST_POLL_ENV[key]) <= 60.0  # flwr 1.42's accepted range


# ------------------------------------------------------------------------------------------------ timeline

LOG = """\
\x1b[92mINFO \x1b[0m2026-12-01 09:50:22,499:
INFO 2026-12-01 09:50:22,500:      Receiving: query.health message (ID: aa11)
INFO 2026-12-01 09:50:22,523:      Received successfully
DEBUG 2026-12-01 09:50:23,427:     Runtime.AcquireTask
INFO:     127.0.0.1:59602 - "POST /v1/runtime/acquire-task HTTP/1.1" 200 OK
INFO 2026-12-01 09:50:24,063:      Start `flwr-clientapp` process
DEBUG 2026-12-01 09:50:24,161:     [flwr-clientapp] Start `ClientApp` Loading.
DEBUG 2026-12-01 09:50:24,201:     Runtime.PushMessages
INFO 2026-12-01 09:50:24,523:      Sending: query.health message (ID: bb22)
INFO 2026-12-01 09:50:24,536:      Sent successfully
DEBUG 2026-12-01 09:50:25,433:     Runtime.AcquireTask
\x1b[92mINFO \x1b[0m2026-12-01 09:50:27,544:      Receiving: train message (ID: cc33)
INFO 2026-12-01 09:50:27,556:      Received successfully
DEBUG 2026-12-01 09:50:28,446:     Runtime.AcquireTask
INFO 2026-12-01 09:50:29,341:      Start `flwr-clientapp` process
DEBUG 2026-12-01 09:50:29,362:     Runtime.AcquireTask
DEBUG 2026-12-01 09:50:29,478:     [flwr-clientapp] Start `ClientApp` Loading.
DEBUG 2026-12-01 09:50:29,582:     Runtime.PushMessages
INFO 2026-12-01 09:50:29,900:      Sending: train message (ID: dd44)
INFO 2026-12-01 09:50:29,910:      Sent successfully
INFO 2026-12-01 09:50:32,920:      Receiving: query.generate message (ID: ee55)
INFO 2026-12-01 09:50:32,930:      Received successfully
"""


def test_timeline_splits_a_message_cycle_into_consecutive_pieces():
    messages = deploy_timeline.parse(LOG)
    assert [m["type"] for m in messages] == ["query.health", "train", "query.generate"]
    rows = deploy_timeline.pieces(messages)  # health is not a round message; the last one is incomplete
    assert len(rows) == 1
    row = rows[0]
    expect = {"idle": 3.008, "receive": 0.012, "superexec_poll": 0.890, "clientapp_start": 0.895,
              "fab_install": 0.137, "app": 0.104, "reply_poll": 0.318, "send": 0.010}
    for piece, seconds in expect.items():
        assert row[piece] == pytest.approx(seconds, abs=1e-6), piece
    assert row["cycle"] == pytest.approx(sum(expect.values()))
    summary = deploy_timeline.timeline([LOG, LOG])
    assert summary["messages"] == 2 and summary["idle"] == pytest.approx(3.008, abs=1e-6)
    assert summary["idle_se"] == 0.0  # two identical messages
    assert deploy_timeline.timeline([""]) == {"messages": 0.0}


# ------------------------------------------------------------------------------------------------ ClientApp


def test_the_clientapp_module_does_not_import_torch_or_the_run_config():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = (
        "import sys, client.app; "
        "bad = [m for m in ('torch', 'transformers', 'hacrl_fed.config') if m in sys.modules]; "
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_bench_prints_one_breakdown_column_per_deployment_run():
    from hacrl_tools.bench.system import format_timelines, parse_variant

    summary = deploy_timeline.timeline([LOG])
    runs = [
        {"task_poll_s": 1.0, "reply_poll_s": 0.2, "timeline": summary, "fixed_cost_per_round_s": 10.0,
         "clientapp_messages_per_round": 4, "per_org": {"a": {}, "b": {}}},
        {"task_poll_s": 0.1, "reply_poll_s": 0.1, "timeline": {"messages": 0.0}},  # no timeline: left out
    ]
    lines = format_timelines(runs)
    assert "task poll 1.00 s, reply poll 0.20 s" in lines[2] and "0.10 s" not in lines[2]
    assert any(line.startswith("| superexec_poll | 0.890 ± 0.000 |") for line in lines)
    assert any(line.startswith("| fixed cost / message | 5.00 |") for line in lines)  # 2 messages per org, in turn
    assert format_timelines([runs[1]]) == []
    assert parse_variant("default") == (None, None) and parse_variant("1.0/default") == (1.0, None)


def test_the_transport_keeps_a_running_count_of_ignored_replies():
    from hacrl_fed.flower.transport import FlowerRemoteError, FlowerTransport

    clock = Clock()  # replies due at once: the first pull has them all, nothing sleeps

    def script(ids):
        err = reply(ids[1], 0, error=True)
        err.error = SimpleNamespace(code=5, reason="node unavailable")
        return [(0.0, reply("stray", 1)), (0.0, reply(ids[1], 2)), (0.0, err)]

    transport = FlowerTransport(ScriptedGrid(clock, script, loose=True), {1: "a"})
    for call in (1, 2):
        out = transport.health(["a"], timeout_s=5.0)
        assert isinstance(out["a"], FlowerRemoteError) and out["a"].failure_cause == "unreachable"
        assert transport.ignored_replies == {"unknown": call, "wrong_node": call}
