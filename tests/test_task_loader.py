"""Tasks and reward functions from outside hacrl_fed (hacrl_fed.tasks.loader) with the example package in
examples/my_task: by import path and by a ``hacrl_fed.tasks`` entry point (a temporary dist-info on sys.path, as
``pip install ./examples/my_task`` would write), bad paths failing at start-up with one line and exit 2, and a
federation over each transport."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hacrl_fed.tasks import TASKS, get_task
from hacrl_fed.tasks.loader import ENTRY_POINT_GROUP, RewardFn

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "my_task"
GSM8K = str(ROOT / "tests" / "data" / "gsm8k_sample.jsonl")


@pytest.fixture
def example_on_path(monkeypatch):
    """The example package importable here and in subprocesses (as after ``pip install``), and unloaded after."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(EXAMPLE), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    yield
    for name in [m for m in sys.modules if m == "my_task" or m.startswith("my_task.")]:
        del sys.modules[name]


@pytest.fixture
def entry_point(tmp_path, monkeypatch, example_on_path):
    """A dist-info with an ``entry_points.txt`` registering ``add-small`` (what installing the example writes)."""
    site = tmp_path / "site"
    info = site / "my_task-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-task\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nadd-small = my_task.task:AddTask\n"
                                           "broken = my_task.nowhere:Task\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ["PYTHONPATH"]]))
    return "add-small"


def test_import_path_builds_the_example_task(example_on_path):
    task = get_task("my_task.task:AddTask", {"max_operand": 9}, seed=1)
    assert task.name == "my_task.task:AddTask" and "my_task.task:AddTask" not in TASKS
    train, test = task.prompts("train", range(50)), task.prompts("test", range(50))
    assert {p.messages[-1].content for p in train}.isdisjoint({p.messages[-1].content for p in test})
    a, b = train[0].messages[-1].content.rstrip("=").split("+")
    assert train[0].reference == str(int(a) + int(b))
    assert task.verify(f"it is {train[0].reference}", train[0].reference) == 1.0
    assert task.verify("it is -1", train[0].reference) == 0.0
    assert task.verify(task.sft_target("train", 0), train[0].reference) == 1.0
    with pytest.raises(ValueError, match=r"task\.params\.max_operand"):
        get_task("my_task.task:AddTask", {"max_operand": 1})


def test_entry_point_builds_the_example_task(entry_point):
    task = get_task(entry_point, seed=2)
    assert task.name == "add-small" and type(task).__module__ == "my_task.task"
    with pytest.raises(ValueError, match=r"task\.name: unknown task 'nope'.*'add-small'"):
        get_task("nope")
    with pytest.raises(ValueError, match=r"^task\.name: entry point 'broken' .*does not load.*my_task\.nowhere"):
        get_task("broken")


@pytest.mark.parametrize(
    "name, match",
    [
        ("nope_pkg.mod:Task", r"cannot import module 'nope_pkg\.mod'"),
        ("my_task.task:Missing", r"module 'my_task\.task' has no attribute 'Missing'"),
        ("my_task.rewards:last_number_matches", r"is a function object, not a subclass of hacrl_fed\.tasks\.Task"),
        ("my_task.task:AddParams", r"is the class AddParams, not a subclass"),
        ("hacrl_fed.tasks.base:Task", r"is abstract \(does not implement prompts, size, verify\)"),
        ("a:b:c", r"not an import path"),
        ("not-registered", r"unknown task 'not-registered'"),
    ],
)
def test_bad_task_names_are_one_line_naming_the_field(example_on_path, name, match):
    with pytest.raises(ValueError, match=r"^task\.name: ") as info:
        get_task(name)
    assert "\n" not in str(info.value)
    assert re.search(match, str(info.value)), str(info.value)


def test_reward_fn_replaces_the_builtin_checker(example_on_path):
    default = get_task("jsonl", {"path": GSM8K})
    own = get_task("jsonl", {"path": GSM8K, "reward_fn": "my_task.rewards:last_number_matches"})
    # "\\boxed{7} ... 8": the built-in checker takes the boxed answer, the lab's function the last number
    assert default.verify("\\boxed{7} then 8", "7") == 1.0 and own.verify("\\boxed{7} then 8", "7") == 0.0
    assert own.verify("\\boxed{7} then 8", "8") == 1.0
    assert own.size("train") == default.size("train")  # data and splits unchanged


@pytest.mark.parametrize(
    "spec, match",
    [
        ("my_task.rewards:_NUMBER", r"is a Pattern object, not a function"),
        ("json:dumps", r"cannot be called as fn\(response, reference\)"),
        ("my_task.task:AddTask", r"is the class AddTask, not a function"),
        ("my_task.rewards:nothing", r"has no attribute 'nothing'"),
        ("rewards_nowhere:fn", r"cannot import module 'rewards_nowhere'"),
        ("just_a_name", r"not an import path"),
    ],
)
def test_bad_reward_fn_names_the_field(example_on_path, spec, match):
    with pytest.raises(ValueError, match=r"^task\.params\.reward_fn: .*" + match):
        get_task("jsonl", {"path": GSM8K, "reward_fn": spec})


def test_reward_fn_guard_never_raises_and_clips():
    calls = []

    def flaky(response, reference):
        calls.append(response)
        if response == "boom":
            raise ZeroDivisionError("boom")
        return {"big": 7.0, "neg": -2, "nan": float("nan"), "str": "1", "ok": 0.25, "yes": True}[response]

    guarded = RewardFn(flaky, "x:flaky")
    got = {r: guarded(r, "") for r in ("boom", "big", "neg", "nan", "str", "ok", "yes")}
    assert got == {"boom": 0.0, "big": 1.0, "neg": 0.0, "nan": 0.0, "str": 0.0, "ok": 0.25, "yes": 1.0}
    assert guarded.errors == 3 and len(calls) == 7  # boom, nan, str


def _config(tmp_path: Path, task_name: str) -> Path:
    data = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())
    data["task"] = {"name": task_name, "params": {"max_operand": 9}, "eval_size": 4}
    data["federation"].update(rounds=1, eval_every=1)
    data["run_dir"] = str(tmp_path / "runs")
    path = tmp_path / "byo.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hacrl_fed.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_bad_task_path_exits_2_with_one_line_on_the_coordinator_and_the_workers(tmp_path, example_on_path):
    config = _config(tmp_path, "my_task.task:Missing")
    for transport in ("inprocess", "grpc"):
        proc = _cli("run", str(config), "--transport", transport, "--run-dir", str(tmp_path / transport),
                    "--no-progress")
        assert proc.returncode == 2, proc.stderr[-2000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert "task.name: module 'my_task.task' has no attribute 'Missing'" in last, last
    worker = _cli("worker", "--config", str(config), "--org", "acme", "--listen", f"unix:{tmp_path}/w.sock")
    assert worker.returncode == 2 and "task.name: module 'my_task.task'" in worker.stderr.strip().splitlines()[-1]
    sim = _cli("simulate", str(config), "--run-dir", str(tmp_path / "sim"))
    assert sim.returncode == 2 and "task.name: module 'my_task.task'" in sim.stderr.strip().splitlines()[-1]


def _accuracies(run_dir: Path) -> dict[str, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1]
    last = records[-1]
    assert last["round/acme/rollouts_accepted"] > 0 and last["round/globex/rollouts_accepted"] > 0
    return {k: v for k, v in last.items() if k.endswith("/accuracy")}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_outside_task_runs_a_federation_over_every_transport(tmp_path, entry_point):
    from hacrl_fed.flower.simulation import simulate

    config = _config(tmp_path, "my_task.task:AddTask")
    proc = _cli("run", str(config), "--run-dir", str(tmp_path / "inproc"), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = _accuracies(tmp_path / "inproc")
    assert ref
    proc = _cli("run", str(config), "--transport", "grpc", "--run-dir", str(tmp_path / "grpc"), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _accuracies(tmp_path / "grpc") == pytest.approx(ref)
    simulate(config, [], run_dir=tmp_path / "flower")
    assert _accuracies(tmp_path / "flower") == pytest.approx(ref)
    # the entry-point name: same class, found through the installed distribution's metadata (grpc workers too)
    (tmp_path / "ep").mkdir()
    proc = _cli("run", str(_config(tmp_path / "ep", entry_point)), "--transport", "grpc",
                "--run-dir", str(tmp_path / "ep-run"), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _accuracies(tmp_path / "ep-run") == pytest.approx(ref)
