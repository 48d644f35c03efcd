"""Progress where a run executes: the worker's start-up line (org, model, size, device, dtype) and one log line per
call; the coordinator's per-round line and eval table are in test_coordinator.py, the ServerApp's in ``flwr log``
and deploy-local's stream in test_deployment.py."""

from __future__ import annotations

import io
import logging
import re
import sys

from hacrl_fed.config import load_config
from hacrl_fed.types import EvalRequest, RoundPlan, SamplingParams, StepRequest, TrainRequest
from hacrl_fed.wire.grpc_client import GrpcWorkerClient
from hacrl_fed.wire.grpc_server import describe_worker, serve_worker
from hacrl_fed.worker import build_worker
from helpers_fake_workers import FakeTask, FakeWorker

SERVER_LOG = "hacrl_fed.wire.grpc_server"


def test_a_worker_says_what_it_serves(tmp_path):
    cfg = load_config({"name": "p", "orgs": [{"id": "acme", "model": {"zoo": "micro-qwen-char", "device": "cpu"}}],
                       "security": {"signing": False}})
    worker = build_worker(cfg, "acme", run_dir=tmp_path)
    text = describe_worker(worker)
    n = sum(p.numel() for p in worker.model.parameters())
    assert re.fullmatch(rf"org acme, model zoo:micro-qwen-char, {n / 1e6:.2f} M parameters, device cpu, "
                        rf"dtype float32, engine hf, checkpoints in {re.escape(str(tmp_path))}/orgs/acme/checkpoints",
                        text), text
    assert describe_worker(FakeWorker("a")) == "org a"  # a stand-in says what it can


def test_one_log_line_per_call_with_rpc_round_and_seconds(caplog):
    server = serve_worker(FakeWorker("a", 0.5), "127.0.0.1:0")
    prompts = tuple(FakeTask().prompts("train", [1, 2]))
    try:
        with caplog.at_level(logging.DEBUG, logger=SERVER_LOG), GrpcWorkerClient(server.address, timeout_s=10) as c:
            c.health()
            c.generate(RoundPlan("r", 3, "fake", prompts, SamplingParams(num_samples=2)))
            c.evaluate(EvalRequest("r", 3, "fake", prompts, max_new_tokens=4))
            c.checkpoint(3)
            c.step(StepRequest(train=TrainRequest("r", 3, "a", prompts, (), {"a": 1.0}),
                               plan=RoundPlan("r", 4, "fake", prompts, SamplingParams(num_samples=2))))
            c.step(StepRequest(train=TrainRequest("r", 4, "a", prompts, (), {"a": 1.0}),
                               evaluate=EvalRequest("r", 4, "fake", prompts, max_new_tokens=4), checkpoint=4))
    finally:
        server.stop(0)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == SERVER_LOG]
    info = [m for level, m in lines if level == "INFO"]
    assert [m.split(" ok in ")[0] for m in info] == ["Generate round 3", "Evaluate round 3", "Checkpoint round 3",
                                                     "Step train round 3 plan round 4",
                                                     "Step train round 4 + evaluate + checkpoint"]
    assert all(re.search(r" ok in \d+\.\d\d s$", m) for m in info)
    assert any(level == "DEBUG" and m.startswith("Health ok in") for level, m in lines)  # polled: debug only


# ------------------------------------------------------------------------------------------- the per-round bar


class _Terminal(io.StringIO):
    """A stand-in terminal: a text stream that says it is a tty."""

    def isatty(self) -> bool:
        return True


def _screen(text: str) -> list[str]:
    """The lines a terminal shows for ``text``: ``\\r`` returns to column 0, later characters overwrite earlier ones."""
    lines, cur, col = [], [], 0
    for ch in text:
        if ch == "\n":
            lines.append("".join(cur).rstrip())
            cur, col = [], 0
        elif ch == "\r":
            col = 0
        else:
            if col < len(cur):
                cur[col] = ch
            else:
                cur.append(ch)
            col += 1
    lines.append("".join(cur).rstrip())
    return [line for line in lines if line]


def _run_with_progress(tmp_path, monkeypatch, stream, rounds=4):
    from hacrl_fed.coordinator.inprocess import InProcessTransport
    from hacrl_fed.lifecycle import Run, setup_logging
    from helpers_fake_workers import fake_config

    class NoisyWorker(FakeWorker):  # while a round runs: another library's log record, a print to each stream
        def train(self, request):
            logging.getLogger("some.library").warning("training round %d", request.round)
            print(f"(pid=1) worker says {request.round}", file=sys.stderr)  # as Ray forwards a worker's output
            print(f"printed {request.round}", end="")  # in two writes: one line
            print()
            return super().train(request)

    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(sys, "stdout", stream)  # a terminal shows both
    setup_logging("INFO")
    library = logging.StreamHandler(stream)
    library.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    library.addFilter(lambda record: record.name == "some.library")
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [*root.handlers, library])
    cfg = fake_config(orgs=("a",), rounds=rounds, eval_every=0)
    transport = InProcessTransport({"a": NoisyWorker("a", 0.5)})
    with Run(cfg, tmp_path / "r", transport="inprocess", progress=True) as run:
        run.execute(transport, task=FakeTask())
    assert sys.stderr is stream and sys.stdout is stream  # given back
    return stream.getvalue()


def test_on_a_terminal_log_lines_print_above_the_bar(tmp_path, monkeypatch):
    text = _run_with_progress(tmp_path, monkeypatch, _Terminal())
    screen = _screen(text)
    assert any(line.startswith("rounds: 100%") for line in screen), screen  # the bar was drawn, to the end
    rounds = [line for line in screen if "INFO hacrl_fed.coordinator.loop: round " in line]
    assert len(rounds) == 4, screen
    assert "\r" in text.split("round 2/4")[0]  # the bar was on screen before round 2's line, and cleared for it
    for line in screen:
        assert not ("rounds:" in line and ("INFO " in line or "WARNING " in line)), line
    assert sum(line.startswith("WARNING some.library: training round") for line in screen) == 4
    assert [line for line in screen if "worker says" in line] == [f"(pid=1) worker says {t}" for t in range(1, 5)]
    assert [line for line in screen if "printed" in line] == [f"printed {t}" for t in range(1, 5)]


def test_elsewhere_plain_lines_and_no_bar(tmp_path, monkeypatch):
    text = _run_with_progress(tmp_path, monkeypatch, io.StringIO())  # a pipe or a file: not a terminal
    assert "rounds:" not in text and "\r" not in text
    lines = text.splitlines()
    assert sum(" round " in line and "/4 in " in line for line in lines) == 4
    assert sum(line == f"WARNING some.library: training round {t}" for t in range(1, 5) for line in lines) == 4
    assert sum(line.startswith("(pid=1) worker says") for line in lines) == 4


def test_the_bar_only_on_a_terminal():
    from hacrl_fed.lifecycle import progress_shown

    assert progress_shown(True, _Terminal()) and not progress_shown(False, _Terminal())
    assert not progress_shown(True, io.StringIO()) and not progress_shown(True, object())
    closed = io.StringIO()
    closed.close()  # isatty() raises on a closed stream
    assert not progress_shown(True, closed)


def test_log_handlers_are_given_back_after_the_bar(monkeypatch):
    from tqdm import tqdm

    from hacrl_fed.lifecycle import logs_above

    handler = logging.StreamHandler(io.StringIO())
    logger = logging.getLogger("hacrl_fed.test_progress")
    monkeypatch.setattr(logger, "handlers", [handler])
    bar = tqdm(total=1, file=_Terminal())
    with logs_above(bar, loggers=("hacrl_fed.test_progress",)):
        assert "emit" in vars(handler)
    bar.close()
    assert "emit" not in vars(handler)
