"""Shared test setup: an offline, hermetic environment, capped threads, seeding, and hardware-gated markers.

The environment is prepared in :func:`pytest_configure`, i.e. before any test module is imported, because
``huggingface_hub`` and ``flwr`` read their settings at import time.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

# Offline and quiet: no hub downloads, no Flower telemetry / update checks / per-run env installs. One definition
# (also used by the deployment harness and the simulation; the Makefile and .ci/run keep copies that
# tests/test_lifecycle.py checks). Importing it is cheap: no torch, no flwr.
from hacrl_fed.lifecycle import OFFLINE_ENV

TORCH_THREADS = 1

_saved_env: dict[str, str | None] = {}
_session_dir: Path | None = None


def _set_env(name: str, value: str, *, override: bool) -> None:
    if name not in _saved_env:
        _saved_env[name] = os.environ.get(name)
    if override or name not in os.environ:
        os.environ[name] = value


def pytest_configure(config: pytest.Config) -> None:
    """Offline env vars (kept if already set), and private Flower and Hugging Face homes for the session."""
    global _session_dir
    for name, value in OFFLINE_ENV.items():
        _set_env(name, value, override=False)
    _session_dir = Path(tempfile.mkdtemp(prefix="hacrl-fed-tests-"))
    # Always private: tests must never read or write the user's ~/.flwr or Hugging Face cache.
    for name, sub in (("FLWR_HOME", "flwr"), ("HF_HOME", "hf")):
        (_session_dir / sub).mkdir()
        _set_env(name, str(_session_dir / sub), override=True)
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(TORCH_THREADS)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Restore the caller's environment and delete the session's private homes."""
    for name, old in _saved_env.items():
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
    _saved_env.clear()
    if _session_dir is not None:
        shutil.rmtree(_session_dir, ignore_errors=True)


def seed_everything(seed: int = 0) -> int:
    """Seed Python's ``random``, NumPy's global RNG and torch (CPU and CUDA) with ``seed``; returns it."""
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed % 2**32)
    try:
        import torch
    except ImportError:
        pass
    else:
        torch.manual_seed(seed)  # also seeds every CUDA device
    return seed


@pytest.fixture
def seeded() -> Callable[[int], int]:
    """Seeds every RNG with 0 before the test; call the returned function to reseed (``seeded(7)``)."""
    seed_everything(0)
    return seed_everything


def _vllm_skip_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (install the 'vllm' extra in a CUDA environment)"
    try:
        importlib.import_module("vllm")
    except Exception as err:  # an installed but broken vllm (e.g. no CUDA) must skip, not error
        return f"vllm is installed but not importable: {type(err).__name__}: {err}"
    return None


def _gpu_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


PROTOC_TOOLS = "1.70.0"  # scripts/gen_proto.sh's TOOLS_VERSION


def _protoc_skip_reason() -> str | None:
    """None when scripts/gen_proto.sh can run offline (its venv holds the pinned grpcio-tools) or may build it."""
    if os.environ.get("HACRL_PROTOC_BUILD") == "1":
        return None
    root = Path(__file__).resolve().parents[1]
    venv = Path(os.environ.get("HACRL_PROTOC_VENV", root / ".cache" / "protoc-venv"))
    python = venv / "bin" / "python"
    if python.exists():
        import subprocess

        code = "import importlib.metadata as m; print(m.version('grpcio-tools'))"
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True).stdout.strip()
        if out == PROTOC_TOOLS:
            return None
    return (f"no grpcio-tools=={PROTOC_TOOLS} in {venv}: `make proto` builds it once (needs the package index), or "
            "set HACRL_PROTOC_BUILD=1 to let the test build it")


_GATES: dict[str, Callable[[], str | None]] = {
    "vllm": _vllm_skip_reason,
    "gpu": _gpu_skip_reason,
    "protoc": _protoc_skip_reason,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``vllm`` / ``gpu`` / ``protoc`` when that hardware or package is missing (checked once,
    lazily)."""
    reasons: dict[str, str | None] = {}
    for item in items:
        for marker, probe in _GATES.items():
            if item.get_closest_marker(marker) is None:
                continue
            if marker not in reasons:
                reasons[marker] = probe()
            if reasons[marker] is not None:
                item.add_marker(pytest.mark.skip(reason=f"[{marker}] {reasons[marker]}"))


@pytest.fixture(scope="module")
def real_model_lock():
    """Held by a test module that loads the real checkpoints, for the whole module: under ``pytest -n`` (``make
    test``) only one such module runs at a time, so their peaks (up to ~16 GB of RSS) never add up; a script that loads
    them takes the same lock (`flock /tmp/hacrl-real.lock ...`, scripts/real_task_probe.py)."""
    from hacrl_fed.models.real import file_lock

    with file_lock(Path(tempfile.gettempdir()) / "hacrl-real.lock"):
        yield
