"""Start and stop one ``hacrl-fed worker`` subprocess per org on this machine (for ``hacrl-fed run --transport grpc``).

Each worker listens on ``unix:<run_dir>/sock/<org>.sock`` (the directory is made 0700, the worker makes the socket
0600), or, when that path is too long for a Unix socket, on ``127.0.0.1:0`` (a free loopback TCP port, plaintext:
started with ``--insecure`` and a fresh link secret, ``<run_dir>/sock/<org>.secret`` (0600), passed as
``--secret-file``; :attr:`WorkerProcesses.secrets` gives the secrets to :class:`GrpcTransport`). It logs
stdout+stderr to ``<run_dir>/logs/<org>.log``, and is ready once it prints
``hacrl-fed worker <org> listening on <address>``; that printed address is the one to dial. A worker that exits
before it is ready is reported with its own first error line (its one-line ``hacrl-fed worker: ...`` report, else
the last line of its first traceback: :attr:`_Worker.error_line`), not the tail of the log, which under torch's
launcher is the launcher's own block; a worker that refused its configuration (exit code 2, or a rank's
``hacrl-fed worker: error: ...``) is a :class:`WorkerBuildError`, so ``hacrl-fed run`` exits 2. Stopping sends
SIGTERM to each PID, waits ``grace_s`` and SIGKILLs what is left; it runs on ``close()``, on context-manager exit
and at interpreter exit.

A launcher that is killed (SIGKILL, OOM killer) runs none of that. On Linux each worker is therefore started through
a tiny shim that asks the kernel to SIGTERM it when the launching thread dies (``PR_SET_PDEATHSIG``) and then execs
the worker command, so a killed coordinator leaves no orphan workers holding models or GPU memory (a restart with
``--resume`` starts fresh ones on the same sockets). A launched worker, once stopped, exits without the
interpreter's teardown (:func:`hacrl_fed.cli.worker._exit_launched`), so it is gone within about a second. The
signal and the worker's own poll of its parent pid both act on its main thread; a daemon thread
(:mod:`hacrl_fed.worker.orphan_guard`) ends a worker whose graceful stop has not ended it ``--grace-s`` + 15 s after
its launcher is gone, and writes its stacks. The signal follows the *thread* that called
:meth:`WorkerProcesses.start`: start workers from a thread that lives as long as they should, or pass
``die_with_parent=False``.

The workers on one machine share its cores: each gets ``OMP_NUM_THREADS = max(1, cores // workers)`` (torch's
intra-op threads) unless the environment sets ``OMP_NUM_THREADS`` already (:func:`worker_threads`); a rank of a
sharded worker counts as a worker.

An org with ``orgs[i].sharding.ranks = N > 1`` is started by torch's own launcher,
``python -m torch.distributed.run --standalone --nproc-per-node N -m hacrl_fed.cli worker ...``
(:func:`torchrun_argv`, :mod:`hacrl_fed.sharded`): the PID the launcher holds is torchrun's agent, whose rank 0
prints the ready line; SIGTERM to the agent stops every rank, and the ranks stop by themselves when the agent is
gone.

The workers get no ``--set``: with overrides the launcher writes the resolved config to
``<run_dir>/worker_config.yaml`` and starts the workers from it.

A worker that dies once ready is never silent (:mod:`hacrl_fed.coordinator.worker_deaths`): each worker writes
its phase to ``<run_dir>/logs/<org>.phase`` (:mod:`hacrl_fed.worker.phase`), a watcher thread reaps a worker that
exits while the run goes on, and one line naming the org, the phase it was in and, for a signal, the signal and
its peak RSS against the machine's memory ("killed by SIGKILL ... (likely out of memory: peak RSS X of Y)") is
appended to ``<run_dir>/error.log`` and printed to stderr.
"""

from __future__ import annotations

import atexit
import os
import re
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from hacrl_fed.config import BuildError
from hacrl_fed.coordinator.worker_deaths import DeathWatch, phase_file_of
from hacrl_fed.host import available_cpus
from hacrl_fed.wire.link_secret import create_secret_file
from hacrl_fed.worker.orphan_guard import PARENT_PID_ENV  # hacrl-fed worker stops when its parent is gone
from hacrl_fed.worker.phase import PHASE_FILE_ENV

READY = re.compile(r"^hacrl-fed worker (?P<org>\S+) listening on (?P<address>\S+)\s*$")
# the worker's own one-line report of why it stopped (hacrl_fed.cli.common.run_command, or its usage exit)
OWN_ERROR = re.compile(r"^hacrl-fed worker: ")
# else a traceback's last line; torch's launcher's own (ChildFailedError, after its ranks') is never the cause
EXCEPTION_LINE = re.compile(r"^(?!torch\.distributed\.elastic)[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt): ")
DEFAULT_WORKER_COMMAND = (sys.executable, "-m", "hacrl_fed.cli", "worker")
MAX_UNIX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux (104 on macOS); keep a margin
_TAIL_LINES = 20

# argv: [python, -c, _DIE_WITH_PARENT, <launcher pid>, worker command...]; prctl option 1 = PR_SET_PDEATHSIG
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('hacrl-fed launcher: the launcher exited before this worker started')\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def die_with_parent_argv(argv: list[str]) -> list[str]:
    """``argv`` wrapped in the parent-death shim (see the module docstring); unchanged outside Linux."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


class WorkerStartError(RuntimeError):
    """A worker process exited or stayed silent before it was ready; the message quotes the worker's own first error
    line (:attr:`_Worker.error_line`), else its last log lines."""


class WorkerBuildError(WorkerStartError, BuildError):
    """A worker (or a rank of a sharded one) exited with code 2: it refused its configuration (model, task,
    context...). A BuildError quoting its one error line, so ``hacrl-fed run`` exits 2 too."""


def refused(line: str | None) -> bool:
    """Whether ``line``, the worker's own report (:data:`OWN_ERROR`), says it refused to start (exit code 2: a usage,
    configuration or build-time error) rather than failed (``hacrl-fed worker: failed: ...``, exit code 1)."""
    if line is None or OWN_ERROR.match(line) is None:
        return False
    return not line.startswith(("hacrl-fed worker: failed:", "hacrl-fed worker: interrupted"))


def _build_error(w: _Worker) -> WorkerBuildError:
    line = w.error_line or next((t for t in reversed(w.tail) if t.strip()), "(no output)")
    return WorkerBuildError(f"worker {w.org_id!r} refused to start: {line.strip()}")


def listen_address(run_dir: Path, org_id: str) -> str:
    """``unix:<run_dir>/sock/<org>.sock`` when the absolute path fits a Unix socket, else ``127.0.0.1:0``."""
    path = (run_dir / "sock" / f"{org_id}.sock").absolute()
    return f"unix:{path}" if len(str(path)) <= MAX_UNIX_SOCKET_PATH else "127.0.0.1:0"


def link_args(listen: str, secret_file: Path | None = None) -> list[str]:
    """Flags ``hacrl-fed worker`` needs for ``listen``: none for a unix socket, ``--insecure`` (and the link secret
    file ``--secret-file``) for loopback TCP."""
    if listen.startswith("unix:"):
        return []
    return ["--insecure"] + (["--secret-file", str(secret_file)] if secret_file is not None else [])


def private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) if needed and make it 0700: only this user may reach sockets inside it."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def torchrun_argv(ranks: int, command: Sequence[str]) -> list[str]:
    """``command`` (``[python, -m, hacrl_fed.cli, worker]`` or ``[python, SCRIPT]``) for an org on ``ranks`` ranks:
    ``python -m torch.distributed.run --standalone --nproc-per-node N`` in place of the interpreter, so that
    torch's own launcher starts the ranks (:mod:`hacrl_fed.sharded`); unchanged for one rank."""
    if ranks <= 1:
        return list(command)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *command[1:]]


def org_ranks(config_path: str | Path, overrides: Mapping[str, Any] | Sequence[str]) -> dict[str, int]:
    """``{org: orgs[i].sharding.ranks}`` of the config the workers get."""
    from hacrl_fed.config import load_config

    cfg = load_config(config_path, overrides=dict(overrides) if isinstance(overrides, Mapping) else list(overrides))
    return {o.id: o.sharding.ranks for o in cfg.orgs}


def write_resolved_config(config_path: str | Path, overrides: Mapping[str, Any] | Sequence[str], out: Path) -> Path:
    """Load ``config_path`` with ``overrides`` (validated) and write the result as YAML to ``out``."""
    from hacrl_fed.config import load_config

    cfg = load_config(config_path, overrides=dict(overrides) if isinstance(overrides, Mapping) else list(overrides))
    out.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return out


class _Worker:
    """One subprocess plus the thread that copies its output to the log file and spots the ready line."""

    def __init__(self, org_id: str, argv: list[str], log_path: Path, env: dict[str, str]):
        self.org_id = org_id
        self.address: str | None = None
        self.ready = threading.Event()
        self.tail: deque[str] = deque(maxlen=_TAIL_LINES)
        self.own_error: str | None = None  # its first OWN_ERROR line
        self.exception: str | None = None  # its first EXCEPTION_LINE
        self.log_path = log_path
        self.log_file = log_path.open("a", buffering=1)
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env=env,
        )
        self.reader = threading.Thread(target=self._pump, name=f"worker-log-{org_id}", daemon=True)
        self.reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log_file.write(line)
            self.tail.append(line.rstrip("\n"))
            if self.own_error is None and OWN_ERROR.match(line):
                self.own_error = line.strip()
            elif self.exception is None and EXCEPTION_LINE.match(line):
                self.exception = line.strip()
            m = READY.match(line)
            if m and m["org"] == self.org_id and not self.ready.is_set():
                self.address = m["address"]
                self.ready.set()
        self.log_file.close()

    @property
    def error_line(self) -> str | None:
        """The worker's own first error line: its one-line report, else the first exception a traceback of it
        ended on (under torch's launcher: a rank's, never the launcher's closing block); None when it printed
        neither."""
        return self.own_error or self.exception

    def describe_failure(self, why: str, *, quote_error: bool = True) -> str:
        """``why`` with the worker's own error line (:attr:`error_line`, unless not ``quote_error``), else its last
        log lines."""
        if quote_error and self.error_line is not None:
            return f"worker {self.org_id!r} (pid {self.proc.pid}) {why}: {self.error_line} (log: {self.log_path})"
        tail = "\n".join(f"    {line}" for line in self.tail) or "    (no output)"
        return f"worker {self.org_id!r} (pid {self.proc.pid}) {why}; last log lines:\n{tail}"


def worker_threads(num_workers: int, cpus: int | None = None) -> int:
    """Torch threads per local worker: the cores this process may use, shared out, ``max(1, cpus // workers)``.

    Every worker defaults to all cores otherwise, and n workers that each spin one OpenMP thread per core on the
    same cores slow each other down several times over (measured: 3 workers on 2 cores, ~8x in-process's round).
    The launcher sets ``OMP_NUM_THREADS`` to this unless the environment already sets it.
    """
    if cpus is None:
        cpus = available_cpus()
    return max(1, cpus // max(1, num_workers))


def worker_thread_env(num_workers: int) -> dict[str, str]:
    """``{"OMP_NUM_THREADS": worker_threads(n)}`` for workers started on this machine, or ``{}`` when the
    environment already sets ``OMP_NUM_THREADS`` (the operator's choice wins)."""
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(worker_threads(num_workers))}


class WorkerProcesses:
    """``with WorkerProcesses(cfg_path, ["a", "b"], run_dir=d) as addresses: ...`` → ``{org: address}``.

    ``worker_args`` are appended to every worker's command line; ``command`` replaces ``hacrl-fed worker``
    (``[python, -m, hacrl_fed.cli, worker]``), e.g. for a stand-in worker script in tests. ``die_with_parent``
    (Linux): the workers get SIGTERM when the thread that called :meth:`start` dies.
    """

    def __init__(
        self,
        config_path: str | Path,
        org_ids: Sequence[str],
        *,
        run_dir: str | Path,
        overrides: Mapping[str, Any] | Sequence[str] | None = None,
        ready_timeout_s: float = 600.0,
        grace_s: float = 10.0,
        worker_args: Sequence[str] = (),
        command: Sequence[str] | None = None,
        die_with_parent: bool = True,
    ):
        if not org_ids:
            raise ValueError("WorkerProcesses needs at least one org id")
        self.config_path, self.org_ids = Path(config_path), list(org_ids)
        self.run_dir = Path(run_dir)
        self.overrides = overrides or {}
        self.ready_timeout_s, self.grace_s = float(ready_timeout_s), float(grace_s)
        self.worker_args = list(worker_args)
        self.command = list(DEFAULT_WORKER_COMMAND if command is None else command)
        self.die_with_parent = die_with_parent
        self.workers: dict[str, _Worker] = {}
        self.addresses: dict[str, str] = {}
        self.secrets: dict[str, str] = {}  # org -> link secret of a loopback TCP worker (pass to GrpcTransport)
        self.exit_codes: dict[str, int | None] = {}  # filled by close()
        self.deaths: DeathWatch | None = None  # watches the workers once all are ready (module doc)

    def _env(self, processes: int | None = None) -> dict[str, str]:
        """The workers' environment; ``processes``: how many share this machine (default: one per org)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop(PHASE_FILE_ENV, None)  # each worker gets its own (start)
        env.update(worker_thread_env(len(self.org_ids) if processes is None else processes))
        if self.die_with_parent:  # the worker also polls for its parent (PDEATHSIG alone proved unreliable)
            env[PARENT_PID_ENV] = str(os.getpid())
        root = str(Path(__file__).resolve().parents[2])  # so the child imports this very hacrl_fed
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        return env

    def start(self) -> dict[str, str]:
        """Start every worker, wait until all are ready; ``{org: address}``. On any failure stop all and raise."""
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        private_dir(self.run_dir / "sock")
        config = self.config_path
        if self.overrides:
            config = write_resolved_config(config, self.overrides, self.run_dir / "worker_config.yaml")
        ranks = org_ranks(config, self.overrides if config == self.config_path else {})
        atexit.register(self.close)
        env = self._env(sum(ranks.get(org, 1) for org in self.org_ids))  # one share of the cores per rank
        try:
            for org in self.org_ids:
                listen = listen_address(self.run_dir, org)
                secret_file = None
                if listen.startswith("unix:"):
                    Path(listen[5:]).unlink(missing_ok=True)  # a stale socket from a killed run
                else:  # loopback TCP: a fresh per-launch secret (0600, in the 0700 sock dir)
                    secret_file = self.run_dir / "sock" / f"{org}.secret"
                    self.secrets[org] = create_secret_file(secret_file)
                argv = [
                    *torchrun_argv(ranks.get(org, 1), self.command),
                    "--config",
                    str(config),
                    "--org",
                    org,
                    "--listen",
                    listen,
                    *link_args(listen, secret_file),
                    *self.worker_args,
                ]
                if self.die_with_parent:
                    argv = die_with_parent_argv(argv)
                phase_file = phase_file_of(self.run_dir, org)
                phase_file.unlink(missing_ok=True)
                worker_env = dict(env, **{PHASE_FILE_ENV: str(phase_file)})
                self.workers[org] = _Worker(org, argv, self.run_dir / "logs" / f"{org}.log", worker_env)
            self._wait_ready()
            self.deaths = DeathWatch(self.run_dir, self.workers)
        except BaseException:
            self.close()
            raise
        return dict(self.addresses)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        pending = dict(self.workers)
        while pending:
            for org, w in list(pending.items()):
                if w.ready.is_set():
                    self.addresses[org] = w.address  # type: ignore[assignment]
                    del pending[org]
                elif w.proc.poll() is not None:
                    w.reader.join(timeout=1.0)  # collect its last words
                    if w.proc.returncode == 2 or refused(w.error_line):  # a configuration or build-time error
                        raise _build_error(w)  # (torch's launcher exits 1 when a rank exits 2: its line says so)
                    raise WorkerStartError(
                        w.describe_failure(f"exited with code {w.proc.returncode} before it was ready")
                    )
            if pending and time.monotonic() > deadline:
                org, w = next(iter(pending.items()))
                why = f"was not ready after {self.ready_timeout_s:.0f} s"  # still running: what it is doing now
                raise WorkerStartError(w.describe_failure(why, quote_error=False))
            if pending:
                time.sleep(0.05)

    def close(self) -> None:
        """SIGTERM every live worker, SIGKILL those still alive after ``grace_s``; idempotent."""
        atexit.unregister(self.close)
        if self.deaths is not None:
            self.deaths.stop()  # stopping them is no death to report
        live = [w for w in self.workers.values() if w.proc.poll() is None]
        for w in live:
            w.proc.terminate()
        deadline = time.monotonic() + self.grace_s
        for w in live:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        for org, w in self.workers.items():
            w.reader.join(timeout=2.0)
            self.exit_codes[org] = w.proc.returncode
        self.workers.clear()

    def __enter__(self) -> dict[str, str]:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
