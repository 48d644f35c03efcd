"""One run lifecycle for every entry point: ``hacrl-fed run`` (in-process and gRPC), ``hacrl-fed simulate`` and the
Flower ServerApp (simulation, ``flwr run``, ``hacrl-fed deploy-local``).

:class:`Run` claims a run directory and leaves the same outputs in it whatever started the run:

* ``config.yaml``: the resolved config of the latest session. Its first lines name the real transport
  (``inprocess``, ``grpc``, ``flower-simulation`` or ``flower-deployment``) and ``federation.transport`` holds
  the config value that selects it (``inprocess``, ``grpc``, ``flower``), so the file stays a loadable config;
* ``run_info.json``: the hacrl run id, the absolute run dir, the transport, the Flower run id (Flower entry
  points), the status (``running``, ``completed``, ``failed``, ``interrupted``) and one entry per session (a new
  run, then each resume);
* ``metrics.jsonl``, ``tb/`` and (``wandb.enabled``) ``wandb/`` (:class:`~hacrl_fed.metrics.RunLogger`),
  ``coordinator_state.json`` (:class:`~hacrl_fed.coordinator.loop.Coordinator`);
* at the end: ``accuracy.png``, ``summary.txt`` (the final per-org table, the run ids and the output path) and
  ``report.html`` (:mod:`hacrl_fed.report`; with W&B, the orgs' samples as its table ``samples``);
* on failure: ``error.log`` (the traceback).

Also here, shared by every entry point: :func:`setup_logging` (the one logging set-up), :func:`check_run_dir`
(a new run needs an unused run dir, a resume a used one; the error names the keys of the entry point in use,
:data:`CLI_KEYS` or :data:`FLWR_KEYS`) and :data:`OFFLINE_ENV` (the offline, quiet environment used by the
tests, the deployment harness and the simulation; ``Makefile`` and ``.ci/run`` keep a shell copy that
``tests/test_lifecycle.py`` checks against it).

Importing this module is cheap (no torch, no Flower): the heavy parts are imported when a run starts.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hacrl_fed.fsio import write_json_atomic
from hacrl_fed.metrics import RunLogger, format_table, plot_accuracy, round_progress
from hacrl_fed.report import finish_report
from hacrl_fed.run_files import CONFIG_FILE, ERROR_LOG, INFO_FILE, STATE_FILE, SUMMARY_FILE

log = logging.getLogger(__name__)

# Flower's own switches: no telemetry, no update checks, no per-run environment installs (uv downloads).
FLOWER_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
}
# Offline and quiet: Flower's switches, no model-hub access, no tokenizers fork warnings.
OFFLINE_ENV = {**FLOWER_ENV, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

# the real transport -> the federation.transport config value that selects it
TRANSPORTS = {"inprocess": "inprocess", "grpc": "grpc", "flower-simulation": "flower", "flower-deployment": "flower"}

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass(frozen=True)
class EntryKeys:
    """How an entry point spells "resume" and "another run dir", for error messages."""

    resume: str
    run_dir: str
    verb: str = "pass"
    where: str = ""


CLI_KEYS = EntryKeys("--resume", "--run-dir")  # hacrl-fed run / hacrl-fed simulate
FLWR_KEYS = EntryKeys("resume=true", 'run-dir="DIR"', "set", " in flwr run --run-config")  # the Flower ServerApp


class RunDirError(ValueError):
    """A run dir that does not fit the request: a new run into a used dir, or a resume without a run."""


def check_run_dir(run_dir: str | Path, resume: bool, keys: EntryKeys = CLI_KEYS) -> None:
    """A resume needs a run in ``run_dir``, a new run needs none; :class:`RunDirError` naming ``keys`` otherwise."""
    run_dir = Path(run_dir)
    has_state = (run_dir / STATE_FILE).exists() or (run_dir / f"{STATE_FILE}.prev").exists()  # .prev: state_file
    if resume and not has_state:
        raise RunDirError(f"{keys.resume}: no run to resume in {run_dir} ({STATE_FILE} missing)")
    if not resume and has_state:
        raise RunDirError(
            f"{run_dir} already holds a run: {keys.verb} {keys.resume} to continue it, or another "
            f"{keys.run_dir}{keys.where}"
        )


# ------------------------------------------------------------------------------------------------ logging


class _StderrHandler(logging.StreamHandler):
    """A stream handler writing to whatever ``sys.stderr`` is when a record is emitted (pytest's capture, Flower's
    log mirroring and tqdm all swap or wrap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ / setStream: always the current sys.stderr
        pass


def _not_shown_elsewhere(record: logging.LogRecord) -> bool:
    """Root handler filter: hacrl-fed's records have their own handler, Flower's too (its console handler)."""
    return not record.name.startswith(("hacrl_fed", "flwr"))


def setup_logging(
    level: str | int | None = "INFO", *, others: int | None = logging.WARNING, verbose: bool = False
) -> None:
    """The logging set-up of every hacrl-fed entry point (idempotent: later calls only change levels).

    ``hacrl_fed.*`` loggers log at ``level`` to stderr, ``time LEVEL logger: message`` (``None``: keep the level an
    earlier call set, INFO if none did); their records still
    propagate (pytest's ``caplog`` sees them). ``others``: the level for every other library (``verbose``: DEBUG),
    shown through one root handler that skips hacrl-fed's and Flower's records (they have their own); ``flwr``,
    ``ray`` and ``alembic`` are set to it. ``others=None`` leaves everything but hacrl-fed's loggers alone (the
    Flower ServerApp: Flower configured its process's logging).
    """
    ours = logging.getLogger("hacrl_fed")
    if level is not None or ours.level == logging.NOTSET:
        level = "INFO" if level is None else level
        ours.setLevel(level.upper() if isinstance(level, str) else level)
    if not any(isinstance(h, _StderrHandler) for h in ours.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        ours.addHandler(handler)
    if others is None:
        return
    others = logging.DEBUG if verbose else others
    root = logging.getLogger()
    if not root.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        handler.addFilter(_not_shown_elsewhere)
        root.addHandler(handler)
    root.setLevel(others)
    for name in ("flwr", "ray", "alembic"):
        logging.getLogger(name).setLevel(others)


def progress_shown(requested: bool, stream: Any = None) -> bool:
    """Whether the per-round bar is drawn: only when asked and ``stream`` (default ``sys.stderr``, where the bar and
    the log lines go) is a terminal. Anywhere else (a pipe, a file, CI) the run logs plain lines, one per round."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(requested and callable(isatty) and isatty())
    except ValueError:  # a closed stream
        return False


CONSOLE_LOGGERS = ("hacrl_fed", "", "flwr")  # hacrl-fed's own handler, the root's (other libraries), Flower's


class _AboveBar:
    """``sys.stderr`` / ``sys.stdout`` while the bar is shown: whole lines only, each written with the bar cleared
    first and drawn again after (a warning, a ``print``, Ray's forwarded worker output); a partial line waits for its
    end. Everything else (``isatty``, ``fileno``, ``encoding``) is the wrapped stream's."""

    def __init__(self, stream: Any, bar: Any) -> None:
        self._stream, self._bar, self._pending = stream, bar, ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            if "\n" not in self._pending:
                return len(text)
            lines, _, self._pending = self._pending.rpartition("\n")
        self._emit(lines + "\n")
        return len(text)

    def _emit(self, text: str) -> None:
        from tqdm import tqdm

        with tqdm.external_write_mode(file=self._bar.fp):
            self._stream.write(text)
            self._stream.flush()

    def flush(self) -> None:  # a partial line stays pending: written now, it would share the bar's line
        self._stream.flush()

    def close_line(self) -> None:
        """Write what is pending (at the end, the bar no longer shown)."""
        with self._lock:
            rest, self._pending = self._pending, ""
        if rest:
            self._stream.write(rest)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextmanager
def logs_above(bar: Any, loggers: tuple[str, ...] = CONSOLE_LOGGERS) -> Iterator[None]:
    """While the tqdm ``bar`` is shown, nothing shares a terminal line with it: every console handler of
    ``loggers`` writes a record with the bar cleared first and drawn again after, and so does whatever else writes
    to ``sys.stderr`` / ``sys.stdout`` (warnings, prints, Ray's worker output), a whole line at a time.

    The handlers stay (their level, filter and format); only their ``emit`` is wrapped, and restored on exit. The
    bar is cleared on the stream it draws on (``bar.fp``), even when ``sys.stderr`` was swapped since it was made.
    Handlers that write to whatever ``sys.stderr`` is (hacrl-fed's own) go through the wrapped stream instead.
    """
    from tqdm import tqdm

    streams = {"stderr": _AboveBar(sys.stderr, bar), "stdout": _AboveBar(sys.stdout, bar)}
    before = {name: getattr(sys, name) for name in streams}
    wrapped = []
    for name in loggers:
        for handler in logging.getLogger(name or None).handlers:
            if not isinstance(handler, logging.StreamHandler) or isinstance(
                handler, (logging.FileHandler, _StderrHandler)
            ):
                continue
            if "emit" in vars(handler):  # already wrapped (a logger shares a handler)
                continue

            def emit(record: logging.LogRecord, _emit: Any = handler.emit) -> None:
                with tqdm.external_write_mode(file=bar.fp):
                    _emit(record)

            handler.emit = emit  # type: ignore[method-assign]
            wrapped.append(handler)
    for name, stream in streams.items():
        setattr(sys, name, stream)
    try:
        yield
    finally:
        for name, stream in streams.items():
            if getattr(sys, name) is stream:  # not swapped again meanwhile
                setattr(sys, name, before[name])
            stream.close_line()
        for handler in wrapped:
            del handler.emit


def apply_env(env: Mapping[str, str], environ: Any = None) -> dict[str, str]:
    """Set each variable of ``env`` that ``environ`` (default ``os.environ``) does not set yet; what was set."""
    environ = os.environ if environ is None else environ
    added = {k: v for k, v in env.items() if k not in environ}
    environ.update(added)
    return added


# ------------------------------------------------------------------------------------------------ the run


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


class Run:
    """One session of a run in ``run_dir`` (a new run, or a resume), from the config to the final table.

    ::

        with Run(cfg, run_dir, transport="grpc", resume=False) as run:   # claims the dir, config.yaml, logger
            transport = ...                                             # failures from here on: error.log
            summary = run.execute(transport)                            # Coordinator.run(), plot, summary.txt
        print(run.table)

    ``transport``: one of :data:`TRANSPORTS`; ``keys``: how the entry point names resume / run dir (errors);
    ``progress``: a per-round progress bar on stderr when that is a terminal (log lines print above it; plain lines
    elsewhere, :func:`progress_shown`); ``flower_run_id``: recorded next to the hacrl run id; ``entry``: the
    command, for ``run_info.json``.
    """

    def __init__(
        self,
        cfg: Any,
        run_dir: str | Path,
        *,
        transport: str,
        resume: bool = False,
        keys: EntryKeys = CLI_KEYS,
        progress: bool = False,
        flower_run_id: int | None = None,
        entry: str = "hacrl-fed run",
        tensorboard: bool = True,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r}: expected one of {sorted(TRANSPORTS)}")
        self.cfg, self.transport, self.resume, self.keys = cfg, transport, resume, keys
        self.run_dir = Path(run_dir).expanduser().absolute()
        self.progress, self.flower_run_id, self.entry, self.tensorboard = progress, flower_run_id, entry, tensorboard
        self.run_id: str | None = None
        self.coordinator: Any = None
        self.summary: Any = None
        self.table: str | None = None
        self.error_log: Path | None = None
        self.logger: Any = None
        self._stack = ExitStack()
        self._bar: Any = None
        self._on_round: Any = None
        self._session: dict[str, Any] = {}
        self._earlier: list[dict[str, Any]] = []

    # -- files

    def write_config(self) -> Path:
        """``config.yaml``: the resolved config, headed by the real transport (module docstring)."""
        import yaml

        data = self.cfg.model_dump(mode="json")
        data["federation"]["transport"] = TRANSPORTS[self.transport]
        head = (
            f"# hacrl-fed: the resolved config of the run in this directory, as last started by {self.entry}\n"
            f"# transport: {self.transport}\n"
        )
        path = self.run_dir / CONFIG_FILE
        path.write_text(head + yaml.safe_dump(data, sort_keys=False))
        return path

    def _earlier_sessions(self) -> list[dict[str, Any]]:
        """The sessions ``run_info.json`` already lists (a resume continues the list; a new run starts one)."""
        path = self.run_dir / INFO_FILE
        try:
            old = json.loads(path.read_text()) if self.resume and path.is_file() else {}
        except (OSError, ValueError):
            old = {}
        return [s for s in old.get("sessions", []) if isinstance(s, dict)] if isinstance(old, dict) else []

    def info(self) -> dict[str, Any]:
        """The current ``run_info.json`` content."""
        return {
            "run_id": self.run_id,
            "run_dir": str(self.run_dir),
            "transport": self.transport,
            "flower_run_id": self.flower_run_id,
            "status": self._session.get("status"),
            "sessions": self._earlier + [self._session],
        }

    def _write_info(self, status: str, **extra: Any) -> None:
        self._session.update(status=status, **extra)
        if status != "running":
            self._session["finished"] = _now()
        write_json_atomic(self.run_dir / INFO_FILE, self.info())

    def _existing_run_id(self) -> str | None:
        try:
            return json.loads((self.run_dir / STATE_FILE).read_text()).get("run_id")
        except (OSError, ValueError, AttributeError):
            return None

    # -- the lifecycle

    def __enter__(self) -> Run:
        check_run_dir(self.run_dir, self.resume, self.keys)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.run_id = self._existing_run_id() if self.resume else None
        self._earlier = self._earlier_sessions()
        self._session = {
            "entry": self.entry,
            "transport": self.transport,
            "flower_run_id": self.flower_run_id,
            "resumed": self.resume,
            "started": _now(),
            "status": "starting",
        }
        try:
            self.write_config()
            self._write_info("starting")
            self.logger = self._stack.enter_context(RunLogger(self.run_dir, tensorboard=self.tensorboard))
            if self.cfg.wandb.enabled:
                from hacrl_fed.loggers.wandb import open_wandb

                self.logger.sinks.append(open_wandb(self.cfg, self.run_dir, resume=self.resume))
            shown = progress_shown(self.progress)  # a bar on a terminal; plain log lines anywhere else
            self._bar, self._on_round = round_progress(self.cfg.federation.last_round, enabled=shown)
            self._stack.callback(self._bar.close)
            if shown:
                self._stack.enter_context(logs_above(self._bar))
        except BaseException:
            self._stack.close()
            raise
        flower = f" (Flower run {self.flower_run_id})" if self.flower_run_id is not None else ""
        log.info(
            "%s%s: %s over %s, outputs in %s",
            self.entry,
            flower,
            "resuming the run" if self.resume else "a new run",
            self.transport,
            self.run_dir,
        )
        return self

    def execute(self, transport: Any, **coordinator_kw: Any) -> Any:
        """Run the coordinator over ``transport`` to the last round, then :meth:`finish`; the ``RunSummary``."""
        from hacrl_fed.coordinator.loop import Coordinator

        self.coordinator = Coordinator(
            self.cfg,
            transport,
            self.run_dir,
            logger=self.logger,
            resume=self.resume,
            on_round=self._on_round,
            **coordinator_kw,
        )
        self.run_id = self.coordinator.run_id
        self._bar.update(self.coordinator.round)  # rounds already done when resuming
        self._write_info("running")
        return self.finish(self.coordinator.run())

    def finish(self, summary: Any) -> Any:
        """``accuracy.png``, ``summary.txt`` (the table, the run ids, the output path), ``report.html``, status
        ``completed``."""
        self.summary, self.run_id = summary, summary.run_id
        plot_accuracy(self.run_dir, title=f"{self.cfg.name}: held-out accuracy (greedy), run {summary.run_id}")
        flower = f", Flower run id {self.flower_run_id}" if self.flower_run_id is not None else ""
        self.table = (
            f"{format_table(summary)}\n"
            f"hacrl run id {summary.run_id}{flower}; transport {self.transport}\n"
            f"outputs in {self.run_dir}"
        )
        (self.run_dir / SUMMARY_FILE).write_text(self.table + "\n")
        finish_report(self.run_dir, getattr(self.logger, "sinks", ()))  # report.html, W&B samples (hacrl_fed.report)
        self._write_info("completed", rounds_completed=summary.rounds_completed)
        return summary

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> Literal[False]:
        self._stack.close()
        if exc_type is None:
            return False
        interrupted = issubclass(exc_type, KeyboardInterrupt)
        if not interrupted:
            self.error_log = self.run_dir / ERROR_LOG
            with self.error_log.open("a") as f:  # after any line a dying worker left there (worker_deaths)
                f.write("".join(traceback.format_exception(exc_type, exc, tb)))
        try:
            rounds = self.coordinator.round if self.coordinator is not None else None
            self._write_info(
                "interrupted" if interrupted else "failed", error=f"{exc_type.__name__}: {exc}", rounds_completed=rounds
            )
        except Exception as err:  # never hide the run's own error behind a bookkeeping one
            log.warning("could not update %s: %s", self.run_dir / INFO_FILE, err)
        return False
