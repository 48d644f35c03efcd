"""A process harness for a real Flower deployment on one machine: SuperLink, SuperNodes, policy workers, runs.

Used by ``tests/test_deployment.py`` and by people (``hacrl-fed deploy-local --config C.yaml``,
:mod:`hacrl_fed.cli.deploy_local`, see :func:`run_local`). Everything listens on 127.0.0.1 only, on free ports,
except the policy workers: by default they listen on unix sockets in ``<workdir>/sock`` (mode 0700); see
:func:`start_local` for the TCP fall-backs (mutual TLS with the harness's keys, or ``--insecure`` loopback).
Each process

* logs stdout + stderr to ``<workdir>/logs/<name>.log``;
* gets its own ``FLWR_HOME`` (``<workdir>/homes/<name>``; the ``flwr`` CLI uses ``homes/cli`` and its
  ``config.toml``) and :data:`QUIET_ENV` (no telemetry, update checks, per-run ``uv`` installs or hub access);
* gets :data:`FAST_POLL_ENV` unless the environment sets those variables itself (the SuperExec that each
  SuperNode starts looks for a ClientApp task every 0.1 s instead of every second: up to 0.9 s less per message);
* is started with this interpreter's ``bin`` directory first on ``PATH`` (``flower-superlink`` spawns
  ``flower-superexec`` by name) and stopped by PID: SIGTERM, ``grace_s``, SIGKILL; then the same for whatever
  descendants it had (``flower-superexec``, ``flwr-serverapp``, ``flwr-clientapp``) when the stop began.

Readiness (each bounded by ``startup_timeout_s``; a process that exits first fails with its log tail):
SuperLink: its port accepts TCP connections. SuperNode: it logs ``SuperNode ID: <id>`` (it was activated by the
SuperLink; an unregistered key under ``--enable-supernode-auth`` makes it exit instead). Worker: it prints
``hacrl-fed worker <org> listening on <address>``.

flwr 1.42 facts this relies on (measured): one SuperLink port serves the Fleet, Control and Runtime HTTP APIs;
each SuperNode needs its own ``--port`` (its local Runtime API); ``flwr run APP NAME --format json`` prints the run
id; ``flwr list NAME --run-id ID --format json`` reports ``status`` (terminal values start with ``finished:``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hacrl_fed.coordinator.launcher import MAX_UNIX_SOCKET_PATH, private_dir, worker_thread_env
from hacrl_fed.lifecycle import OFFLINE_ENV
from hacrl_fed.run_files import SUMMARY_FILE
from hacrl_fed.security.keys import KeyLayout, client_name
from hacrl_fed.wire.link_secret import create_secret_file

HOST = "127.0.0.1"
QUIET_ENV = {**OFFLINE_ENV, "PYTHONUNBUFFERED": "1"}  # hacrl_fed.lifecycle's offline environment, unbuffered
# flwr 1.42's SuperExec sleeps FLWR_SUPEREXEC_TASK_POLL_INTERVAL s (default 1.0, bounds 0.01-60) between task polls
FAST_POLL_ENV = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1"}
SUPERNODE_READY = re.compile(r"SuperNode ID: (?P<node_id>\d+)")
RUN_STARTED = re.compile(r"Successfully started run (?P<run_id>\d+)")
WORKER_READY = re.compile(r"hacrl-fed worker (?P<org>\S+) listening on (?P<address>\S+)")
_TAIL_CHARS = 3000
WORKER_LINKS = ("auto", "unix", "tls", "insecure")


class HarnessError(RuntimeError):
    """A process did not start, a CLI call failed, or a run missed its deadline (message quotes the logs)."""


# ------------------------------------------------------------------------------------------------ helpers


def free_port(host: str = HOST) -> int:
    """A TCP port free on ``host`` right now (the OS picks it; a race with other programs is possible)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether ``host:port`` accepts a TCP connection."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def process_table() -> dict[int, tuple[int, str]]:
    """``{pid: (ppid, command line)}`` of every process, from ``ps`` (Linux and macOS)."""
    out = subprocess.run(
        ["ps", "-A", "-o", "pid=", "-o", "ppid=", "-o", "args="], capture_output=True, text=True, check=True
    ).stdout
    table = {}
    for line in out.splitlines():
        parts = line.split(None, 2)
        if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
            table[int(parts[0])] = (int(parts[1]), parts[2] if len(parts) > 2 else "")
    return table


def descendants(pid: int, table: Mapping[int, tuple[int, str]] | None = None) -> dict[int, str]:
    """``{pid: command}`` of every live (non-zombie) descendant of ``pid``."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for p, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(p)
    found, stack = {}, list(children.get(pid, []))
    while stack:
        p = stack.pop()
        if "<defunct>" not in table[p][1]:
            found[p] = table[p][1]
        stack.extend(children.get(p, []))
    return found


def _signal_if_same(pid: int, command: str, sig: int) -> bool:
    """Send ``sig`` to ``pid`` only if it still runs ``command`` (guards against PID reuse); True if sent."""
    entry = process_table().get(pid)
    if entry is None or entry[1] != command or "<defunct>" in entry[1]:
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pids: Mapping[int, str], timeout: float) -> dict[int, str]:
    """Wait up to ``timeout`` s for ``pids`` to exit; return those still running their command."""
    deadline = time.monotonic() + timeout
    while True:
        table = process_table()
        left = {p: c for p, c in pids.items() if p in table and table[p][1] == c and "<defunct>" not in table[p][1]}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


def flwr_bin_dir() -> Path:
    """The directory holding this interpreter's console scripts (``flwr``, ``flower-superlink``, ...)."""
    return Path(sys.executable).parent


# ------------------------------------------------------------------------------------------------ processes


@dataclass
class Proc:
    """One started process: ``popen``, its log file, and timings (seconds since start; None = not yet)."""

    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen
    started_at: float = field(default_factory=time.monotonic)
    ready_s: float | None = None
    stop_s: float | None = None
    seen_descendants: dict[int, str] = field(default_factory=dict)  # snapshot taken when the stop began

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tail(self, chars: int = _TAIL_CHARS) -> str:
        return self.log_text()[-chars:]


class Deployment:
    """SuperLink + SuperNodes + workers on loopback, and the ``flwr`` CLI pointed at them. A context manager.

    ``tls`` (a :class:`~hacrl_fed.security.keys.KeyLayout` from ``hacrl-fed keys``) switches everything to TLS
    with SuperNode authentication; without it everything is ``--insecure``. ``extra_env`` goes into every
    process's environment last (the benchmark sets ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` or ``FLWR_LOG_LEVEL``).
    """

    def __init__(
        self,
        workdir: str | Path,
        *,
        tls: KeyLayout | None = None,
        startup_timeout_s: float = 90.0,
        grace_s: float = 8.0,
        cli_timeout_s: float = 120.0,
        bin_dir: Path | None = None,
        extra_env: Mapping[str, str] | None = None,
    ):
        self.workdir = Path(workdir).absolute()
        self.tls = tls
        self.startup_timeout_s = startup_timeout_s
        self.grace_s = grace_s
        self.cli_timeout_s = cli_timeout_s
        self.bin_dir = bin_dir or flwr_bin_dir()
        self.extra_env = dict(extra_env or {})
        self.procs: list[Proc] = []
        self.superlink: Proc | None = None
        self.superlink_port: int | None = None
        self.federation: str | None = None
        self._streams: dict[int, Proc] = {}  # run id -> its `flwr run --stream` process
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)

    # -- environment and spawning

    def env(self, name: str) -> dict[str, str]:
        """Environment of process ``name``: :data:`FAST_POLL_ENV` + ours + :data:`QUIET_ENV` + its own FLWR_HOME + bin
        dir on PATH + ``extra_env``."""
        home = self.workdir / "homes" / name
        home.mkdir(parents=True, exist_ok=True)
        path = os.pathsep.join([str(self.bin_dir), os.environ.get("PATH", "")])
        return {**FAST_POLL_ENV, **os.environ, **QUIET_ENV, "FLWR_HOME": str(home), "PATH": path, **self.extra_env}

    def _exe(self, name: str) -> str:
        exe = shutil.which(name, path=str(self.bin_dir)) or shutil.which(name)
        if exe is None:
            raise HarnessError(f"{name!r} not found in {self.bin_dir} nor on PATH (install hacrl-fed[flower])")
        return exe

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        *,
        cwd: str | Path | None = None,
        home: str | None = None,
        extra_env: Mapping[str, str] | None = None,
    ) -> Proc:
        """Start ``argv`` with output to ``logs/<name>.log`` and :meth:`env` of ``home`` (default ``name``) plus
        ``extra_env``."""
        if any(p.name == name and p.alive() for p in self.procs):
            raise HarnessError(f"a process named {name!r} is already running")
        log_path = self.workdir / "logs" / f"{name}.log"
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                list(argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**self.env(home or name), **(extra_env or {})},
                cwd=cwd,
            )
        proc = Proc(name, list(argv), log_path, popen)
        self.procs.append(proc)
        return proc

    def wait_for(self, proc: Proc, ready: Callable[[], Any], what: str, timeout_s: float | None = None) -> Any:
        """Poll ``ready()`` until truthy (returned); HarnessError if ``proc`` exits or the time is up."""
        deadline = time.monotonic() + (timeout_s or self.startup_timeout_s)
        while True:
            result = ready()
            if result:
                proc.ready_s = time.monotonic() - proc.started_at
                return result
            if not proc.alive():
                raise HarnessError(
                    f"{proc.name} exited with code {proc.popen.returncode} before {what}; "
                    f"log {proc.log_path}:\n{proc.tail()}"
                )
            if time.monotonic() >= deadline:
                raise HarnessError(
                    f"{proc.name}: no {what} within {timeout_s or self.startup_timeout_s:g} s; "
                    f"log {proc.log_path}:\n{proc.tail()}"
                )
            time.sleep(0.2)

    def wait_log(self, proc: Proc, pattern: re.Pattern, what: str, timeout_s: float | None = None) -> re.Match:
        """Wait until ``proc``'s log matches ``pattern``; the match."""
        return self.wait_for(proc, lambda: pattern.search(proc.log_text()), what, timeout_s)

    # -- SuperLink and SuperNodes

    @property
    def superlink_address(self) -> str:
        if self.superlink_port is None:
            raise HarnessError("the SuperLink is not started")
        return f"{HOST}:{self.superlink_port}"

    def superlink_argv(self, port: int) -> list[str]:
        """``flower-superlink`` command line: insecure, or TLS + ``--enable-supernode-auth``."""
        argv = [self._exe("flower-superlink"), "--host", HOST, "--port", str(port)]
        if self.tls is None:
            return argv + ["--insecure"]
        return argv + [
            "--ssl-ca-certfile",
            str(self.tls.ca_cert),
            "--ssl-certfile",
            str(self.tls.server_cert),
            "--ssl-keyfile",
            str(self.tls.server_key),
            "--enable-supernode-auth",
        ]

    def start_superlink(self, port: int | None = None) -> Proc:
        """Start the SuperLink on ``port`` (default: a free one) and wait until it accepts connections."""
        port = port or free_port()
        proc = self.spawn("superlink", self.superlink_argv(port))
        self.wait_for(proc, lambda: proc.alive() and port_open(HOST, port), f"listening on {HOST}:{port}")
        self.superlink, self.superlink_port = proc, port
        return proc

    def supernode_argv(
        self,
        org: str,
        worker: str,
        port: int,
        auth_key: Path | None = None,
        worker_config: Mapping[str, str] | None = None,
    ) -> list[str]:
        """``flower-supernode`` command line for ``org`` whose policy worker listens at ``worker``.

        ``worker_config`` adds node_config string entries (e.g. ``worker-ca``, ``worker-cert``, ``worker-key``).
        """
        pairs = {"org": org, "worker": worker, **(worker_config or {})}
        node_config = " ".join(f"{key}={json.dumps(str(value))}" for key, value in pairs.items())
        argv = [
            self._exe("flower-supernode"),
            "--superlink",
            self.superlink_address,
            "--host",
            HOST,
            "--port",
            str(port),
            "--node-config",
            node_config,
        ]
        argv += ["--insecure"] if self.tls is None else ["--root-certificates", str(self.tls.ca_cert)]
        if auth_key is not None:
            argv += ["--auth-supernode-private-key", str(auth_key)]
        return argv

    def start_supernode(
        self,
        org: str,
        worker: str,
        *,
        auth_key: str | Path | None = None,
        name: str | None = None,
        wait: bool = True,
        worker_config: Mapping[str, str] | None = None,
    ) -> Proc:
        """Start ``org``'s SuperNode; with ``wait``, block until the SuperLink activated it (``SuperNode ID``).

        ``auth_key`` defaults to ``tls.supernode_key(org)`` in TLS mode; ``worker_config`` as in
        :meth:`supernode_argv`.
        """
        if auth_key is None and self.tls is not None:
            auth_key = self.tls.supernode_key(org)
        argv = self.supernode_argv(org, worker, free_port(), Path(auth_key) if auth_key else None, worker_config)
        proc = self.spawn(name or f"supernode-{org}", argv)
        if wait:
            self.wait_log(proc, SUPERNODE_READY, "SuperNode ID (activation by the SuperLink)")
        return proc

    @staticmethod
    def supernode_id(proc: Proc) -> int | None:
        """The node id a SuperNode logged, or None."""
        m = SUPERNODE_READY.search(proc.log_text())
        return int(m["node_id"]) if m else None

    # -- policy workers

    def start_worker(self, org: str, argv: Sequence[str], *, cwd: str | Path | None = None) -> tuple[Proc, str]:
        """Start a worker (``argv`` must make it print the ``WORKER_READY`` line); ``(proc, address)``."""
        proc = self.spawn(f"worker-{org}", argv, cwd=cwd)
        match = self.wait_log(proc, WORKER_READY, "the 'listening on' line")
        return proc, match["address"]

    # -- the flwr CLI

    def write_federation(self, name: str = "hacrl") -> Path:
        """Write ``homes/cli/config.toml`` with ``[superlink.<name>]`` pointing at the SuperLink; its path."""
        if self.tls is None:
            conn = "insecure = true"
        else:
            conn = f"root-certificates = {json.dumps(str(self.tls.ca_cert))}"
        text = f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\naddress = "{self.superlink_address}"\n{conn}\n'
        path = self.workdir / "homes" / "cli" / "config.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        self.federation = name
        return path

    def flwr(
        self, *args: str, timeout_s: float | None = None, check: bool = True, cwd: str | Path | None = None
    ) -> subprocess.CompletedProcess:
        """Run ``flwr ARGS`` with the CLI's FLWR_HOME; its output is appended to ``logs/cli.log``."""
        argv = [self._exe("flwr"), *args]
        try:
            res = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                env=self.env("cli"),
                cwd=cwd,
                timeout=timeout_s or self.cli_timeout_s,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as err:
            raise HarnessError(f"{' '.join(argv)}: no answer within {err.timeout:g} s") from None
        with (self.workdir / "logs" / "cli.log").open("a") as log:
            log.write(f"$ {' '.join(argv)}\n[rc={res.returncode}]\n{res.stdout}{res.stderr}\n")
        if check and res.returncode != 0:
            raise HarnessError(f"{' '.join(argv)} exited {res.returncode}:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
        return res

    def _federation(self) -> str:
        if self.federation is None:
            raise HarnessError("call write_federation() first")
        return self.federation

    def flwr_json(self, *args: str, **kw: Any) -> dict[str, Any]:
        """``flwr ARGS --format json`` parsed (text before the first ``{`` is ignored)."""
        out = self.flwr(*args, "--format", "json", **kw).stdout
        start = out.find("{")
        try:
            return json.loads(out[start:]) if start >= 0 else {}
        except json.JSONDecodeError as err:
            raise HarnessError(f"flwr {' '.join(args)}: not JSON ({err}):\n{out[-2000:]}") from None

    def register_supernode(self, public_key: str | Path) -> int:
        """``flwr supernode register KEY.pub NAME``; the node id the SuperLink assigned."""
        reply = self.flwr_json("supernode", "register", str(public_key), self._federation())
        if not reply.get("success") or "node-id" not in reply:
            raise HarnessError(f"registering {public_key} failed: {reply}")
        return int(reply["node-id"])

    def list_supernodes(self) -> list[dict[str, Any]]:
        """``flwr supernode list NAME``: one dict per node (``node-id``, ``status``, ...)."""
        return self.flwr_json("supernode", "list", self._federation()).get("nodes", [])

    def _run_args(self, app_dir: str | Path, run_config: Mapping[str, Any] | None) -> list[str]:
        args = ["run", str(Path(app_dir).absolute()), self._federation()]
        if run_config:
            path = self.workdir / f"run-config-{len(list(self.workdir.glob('run-config-*.toml')))}.toml"
            path.write_text(toml_table(run_config))
            args += ["--run-config", str(path)]
        return args

    def submit(self, app_dir: str | Path, run_config: Mapping[str, Any] | None = None, *, stream: bool = True) -> int:
        """``flwr run APP NAME --run-config FILE``: submit the app; the run id.

        ``run_config`` values override ``[tool.flwr.app.config]`` (flwr refuses keys not declared there). With
        ``stream`` the CLI keeps running with ``--stream`` (process ``flwr-run-<n>``, its log holds the ServerApp's
        log) and exits when the run ends: :meth:`wait_run` then waits for it instead of polling ``flwr list``.
        """
        args = self._run_args(app_dir, run_config)
        if not stream:
            reply = self.flwr_json(*args)
            if not reply.get("success") or "run-id" not in reply:
                raise HarnessError(f"flwr run failed: {reply}")
            return int(reply["run-id"])
        proc = self.spawn(f"flwr-run-{len(self._streams)}", [self._exe("flwr"), *args, "--stream"], home="cli")
        run_id = int(self.wait_log(proc, RUN_STARTED, "'Successfully started run'", self.cli_timeout_s)["run_id"])
        self._streams[run_id] = proc
        return run_id

    def run_info(self, run_id: int) -> dict[str, Any]:
        """``flwr list NAME --run-id ID``: the run's dict (``status``, ``running-at``, ``finished-at``, ...)."""
        runs = self.flwr_json("list", self._federation(), "--run-id", str(run_id)).get("runs", [])
        if not runs:
            raise HarnessError(f"flwr list knows no run {run_id}")
        return runs[0]

    def wait_run(
        self, run_id: int, timeout_s: float, poll_s: float = 3.0, echo: Callable[[str], Any] | None = None
    ) -> dict[str, Any]:
        """Wait for the run's status to start with ``finished``; its :meth:`run_info` (HarnessError past ``timeout_s``).

        A streamed run is waited for by its ``flwr run --stream`` process, whose new output (the ServerApp's log:
        one line per round) goes to ``echo`` as it arrives; otherwise ``flwr list`` is polled.
        """
        deadline = time.monotonic() + timeout_s
        stream = self._streams.get(run_id)
        offset = 0
        while stream is not None and stream.alive() and time.monotonic() < deadline:
            if echo is not None:
                offset = self._echo_new(stream, offset, echo)
            time.sleep(0.5)
        if echo is not None and stream is not None:
            self._echo_new(stream, offset, echo, final=True)
        while True:
            info = self.run_info(run_id)
            if str(info.get("status", "")).startswith("finished"):
                return info
            if time.monotonic() >= deadline:
                raise HarnessError(
                    f"run {run_id} still {info.get('status')!r} after {timeout_s:g} s; "
                    f"server log:\n{self.run_log(run_id)[-_TAIL_CHARS:]}"
                )
            time.sleep(poll_s)

    @staticmethod
    def _echo_new(proc: Proc, offset: int, echo: Callable[[str], Any], final: bool = False) -> int:
        """Pass the complete lines ``proc`` logged after byte ``offset`` (all of it when ``final``) to ``echo``;
        the new offset."""
        try:
            with proc.log_path.open("rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return offset
        end = len(data) if final else data.rfind(b"\n") + 1
        if end:
            echo(data[:end].decode(errors="replace").rstrip("\n"))
        return offset + end

    def run_log(self, run_id: int) -> str:
        """The ServerApp's log so far: the ``--stream`` output, else :meth:`flwr_log`."""
        if run_id in self._streams:
            return self._streams[run_id].log_text()
        return self.flwr_log(run_id)

    def flwr_log(self, run_id: int) -> str:
        """``flwr log ID NAME --show``: the ServerApp's log as the SuperLink keeps it."""
        res = self.flwr("log", str(run_id), self._federation(), "--show", check=False, timeout_s=60)
        return res.stdout + res.stderr

    def stop_run(self, run_id: int) -> None:
        """``flwr stop ID NAME`` (errors ignored: the run may already be over)."""
        self.flwr("stop", str(run_id), self._federation(), check=False, timeout_s=60)

    # -- stopping

    def stop(self, proc: Proc, grace_s: float | None = None) -> None:
        """SIGTERM ``proc``, SIGKILL after ``grace_s``; then the same for its descendants still running."""
        grace = self.grace_s if grace_s is None else grace_s
        if proc.stop_s is not None:
            return
        t0 = time.monotonic()
        kids = proc.seen_descendants = descendants(proc.pid)
        if proc.alive():
            proc.popen.send_signal(signal.SIGTERM)
            try:
                proc.popen.wait(grace)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(10)
        left = _wait_gone(kids, grace)
        for pid, command in left.items():
            _signal_if_same(pid, command, signal.SIGTERM)
        for pid, command in _wait_gone(left, 2.0).items():
            _signal_if_same(pid, command, signal.SIGKILL)
        proc.stop_s = time.monotonic() - t0

    def stop_all(self) -> None:
        """Stop every process: SuperNodes first, then workers, then the SuperLink (each by PID)."""
        order = {"flwr": 0, "supernode": 1, "worker": 2}
        for proc in sorted(self.procs, key=lambda p: order.get(p.name.split("-")[0], 2)):
            try:
                self.stop(proc)
            except Exception as err:  # keep stopping the others
                print(f"harness: stopping {proc.name} (pid {proc.pid}) failed: {err}", file=sys.stderr)

    def leftovers(self) -> dict[int, str]:
        """``{pid: command}`` of started processes, or descendants seen when stopping them, still running."""
        table = process_table()
        left = {p.pid: " ".join(p.argv) for p in self.procs if p.alive()}
        for p in self.procs:
            left.update(
                {
                    pid: cmd
                    for pid, cmd in p.seen_descendants.items()
                    if table.get(pid, (0, ""))[1] == cmd and "<defunct>" not in cmd
                }
            )
        return left

    def timings(self) -> dict[str, dict[str, float | None]]:
        """``{name: {"ready_s": ..., "stop_s": ...}}`` of every process started."""
        return {p.name: {"ready_s": p.ready_s, "stop_s": p.stop_s} for p in self.procs}

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop_all()


def toml_table(values: Mapping[str, Any]) -> str:
    """Flat ``key = value`` TOML for str / bool / int / float values (what ``--run-config FILE`` reads)."""
    lines = []
    for key, value in values.items():
        if not re.fullmatch(r"[A-Za-z0-9_-]+", key):
            raise HarnessError(f"run-config key {key!r}: only letters, digits, '_' and '-' are allowed")
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float, str)):
            text = json.dumps(value)  # a JSON string / number is also a valid TOML basic string / number
        else:
            raise HarnessError(f"run-config {key!r}: {type(value).__name__} values are not supported")
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ for people


def worker_link_args(
    listen: str, org: str, tls: KeyLayout | None = None, secret_file: str | Path | None = None
) -> list[str]:
    """``hacrl-fed worker`` flags for ``listen``: none for ``unix:``; with ``tls``, mutual TLS with ``org``'s
    worker certificate, accepting only ``org``'s client certificate; else ``--insecure`` (loopback only) with the
    link secret ``secret_file`` (:mod:`hacrl_fed.wire.link_secret`)."""
    if listen.startswith("unix:"):
        return []
    if tls is None:
        return ["--insecure"] + (["--secret-file", str(secret_file)] if secret_file is not None else [])
    return [
        "--tls-cert",
        str(tls.worker_cert(org)),
        "--tls-key",
        str(tls.worker_key(org)),
        "--tls-ca",
        str(tls.ca_cert),
        "--tls-client-name",
        client_name(org),
    ]


def worker_node_config(
    listen: str, org: str, tls: KeyLayout | None = None, secret_file: str | Path | None = None
) -> dict[str, str]:
    """The SuperNode node_config entries matching :func:`worker_link_args`: ``org``'s client certificate for TCP
    with ``tls``, the link secret file for ``--insecure`` TCP, else none."""
    if listen.startswith("unix:"):
        return {}
    if tls is None:
        return {"worker-secret-file": str(secret_file)} if secret_file is not None else {}
    return {
        "worker-ca": str(tls.ca_cert),
        "worker-cert": str(tls.worker_client_cert(org)),
        "worker-key": str(tls.worker_client_key(org)),
    }


def worker_command(
    config: str | Path,
    org: str,
    *,
    run_dir: str | Path | None = None,
    listen: str = f"{HOST}:0",
    overrides: Sequence[str] = (),
    tls: KeyLayout | None = None,
    secret_file: str | Path | None = None,
) -> list[str]:
    """``hacrl-fed worker`` argv (this interpreter) for ``org`` on ``listen`` with :func:`worker_link_args`.

    The default, a free loopback port, is plaintext (``--insecure``) unless ``tls`` is given.
    """
    argv = [
        sys.executable,
        "-m",
        "hacrl_fed.cli",
        "worker",
        "--config",
        str(Path(config).absolute()),
        "--org",
        org,
        "--listen",
        listen,
        *worker_link_args(listen, org, tls, secret_file),
    ]
    for item in overrides:
        argv += ["--set", item]
    return argv + (["--run-dir", str(run_dir)] if run_dir is not None else [])


def identity_overrides(identity_set: str | Path, orgs: Sequence[str]) -> list[str]:
    """``--set`` overrides pinning the orgs' signing identities in ``identity_set`` (made there unless complete).

    In a deployment each worker and the ServerApp have their own run directories, so none may provision its own
    key set: workers need ``security.identity_file`` and everyone the same ``security.roster_file``.
    """
    from hacrl_fed.security.identity import IDENTITY_DIR, provision

    directory = Path(identity_set).absolute()
    roster = provision(directory, list(orgs))
    return [f"security.roster_file={roster}", f"security.identity_file={directory / IDENTITY_DIR}/{{org}}.key"]


def worker_listen(dep: Deployment, orgs: Sequence[str], link: str = "auto") -> tuple[dict[str, str], str]:
    """``({org: listen address}, link)`` for ``link`` in :data:`WORKER_LINKS` (``auto`` resolved).

    ``auto``: unix sockets in ``<workdir>/sock`` (made 0700) when their paths fit, else ``tls`` (mutual TLS on free
    loopback ports) when the deployment has keys, else ``insecure`` (plaintext on free loopback ports).
    """
    if link not in WORKER_LINKS:
        raise HarnessError(f"worker link {link!r}: expected one of {WORKER_LINKS}")
    sock_dir = dep.workdir / "sock"
    if link == "auto":
        fits = all(len(str(sock_dir / f"{org}.sock")) <= MAX_UNIX_SOCKET_PATH for org in orgs)
        link = "unix" if fits else ("tls" if dep.tls is not None else "insecure")
    if link == "tls" and dep.tls is None:
        raise HarnessError("worker link 'tls' needs a deployment with keys (Deployment(tls=...))")
    if link == "unix":
        private_dir(sock_dir)
        return {org: f"unix:{sock_dir / f'{org}.sock'}" for org in orgs}, link
    return {org: f"{HOST}:{free_port()}" for org in orgs}, link


def link_secrets(dep: Deployment, orgs: Sequence[str], link: str) -> dict[str, Path | None]:
    """Each worker's link secret file: on a plaintext loopback link (``insecure``) a fresh per-launch secret per
    worker (0600, in a 0700 dir); None on the other links."""
    secrets: dict[str, Path | None] = {org: None for org in orgs}
    if link == "insecure":
        for org in orgs:
            path = private_dir(dep.workdir / "secrets") / f"{org}.secret"
            create_secret_file(path)
            secrets[org] = path
    return secrets


def start_local(
    dep: Deployment,
    config: str | Path,
    orgs: Sequence[str],
    *,
    worker_argv: Callable[[str, str], Sequence[str]] | None = None,
    overrides: Sequence[str] = (),
    worker_link: str = "auto",
) -> dict[str, str]:
    """Workers, SuperLink, CLI federation, (TLS: key registration,) SuperNodes for ``orgs``; ``{org: address}``.

    Each worker listens where :func:`worker_listen` says for ``worker_link`` (default: a unix socket in a 0700
    directory of the workdir), chosen here, so workers, SuperLink and SuperNodes start concurrently and the
    SuperNodes know their worker's address before it is up (the ClientApp dials it only per message). With
    ``tls`` the worker serves mutual TLS and its SuperNode gets ``worker-ca`` / ``worker-cert`` / ``worker-key``.
    ``worker_argv(org, listen)`` builds each worker's command (default: :func:`worker_command`); the link flags
    (:func:`worker_link_args`) are appended to it.
    """
    listen, link = worker_listen(dep, orgs, worker_link)
    worker_tls = dep.tls if link == "tls" else None
    secrets = link_secrets(dep, orgs, link)

    def argv(org: str) -> list[str]:
        if worker_argv is None:
            return worker_command(
                config,
                org,
                run_dir=dep.workdir / "workers" / org,
                listen=listen[org],
                overrides=overrides,
                tls=worker_tls,
                secret_file=secrets[org],
            )
        return [*worker_argv(org, listen[org]), *worker_link_args(listen[org], org, worker_tls, secrets[org])]

    threads = worker_thread_env(len(orgs))  # the workers share this machine's cores
    workers = {org: dep.spawn(f"worker-{org}", argv(org), extra_env=threads) for org in orgs}
    dep.start_superlink()
    dep.write_federation()
    if dep.tls is not None:
        for org in orgs:
            dep.register_supernode(dep.tls.supernode_pub(org))
    nodes = {
        org: dep.start_supernode(
            org,
            listen[org],
            wait=False,
            worker_config=worker_node_config(listen[org], org, worker_tls, secrets[org]),
        )
        for org in orgs
    }
    for org in orgs:
        address = dep.wait_log(workers[org], WORKER_READY, "the 'listening on' line")["address"]
        if address != listen[org]:
            raise HarnessError(f"worker {org} listens on {address}, not on the requested {listen[org]}")
    for org in orgs:
        dep.wait_log(nodes[org], SUPERNODE_READY, "SuperNode ID (activation by the SuperLink)")
    return listen


def run_local(
    config: str | Path,
    *,
    workdir: str | Path | None = None,
    tls: bool = False,
    worker_link: str = "auto",
    overrides: Sequence[str] = (),
    app: str | Path = ".",
    timeout_s: float = 1800.0,
    out: Callable[[str], Any] = print,
    worker_argv: Callable[[str, str], Sequence[str]] | None = None,
    on_up: Callable[[Deployment], Any] | None = None,
) -> int:
    """One hacrl-fed config through a real local Flower deployment (:func:`start_local`), then stop everything.

    ``out`` gets the ServerApp's log as it streams (one line per round, the eval tables), a status line, and last
    the final per-org table (``summary.txt`` of the run dir ``WORKDIR/run``). ``flwr log`` of the run is kept in
    ``WORKDIR/logs/serverapp.log``, the processes' start/stop times in ``WORKDIR/timings.json``. 0 iff the run
    ends ``finished:completed``. ``worker_argv`` as in :func:`start_local` (tests use stand-in workers);
    ``on_up(deployment)`` is called once every process is up, before the run is submitted (tests probe the live
    deployment from outside; an exception it raises stops everything and propagates).
    """
    from hacrl_fed.config import load_config
    from hacrl_fed.security.keys import write_keys

    config = Path(config).absolute()
    cfg = load_config(config, list(overrides))
    if worker_argv is None:  # what the workers would refuse at start-up (models, task, context): before any process
        from hacrl_fed.preflight import preflight

        preflight(cfg)
    orgs = [o.id for o in cfg.orgs]
    workdir = Path(workdir or tempfile.mkdtemp(prefix="hacrl-fed-deploy-")).absolute()
    keys = write_keys(workdir / "keys", orgs, force=True) if tls else None
    overrides = [*overrides, *identity_overrides(keys.identity_set if keys else workdir / "identity_set", orgs)]
    run_dir = workdir / "run"
    logs = workdir / "logs"
    with Deployment(workdir, tls=keys) as dep:
        start_local(dep, config, orgs, overrides=overrides, worker_link=worker_link, worker_argv=worker_argv)
        if on_up is not None:
            on_up(dep)
        run_id = dep.submit(
            app, {"config-path": str(config), "overrides": " ".join(overrides), "run-dir": str(run_dir)}
        )
        out(f"run {run_id} submitted; process logs in {logs}; the ServerApp's log follows")
        info = dep.wait_run(run_id, timeout_s, echo=out)
        (logs / "serverapp.log").write_text(dep.flwr_log(run_id))
    (workdir / "timings.json").write_text(
        json.dumps(
            {"run": {k: info.get(k) for k in ("status", "running-at", "finished-at")}, "processes": dep.timings()},
            indent=1,
        )
    )
    status = str(info.get("status"))
    details = f" ({info['status-details']})" if info.get("status-details") else ""
    out(
        f"run {run_id}: {status}{details}; outputs in {run_dir}; logs in {logs} (flwr log: serverapp.log); "
        f"process times in {workdir / 'timings.json'}"
    )
    summary = run_dir / SUMMARY_FILE
    if status == "finished:completed" and summary.is_file():
        out(summary.read_text().rstrip())  # the final table, last
    return 0 if status == "finished:completed" else 1
