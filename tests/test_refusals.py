"""Refusals a user sees (issue 44, item 3): a combination of settings a worker refuses is refused by the coordinator
before any worker starts, with one line naming the field and exit code 2 (:mod:`hacrl_fed.refusals`,
:func:`hacrl_fed.preflight.check_settings`); a worker (or a rank of one) that fails at start is reported with its
own first error line, not the launcher's tail (:mod:`hacrl_fed.coordinator.launcher`)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

import hacrl_fed.worker
from hacrl_fed import cli
from hacrl_fed.config import ConfigError, load_config
from hacrl_fed.coordinator import launcher
from hacrl_fed.coordinator.launcher import WorkerBuildError, WorkerProcesses, WorkerStartError
from hacrl_fed.models.catalog import resolve_zoo
from hacrl_fed.preflight import check_settings
from hacrl_fed.refusals import check_precision, check_sharded_org, check_vllm_kwargs, require_peft
from hacrl_fed.trainer import LocalTrainer

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"
SHARDED = {"sharding": {"ranks": 2, "backend": "gloo"}}
UNGUARDED = {"trainer": {"outcome_guard": {"enabled": False}}}
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="refused only where CUDA is missing")


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def _org(*parts: dict) -> dict:
    out: dict = {}
    for part in parts:
        out = _merge(out, part)
    return out


# case: ({org index: what that org sets}, the --set overrides of the run, the field the one line names)
REFUSED = {
    "guard_on_a_sharded_org": ({0: SHARDED}, [], "orgs[0].trainer.outcome_guard.enabled"),
    "vllm_on_a_sharded_org": (
        {0: _org(SHARDED, UNGUARDED, {"generation": {"engine": "vllm"}})}, [], "orgs[0].generation.engine"
    ),
    "bf16_master_on_a_sharded_org": (
        {0: _org(SHARDED, UNGUARDED)}, ["trainer.precision=bf16-master"], "orgs[0].trainer.precision"
    ),
    "bf16_master_on_float32_weights": (
        {1: {"model": {"dtype": "float32"}, "trainer": {"precision": "bf16-master"}}}, [], "orgs[1].trainer.precision"
    ),
    "bf16_autocast_on_bfloat16_weights": (
        {0: {"model": {"dtype": "bfloat16"}}}, ["trainer.precision=bf16-autocast"], "orgs[0].trainer.precision"
    ),
    "vllm_kwargs_repeating_the_engine": (
        {1: {"generation": {"engine": "vllm", "vllm_kwargs": {"seed": 3}}}}, [], "orgs[1].generation.vllm_kwargs"
    ),
    "cuda_device_without_cuda": ({1: {"model": {"device": "cuda"}}}, [], "orgs[1].model.device"),
    "nccl_without_cuda": (
        {0: _org(SHARDED, UNGUARDED, {"sharding": {"backend": "nccl"}})}, [], "orgs[0].sharding.backend"
    ),
}
NEEDS_CPU = {"cuda_device_without_cuda", "nccl_without_cuda"}


def _config(tmp_path: Path, orgs: dict[int, dict]) -> Path:
    data = yaml.safe_load(SMOKE.read_text())
    for index, extra in orgs.items():
        data["orgs"][index] = _merge(data["orgs"][index], extra)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def no_worker_starts(monkeypatch):
    """Fail the test if any worker is built in process or any worker process is started."""

    def never(*args, **kwargs):
        raise AssertionError("a worker was started before the refusal")

    monkeypatch.setattr(hacrl_fed.worker, "build_worker", never)
    monkeypatch.setattr(launcher.WorkerProcesses, "start", never)


@pytest.mark.parametrize("transport", ["inprocess", "grpc"])
@pytest.mark.parametrize("case", [pytest.param(k, marks=CPU_ONLY) if k in NEEDS_CPU else k for k in REFUSED])
def test_a_refused_combination_fails_before_any_worker_starts_naming_the_field(
    tmp_path, capsys, no_worker_starts, case, transport
):
    orgs, sets, field = REFUSED[case]
    if transport == "inprocess" and "sharding" in orgs.get(0, {}):
        field = "orgs[0].sharding.ranks"  # in process a sharded org cannot run at all: refused first, naming that
    run_dir = tmp_path / "run"
    argv = ["run", str(_config(tmp_path, orgs)), "--transport", transport, "--run-dir", str(run_dir), "--no-progress"]
    rc = cli.main(argv + (["--set", *sets] if sets else []))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("hacrl-fed run: error: ") and field in err[0], err
    assert not run_dir.exists()  # no run dir, so no logs/<org>.log and no worker socket


def test_the_refusal_is_the_workers_own_rule(tmp_path):
    """The worker refuses with the very function the preflight calls: the same line either way."""
    cfg = load_config(_config(tmp_path, {0: SHARDED}))
    with pytest.raises(ConfigError) as worker_side:
        check_sharded_org(cfg, "acme")
    with pytest.raises(ConfigError) as coordinator_side:
        check_settings(cfg)
    assert str(worker_side.value) == str(coordinator_side.value)
    assert "set orgs[0].trainer.outcome_guard.enabled: false" in str(worker_side.value)
    check_settings(load_config(SMOKE))  # the smoke config itself is fine, and so is a sharded org unguarded
    check_settings(load_config(_config(tmp_path, {0: _org(SHARDED, UNGUARDED)})))
    with pytest.raises(ConfigError, match=r"trainer\.precision=bf16-autocast .* are \['bfloat16'\]"):
        LocalTrainer._master_weights([torch.zeros(2, dtype=torch.bfloat16)], "bf16-autocast")
    with pytest.raises(ConfigError, match=r"x\.precision=bf16-master .* are \['float32'\]"):
        check_precision("bf16-master", ["float32"], "x.precision")
    check_precision("model", ["float16", "bfloat16"])
    with pytest.raises(ConfigError, match=r"g\.vllm_kwargs may not set \['seed'\]"):
        check_vllm_kwargs({"seed": 1, "swap_space": 4}, {"seed": 0, "model": "m"}, "g.vllm_kwargs")
    check_vllm_kwargs({"swap_space": 4}, {"seed": 0})


def test_lora_without_peft_is_refused_naming_the_field(monkeypatch):
    check_settings(load_config(SMOKE, overrides=["trainer.lora.enabled=true"]))  # peft is installed here
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"orgs\[0\]\.trainer\.lora\.enabled=true needs peft"):
        check_settings(load_config(SMOKE, overrides=["trainer.lora.enabled=true"]))
    with pytest.raises(ConfigError, match=r"^trainer\.lora\.enabled=true needs peft"):
        require_peft()


# ------------------------------------------------------------------------------ a worker that fails at start

_TORCHRUN_TAIL = """\
W1207 14:03:11.000000 1 torch/distributed/elastic/multiprocessing/api.py:900] Sending process 2 closing signal SIGTERM
E1207 14:03:12.000000 1 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: 1) local_rank: 0
Traceback (most recent call last):
  File "torch/distributed/run.py", line 905, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
hacrl_fed.cli FAILED
------------------------------------------------------------
Failures:
[1]:
  exitcode  : -15 (pid: 3)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 3
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  exitcode  : 2 (pid: 2)
============================================================
"""


def _launch(tmp_path, output: str, code: int):
    """A stand-in worker command that prints ``output`` and exits ``code`` (ignoring the worker flags)."""
    script = tmp_path / "worker.py"
    script.write_text(f"import sys\nsys.stdout.write({output!r})\nsys.exit({code})\n")
    config = tmp_path / "run.yaml"
    config.write_text(SMOKE.read_text())
    return WorkerProcesses(config, ["acme"], run_dir=tmp_path / "run", command=[sys.executable, str(script)],
                           ready_timeout_s=60)


@pytest.mark.parametrize("own,code,kind", [
    ("hacrl-fed worker: error: org 'acme': rank 1 died at start (exit code 2)", 1, WorkerBuildError),
    ("hacrl-fed worker: orgs[0].sharding.ranks=2 (org 'acme') but torchrun started 3 processes", 1, WorkerBuildError),
    ("hacrl-fed worker: failed: RuntimeError: out of disk", 1, WorkerStartError),
    ("hacrl-fed worker: interrupted", 1, WorkerStartError),
    ("ValueError: the tokenizer is broken", 1, WorkerStartError),
])
def test_a_worker_failing_under_torchrun_is_reported_with_its_own_line(tmp_path, own, code, kind):
    output = ("INFO loading the model\nTraceback (most recent call last):\n  File \"x.py\", line 1\n" if
              own.startswith("ValueError") else "INFO loading the model\n") + own + "\n" + _TORCHRUN_TAIL
    procs = _launch(tmp_path, output, code)
    with pytest.raises(WorkerStartError) as raised:
        procs.start()
    text = str(raised.value)
    assert type(raised.value) is kind and own in text and len(text.splitlines()) == 1, text
    assert "SIGTERM" not in text and "exitcode" not in text and "ChildFailedError" not in text
    assert own in (tmp_path / "run" / "logs" / "acme.log").read_text()  # the whole output stays in its log


def _corrupt_model(tmp_path) -> Path:
    """A copy of micro-qwen-char whose weights file is garbage: its config and tokenizer load (the preflight
    passes), its weights do not (the worker fails at start)."""
    model = tmp_path / "corrupt"
    shutil.copytree(resolve_zoo("micro-qwen-char"), model)
    (model / "model.safetensors").write_bytes(b"not a safetensors file" * 64)
    return model


def _run_corrupt(tmp_path, capsys, *org: dict) -> tuple[int, list[str]]:
    """``hacrl-fed run --transport grpc`` of acme alone on a corrupt model: its exit code and its stderr lines."""
    config = _config(tmp_path, {0: _org({"model": {"zoo": None, "path": str(_corrupt_model(tmp_path))}}, *org)})
    data = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**data, "orgs": data["orgs"][:1]}))  # one worker process: faster
    rc = cli.main(["run", str(config), "--transport", "grpc", "--run-dir", str(tmp_path / "run"), "--no-progress",
                   "--ready-timeout-s", "300", "--set", "federation.rounds=1"])
    return rc, capsys.readouterr().err.strip().splitlines()


def _the_line(err: list[str]) -> str:
    """The command's one line of stderr (the others are the run's log lines); nothing of torch's launcher."""
    own = [line for line in err if line.startswith("hacrl-fed run: ")]
    assert len(own) == 1, err
    assert not any(word in line for line in err for word in ("SIGTERM", "exitcode", "ChildFailedError")), err
    return own[0]


def test_a_grpc_worker_failing_at_start_shows_its_own_error_line(tmp_path, capsys):
    rc, err = _run_corrupt(tmp_path, capsys)
    line = _the_line(err)
    assert rc == 2 and "worker 'acme' refused to start: hacrl-fed worker: error: org 'acme': model.path: could not " \
        "load model" in line and "header too large" in line, line


@pytest.mark.slow
def test_a_rank_failing_at_start_shows_the_workers_line_not_torchruns_block(tmp_path, capsys):
    rc, err = _run_corrupt(tmp_path, capsys, SHARDED, UNGUARDED)
    line = _the_line(err)
    assert rc == 2 and "worker 'acme' refused to start: hacrl-fed worker: error: org 'acme': model.path: could not " \
        "load model" in line, line
    assert "ChildFailedError" in (tmp_path / "run" / "logs" / "acme.log").read_text()  # what used to be shown
