"""``hacrl-fed bench system``: what federation costs, measured side by side in one run.

    hacrl-fed bench system [--config configs/demo.yaml] [--rounds 4] [--repeats 2] [--out benchmarks/system]

1. **Transports** on the demo config: in-process, gRPC worker processes and the Flower Simulation Engine, each
   run ``--repeats`` times, the order rotated every repeat (in-process, gRPC, Flower; then gRPC, Flower,
   in-process; ...) so that drift of the shared machine hits every transport alike. Every run is a fresh
   subprocess with the same seed (the same prompts, the same rollouts), ``--rounds`` rounds, evaluation only
   before round 1 and after the last (on ``--eval-size`` prompts; never inside ``time/round``). Per round, from
   ``metrics.jsonl``: the round's wall time and its phases summed over orgs (generate, verify, re-tokenize /
   score, train, trust = signing + screening by the coordinator and the learners, exchange = call time minus
   the worker's own compute), the coordinator's own share, and bytes on the wire. Medians over the warm rounds
   (round 1 of each run excluded when there are 3 rounds or more) of all repeats; the overhead ratio of a transport
   is its median round time over in-process's.
2. **Wire bytes per rollout** against the rollout's text: the generate reply per rollout and the train request per
   foreign rollout (protobuf for gRPC, message payloads for Flower) next to the mean UTF-8 size of a response's
   text (measured by the in-process and gRPC runs; the same seed gives the same text on every transport).
3. **Scaling** with 2, 4 and 8 orgs (``--scale-orgs``) of micro agents (alternating ``micro-qwen-char`` and
   ``micro-gpt2-bpe``) over gRPC (one worker process per org) and/or in-process (``--scale-transport inprocess
   grpc:16``: in this order, gRPC only up to 16 orgs), two messages a round (so the generate and train fan-outs and
   the coordinator's time between them are apart): per-org generate and train time (the train call: screening,
   scoring, update), wall and CPU (the workers' own ``cpu/...`` seconds), the train phase's share of the round, the
   foreign rows each org trained on, the coordinator's own time and CPU per round, peak RSS per process (the
   coordinator's from its own ``getrusage``, each worker's from the ``perf/*/peak_rss_mb`` it reports) and the
   machine's load average before and after each run. ``--scale-selection all successes:1`` repeats it per
   ``trainer.selection`` (rule, budget multiple, split: :func:`selection_overrides`).
4. **Flower deployment engine** on loopback (SuperLink + one SuperNode per org + policy workers, insecure, through
   :mod:`hacrl_tools.deploy_local`) with the micro agents of ``configs/smoke.yaml``: its median round time minus
   the in-process median of the same config (the fixed cost per round), where it goes (per org and phase: call
   time vs the worker's compute, i.e. queueing and the per-message ClientApp process), the one-off start-up
   times of the processes, and where one round message's seconds go, piece by piece, from the SuperNodes' DEBUG
   logs (:mod:`hacrl_tools.bench.deploy_timeline`). ``--deploy-variants TASK/REPLY ...`` repeats the case with other
   SuperExec task polls and ServerApp reply polls (seconds, ``default``), one column each.

Writes ``<out>/system.json`` and prints the tables. Nothing here is timed by the test suite; the aggregation
functions (:func:`phase_rows`, :func:`summarize_rows`, :func:`overhead`, :func:`wire_bytes`) are tested.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from hacrl_fed.lifecycle import OFFLINE_ENV
from hacrl_fed.metrics import read_metrics
from hacrl_tools import code_path

# relative to the working directory (the repository root when run from a checkout)
DEMO = Path("configs") / "demo.yaml"
SMOKE = Path("configs") / "smoke.yaml"
OUT = Path("benchmarks") / "system"
TRANSPORTS = ("inprocess", "grpc", "flower")
POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"
MICRO = ("micro-qwen-char", "micro-gpt2-bpe")
PHASES = ("generate", "verify", "score", "train", "trust", "exchange", "coordinator")
# <org>/cpu/<key> a worker reports -> the per-org row field (org/<org>/<field>)
CPU_KEYS = {"generate": "generate_cpu", "train": "train_cpu", "trust": "screen_cpu", "update": "update_cpu"}


# ------------------------------------------------------------------------------------------------ aggregation


def _orgs(rec: Mapping[str, Any]) -> list[str]:
    return sorted({k.split("/")[1] for k in rec if k.startswith("round/") and k.endswith("/rollouts_received")})


def _sum(rec: Mapping[str, Any], keys: Sequence[str]) -> float:
    return float(sum(float(rec[k]) for k in keys if rec.get(k) is not None))


def _org_fields(rec: Mapping[str, Any], o: str) -> dict[str, float]:
    """Org ``o``'s fields of a :func:`phase_rows` row (``org/<o>/<field>``): its call and compute seconds, the
    generate / train / update / screen split, its selected rows, its own CPU seconds and peak RSS when logged."""
    row: dict[str, float] = {}
    calls = _sum(rec, [f"time/call/{phase}/{o}" for phase in ("generate", "train", "step")])
    compute = _sum(rec, [f"{o}/time/{p}" for p in ("generate", "verify", "seal_sign", "trust", "score", "train")])
    row[f"org/{o}/call"], row[f"org/{o}/compute"] = calls, compute
    row[f"org/{o}/generate"] = _sum(rec, [f"{o}/time/generate"])
    row[f"org/{o}/train"] = _sum(rec, [f"{o}/time/{p}" for p in ("trust", "score", "train")])  # the train call
    row[f"org/{o}/update"] = _sum(rec, [f"{o}/time/train"])
    row[f"org/{o}/screen"] = _sum(rec, [f"{o}/time/trust"])
    if rec.get(f"{o}/select/selected") is not None:
        row[f"org/{o}/selected"] = float(rec[f"{o}/select/selected"])
    for key, name in CPU_KEYS.items():  # the worker's own CPU seconds (its process, all threads)
        if rec.get(f"{o}/cpu/{key}") is not None:
            row[f"org/{o}/{name}"] = float(rec[f"{o}/cpu/{key}"])
    peaks = [
        float(v) for k, v in rec.items() if k.startswith(f"{o}/perf/") and k.endswith("/peak_rss_mb") and v is not None
    ]
    if peaks:
        row[f"org/{o}/peak_rss_mb"] = max(peaks)
    return row


def phase_rows(records: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
    """One row per training round (``round >= 1`` with ``time/round``): wall seconds, phases summed over orgs,
    the coordinator's own seconds, bytes and rollout counts (see the module docstring)."""
    rows = []
    for rec in records:
        if int(rec.get("round", 0)) < 1 or rec.get("time/round") is None:
            continue
        orgs = _orgs(rec)
        coord_trust = _sum(rec, [f"time/trust/{o}" for o in orgs])
        row = {
            "round": int(rec["round"]),
            "orgs": len(orgs),
            "wall": float(rec["time/round"]),
            "generate_fanout": float(rec.get("time/generate") or 0.0),
            "train_fanout": float(rec.get("time/train") or 0.0),
            "step_fanout": float(rec.get("time/step") or 0.0),  # federation.protocol: fused
            "generate": _sum(rec, [f"{o}/time/generate" for o in orgs]),
            "verify": _sum(rec, [f"{o}/time/verify" for o in orgs]),
            "score": _sum(rec, [f"{o}/time/score" for o in orgs]),
            "train": _sum(rec, [f"{o}/time/train" for o in orgs]),
            "trust": coord_trust + _sum(rec, [f"{o}/time/trust" for o in orgs] + [f"{o}/time/seal_sign" for o in orgs]),
            "exchange": _sum(rec, [k for k in rec if k.startswith("time/exchange/")]),
            "coordinator": float(rec["time/round"])
            - float(rec.get("time/generate") or 0.0)
            - float(rec.get("time/train") or 0.0)
            - float(rec.get("time/step") or 0.0),
            "rollouts": _sum(rec, [f"round/{o}/rollouts_received" for o in orgs]),
            "foreign": _sum(rec, [f"{o}/train/foreign_received" for o in orgs]),
            "messages": _sum(rec, [f"round/{o}/messages" for o in orgs]),  # the transport's counter, all orgs
        }
        for phase in ("generate", "train", "step"):
            if rec.get(f"bytes/{phase}/total") is not None:
                row[f"bytes_{phase}"] = float(rec[f"bytes/{phase}/total"])
        row["train_share"] = row["train_fanout"] / row["wall"] if row["wall"] > 0 else 0.0
        for o in orgs:
            row.update(_org_fields(rec, o))
        gen_cpu = _sum(rec, [f"{o}/cpu/generate" for o in orgs])
        train_cpu = _sum(rec, [f"{o}/cpu/train" for o in orgs])
        if gen_cpu + train_cpu > 0:
            row["generate_cpu"], row["train_cpu"] = gen_cpu, train_cpu
            row["cpu_train_share"] = train_cpu / (gen_cpu + train_cpu)
        rows.append(row)
    return rows


def warm(rows: Sequence[Mapping[str, float]]) -> list[Mapping[str, float]]:
    """Rows without each run's first round when the run has 3 rounds or more (start-up effects)."""
    return [r for r in rows if r["round"] > 1] if len(rows) >= 3 else list(rows)


def summarize_rows(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Median of every field over ``rows`` (fields missing in a row are left out of its median); peaks: max."""
    keys = sorted({k for r in rows for k in r if k != "round"})
    out = {}
    for k in keys:
        vals = [float(r[k]) for r in rows if k in r]
        out[k] = max(vals) if k.endswith("peak_rss_mb") else statistics.median(vals)
    out["n_rounds"] = float(len(rows))
    return out


def overhead(summaries: Mapping[str, Mapping[str, float]], base: str = "inprocess") -> dict[str, float]:
    """``{transport: median round wall / base's median round wall}``."""
    ref = summaries.get(base, {}).get("wall")
    return {t: s["wall"] / ref for t, s in summaries.items() if ref and "wall" in s}


def wire_bytes(summary: Mapping[str, float], text_bytes_per_rollout: float | None) -> dict[str, float | None]:
    """Bytes on the wire per rollout (generate reply + plan, per rollout generated; train request + report, per
    foreign rollout delivered) and their ratio to the response text's mean UTF-8 size."""
    gen = summary.get("bytes_generate")
    train = summary.get("bytes_train")
    per_gen = gen / summary["rollouts"] if gen is not None and summary.get("rollouts") else None
    per_train = train / summary["foreign"] if train is not None and summary.get("foreign") else None

    def ratio(x: float | None) -> float | None:
        return x / text_bytes_per_rollout if x is not None and text_bytes_per_rollout else None

    return {
        "generate_bytes_per_rollout": per_gen,
        "train_bytes_per_foreign_rollout": per_train,
        "text_bytes_per_rollout": text_bytes_per_rollout,
        "generate_vs_text": ratio(per_gen),
        "train_vs_text": ratio(per_train),
    }


# ------------------------------------------------------------------------------------------------ child runs


class TextMeter:
    """Wraps a transport: counts the rollouts and response-text bytes of every step reply's batch (delegates
    everything else, ``last_call_seconds`` / ``last_call_bytes`` included). CPU seconds come from the workers'
    own ``cpu/...`` metrics."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.rollouts = 0
        self.text_bytes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _count(self, batches) -> None:
        for batch in batches:
            for r in getattr(batch, "rollouts", ()) or ():
                self.rollouts += 1
                self.text_bytes += len(str(r.response).encode())

    def step(self, requests, timeout_s):  # every round is a step (either protocol)
        replies = self.inner.step(requests, timeout_s)
        self._count(getattr(reply, "batch", None) for reply in replies.values())
        return replies

    def evaluate(self, requests, timeout_s):
        return self.inner.evaluate(requests, timeout_s)

    def checkpoint(self, org_ids, round, timeout_s):
        return self.inner.checkpoint(org_ids, round, timeout_s)

    def org_ids(self):
        return self.inner.org_ids()


def _peak_rss_self_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


@dataclass(frozen=True)
class ChildRun:
    """What :func:`run_child` asks its child process (``_child SPEC_JSON``) to run."""

    kind: str  # one of TRANSPORTS
    config: str
    run_dir: str
    out: str  # where the child writes its report (JSON)
    overrides: list[str]


def child_main(argv: Sequence[str]) -> int:
    """``_child SPEC_JSON`` (a :class:`ChildRun`): one run in this process (the coordinator's), then its peak RSS
    and text counts to ``out``."""
    if len(argv) != 1:
        raise SystemExit("usage: python -m hacrl_tools.bench.system _child SPEC_JSON")
    args = ChildRun(**json.loads(argv[0]))
    if args.kind not in TRANSPORTS:
        raise SystemExit(f"_child: kind {args.kind!r} is not one of {TRANSPORTS}")
    import logging

    logging.basicConfig(level=logging.WARNING)
    from hacrl_fed.config import load_config

    run_dir = Path(args.run_dir)
    cfg = load_config(args.config, overrides=list(args.overrides))
    info: dict[str, Any] = {"kind": args.kind}
    t0 = time.perf_counter()
    if args.kind == "flower":
        from hacrl_fed.flower.simulation import simulate
        from hacrl_fed.lifecycle import setup_logging

        setup_logging("WARNING")
        simulate(args.config, list(args.overrides), run_dir=run_dir)
    else:
        from hacrl_fed.coordinator.loop import Coordinator
        from hacrl_fed.metrics import RunLogger

        run_dir.mkdir(parents=True, exist_ok=True)
        procs = None
        inner: Any
        if args.kind == "grpc":
            inner, procs = _grpc_workers(args, cfg, run_dir)
        else:
            from hacrl_fed.coordinator.inprocess import InProcessTransport
            from hacrl_fed.worker import build_worker

            inner = InProcessTransport({o.id: build_worker(cfg, o.id, run_dir=run_dir) for o in cfg.orgs})
        info["setup_s"] = time.perf_counter() - t0
        meter = TextMeter(inner)
        c0 = time.process_time()
        try:
            with RunLogger(run_dir, tensorboard=False) as logger:
                Coordinator(cfg, meter, run_dir, logger=logger).run()  # type: ignore[arg-type]  # duck-typed wrapper
        finally:
            info["run_cpu_s"] = time.process_time() - c0  # this process: the coordinator (in-process: everything)
            inner.close()
            if procs is not None:
                procs.close()
        info.update(rollouts_seen=meter.rollouts, text_bytes=meter.text_bytes)
    info["wall_s"] = time.perf_counter() - t0
    info["coordinator_peak_rss_mb"] = _peak_rss_self_mb()
    Path(args.out).write_text(json.dumps(info))
    return 0


def _grpc_workers(args: ChildRun, cfg: Any, run_dir: Path) -> tuple[Any, Any]:
    """``(transport, worker processes)``: one gRPC worker process per org, started and ready."""
    from hacrl_fed.coordinator.grpc_transport import GrpcTransport
    from hacrl_fed.coordinator.launcher import WorkerProcesses

    procs = WorkerProcesses(
        args.config,
        [o.id for o in cfg.orgs],
        run_dir=run_dir,
        overrides=list(args.overrides),
        worker_args=["--run-dir", str(run_dir)],
    )
    addresses = procs.start()
    inner = GrpcTransport(addresses, max_message_mb=cfg.federation.max_message_mb, secrets=procs.secrets)
    bad = {o: e for o, e in inner.wait_ready(600).items() if isinstance(e, Exception)}
    if bad:
        raise RuntimeError(f"workers not ready: {bad}")
    return inner, procs


def child_env(flwr_home: Path) -> dict[str, str]:
    env = {**os.environ, **OFFLINE_ENV, "FLWR_HOME": str(flwr_home), "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (code_path(), env.get("PYTHONPATH")) if p)
    return env


def run_child(
    kind: str, config: Path, overrides: Sequence[str], work: Path, name: str, timeout_s: float = 1800
) -> dict[str, Any]:
    """One run in a fresh subprocess; its records, phase rows and the child's report."""
    run_dir = work / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    out = work / f"{name}.child.json"
    home = Path(tempfile.mkdtemp(prefix="flwr-home-"))
    spec = ChildRun(kind, str(config), str(run_dir), str(out), list(overrides))
    cmd = [sys.executable, "-m", "hacrl_tools.bench.system", "_child", json.dumps(asdict(spec))]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(home), timeout=timeout_s)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} run {name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    info = json.loads(out.read_text())
    info["process_wall_s"] = time.perf_counter() - t0
    records = read_metrics(run_dir)
    return {"info": info, "rows": phase_rows(records)}


# ------------------------------------------------------------------------------------------------ parts


def bench_transports(
    config: Path,
    transports: Sequence[str],
    rounds: int,
    repeats: int,
    eval_size: int,
    extra: Sequence[str],
    work: Path,
    log=print,
) -> dict[str, Any]:
    overrides = [
        f"federation.rounds={rounds}",
        "federation.eval_every=0",
        f"task.eval_size={eval_size}",
        "federation.checkpoint_every=0",
        *extra,
    ]
    rows: dict[str, list] = {t: [] for t in transports}
    runs: list[dict[str, Any]] = []
    text = {"rollouts": 0, "bytes": 0}
    for rep in range(repeats):
        order = list(transports[rep % len(transports) :]) + list(transports[: rep % len(transports)])
        for t in order:
            log(f"  transports: repeat {rep + 1}/{repeats}, {t} ...")
            res = run_child(t, config, overrides, work, f"transport-{t}-{rep}")
            rows[t] += warm(res["rows"])
            info = res["info"]
            text["rollouts"] += info.get("rollouts_seen", 0)
            text["bytes"] += info.get("text_bytes", 0)
            runs.append(
                {
                    "transport": t,
                    "repeat": rep,
                    "process_wall_s": info["process_wall_s"],
                    "setup_s": info.get("setup_s"),
                    "coordinator_peak_rss_mb": info["coordinator_peak_rss_mb"],
                    "round_wall_s": [r["wall"] for r in res["rows"]],
                }
            )
    summaries = {t: summarize_rows(r) for t, r in rows.items() if r}
    text_per = text["bytes"] / text["rollouts"] if text["rollouts"] else None
    return {
        "config": str(config),
        "overrides": overrides,
        "rounds": rounds,
        "repeats": repeats,
        "runs": runs,
        "summary": summaries,
        "overhead_vs_inprocess": overhead(summaries),
        "wire": {t: wire_bytes(s, text_per) for t, s in summaries.items() if t != "inprocess"},
    }


def scaling_config(n: int, work: Path) -> Path:
    """A smoke-sized config with ``n`` micro orgs (ids org0..), written under ``work``."""
    data = yaml.safe_load(SMOKE.read_text())
    data["name"] = f"scale{n}"
    data["orgs"] = [{"id": f"org{i}", "model": {"zoo": MICRO[i % 2]}} for i in range(n)]
    data["federation"] = {**data["federation"], "min_orgs": 1}
    path = work / f"scale{n}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def selection_overrides(spec: str) -> list[str]:
    """``RULE`` (no budget), ``RULE:MULTIPLE`` (``successes:1``: that budget, pooled) or ``RULE:MULTIPLE:SPLIT``
    (``successes:0.5:per_source``) as config overrides of every org's ``trainer.selection``. A spec states the
    whole budget, whatever the defaults (issue 27 gave them one), so a scaling command measures what it says."""
    rule, _, rest = spec.partition(":")
    multiple, _, split = rest.partition(":")
    out = [f"trainer.selection.rule={rule}"]
    if not multiple:
        return out + ["trainer.selection.budget_multiple=null"]
    return out + [
        f"trainer.selection.budget_multiple={float(multiple)}",
        f"trainer.selection.budget_split={split or 'pooled'}",
    ]


def _median_over(s: Mapping[str, float], orgs: Sequence[str], field: str) -> float | None:
    values = [s[f"org/{o}/{field}"] for o in orgs if f"org/{o}/{field}" in s]
    return statistics.median(values) if values else None


def parse_scale_transport(text: str) -> tuple[str, int | None]:
    """``TRANSPORT`` or ``TRANSPORT:MAX_ORGS`` (``grpc:16``: org counts above 16 are skipped on gRPC)."""
    name, _, cap = text.partition(":")
    if name not in ("grpc", "inprocess"):
        raise ValueError(f"{text!r}: the transport is grpc or inprocess")
    try:
        return name, (int(cap) if cap else None)
    except ValueError:
        raise ValueError(f"{text!r}: the org cap after ':' is an integer") from None


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on this platform
        return None


def scaling_point(res: Mapping[str, Any], rounds: int) -> dict[str, Any]:
    """One org count's medians (per org: median over orgs of each org's median over the warm rounds)."""
    s = summarize_rows(warm(res["rows"]))
    orgs = sorted({k.split("/")[1] for k in s if k.startswith("org/")})
    info = res["info"]
    out = {
        "round_wall_s": s["wall"],
        "coordinator_s_per_round": s["coordinator"],  # the round's wall time outside the fan-outs
        "train_share": s["train_share"],  # the train fan-out's share of the round's wall time (two_message)
        "cpu_train_share": s.get("cpu_train_share"),  # train CPU / (generate + train CPU), all orgs
        "per_org_call_s": _median_over(s, orgs, "call"),
        "per_org_compute_s": _median_over(s, orgs, "compute"),
        "per_org_generate_s": _median_over(s, orgs, "generate"),
        "per_org_train_s": _median_over(s, orgs, "train"),  # the train call: screening, scoring, update
        "per_org_update_s": _median_over(s, orgs, "update"),
        "per_org_screen_s": _median_over(s, orgs, "screen"),  # verifying and screening foreign rollouts
        "per_org_generate_cpu_s": _median_over(s, orgs, "generate_cpu"),
        "per_org_train_cpu_s": _median_over(s, orgs, "train_cpu"),
        "per_org_screen_cpu_s": _median_over(s, orgs, "screen_cpu"),
        "per_org_update_cpu_s": _median_over(s, orgs, "update_cpu"),
        "per_org_foreign_selected": _median_over(s, orgs, "selected"),
        "coordinator_peak_rss_mb": info["coordinator_peak_rss_mb"],
        # the coordinator process's CPU per round, evaluations included (in-process: every org's work too)
        "coordinator_cpu_s_per_round": info["run_cpu_s"] / rounds if info.get("run_cpu_s") is not None else None,
        "worker_peak_rss_mb": {o: s.get(f"org/{o}/peak_rss_mb") for o in orgs},
        "setup_s": info.get("setup_s"),
        "rounds": s["n_rounds"],
        "loadavg_before": res.get("loadavg_before"),
        "loadavg_after": res.get("loadavg_after"),
    }
    return out


def bench_scaling(
    counts: Sequence[int],
    rounds: int,
    work: Path,
    transport: str = "grpc",
    log=print,
    selections: Sequence[str] = (),
    max_orgs: int | None = None,
) -> dict[str, Any]:
    """Each org count (at most ``max_orgs``) once per selection spec (``all``, ``successes:1``:
    :func:`selection_overrides`; none: the config's own), per-org medians of the warm rounds
    (:func:`scaling_point`), with the machine's load average before and after each run."""
    variants = {spec: selection_overrides(spec) for spec in selections} or {"config": []}
    out: dict[str, Any] = {label: {"set": extra, "orgs": {}} for label, extra in variants.items()}
    for n in counts:  # the variants of one org count back to back, so drift of the machine hits them alike
        if max_orgs is not None and n > max_orgs:
            continue
        for label, extra in variants.items():
            log(f"  scaling: {n} orgs over {transport}, selection {label} ...")
            cfg = scaling_config(n, work)
            before = _loadavg()
            res = run_child(
                transport,
                cfg,
                # two messages a round: the generate and train fan-outs, and the coordinator's time between them,
                # are timed apart (the fused message mixes round t's train with round t + 1's generate)
                [
                    f"federation.rounds={rounds}",
                    "federation.eval_every=0",
                    "task.eval_size=8",
                    "federation.protocol=two_message",
                    *extra,
                ],
                work,
                f"scale-{n}",
            )
            res.update(loadavg_before=before, loadavg_after=_loadavg())
            out[label]["orgs"][str(n)] = scaling_point(res, rounds)
    return {"transport": transport, "rounds": rounds, "variants": out}


def _deployment_settings(
    overrides: list[str], run_dir: Path, task_poll_s: float | None, reply_poll_s: float | None
) -> tuple[dict[str, str], dict[str, Any]]:
    """The processes' extra environment (DEBUG logs for the timeline, the SuperExec poll when given) and the run
    config the ServerApp gets (the smoke config, ``overrides``, ``run_dir``, the reply poll when given)."""
    env = {"FLWR_LOG_LEVEL": "DEBUG"}
    if task_poll_s is not None:
        env[POLL_ENV] = str(task_poll_s)
    run_config: dict[str, Any] = {
        "config-path": str(SMOKE.absolute()),
        "overrides": " ".join(overrides),
        "run-dir": str(run_dir),
    }
    if reply_poll_s is not None:
        run_config["reply-poll"] = reply_poll_s
    return env, run_config


def _run_deployment(
    dep_dir: Path, env: dict[str, str], orgs: list[str], overrides: list[str], run_config: dict, timeout_s: float
) -> tuple[float, float, dict[str, Any], dict[str, Any]]:
    """One run of the smoke config on a loopback deployment in ``dep_dir``: ``(seconds to a ready deployment, the
    run's seconds, the processes' timings, the SuperNodes' message timeline)``; an error unless it completed."""
    from hacrl_tools.bench.deploy_timeline import timeline
    from hacrl_tools.deploy_local import Deployment, start_local

    t0 = time.perf_counter()
    with Deployment(dep_dir, extra_env=env) as dep:
        start_local(dep, SMOKE, orgs, overrides=overrides)
        started = time.perf_counter() - t0
        t1 = time.perf_counter()
        run_id = dep.submit(Path.cwd(), run_config)
        info = dep.wait_run(run_id, timeout_s)
        run_s = time.perf_counter() - t1
        processes = dep.timings()
        pieces = timeline(p.log_text() for p in dep.procs if p.name.startswith("supernode-"))
    if info.get("status") != "finished:completed":
        raise RuntimeError(f"deployment run ended {info.get('status')}")
    return started, run_s, processes, pieces


def _org_calls(o: str, dep_s: Mapping[str, Any], in_s: Mapping[str, Any]) -> dict[str, Any]:
    """Org ``o``'s call and compute seconds on the deployment, its in-process call, and the time outside it."""
    out = {
        "call_s": dep_s.get(f"org/{o}/call"),
        "compute_s": dep_s.get(f"org/{o}/compute"),
        "inprocess_call_s": in_s.get(f"org/{o}/call"),
    }
    if out["call_s"] is not None and out["compute_s"] is not None:
        out["outside_worker_s"] = out["call_s"] - out["compute_s"]
    return out


def bench_deployment(
    rounds: int,
    work: Path,
    log=print,
    timeout_s: float = 900,
    *,
    task_poll_s: float | None = None,
    reply_poll_s: float | None = None,
) -> dict[str, Any]:
    """The Flower deployment engine on loopback with the smoke config vs the same config in-process.

    ``task_poll_s`` sets the SuperExecs' ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` and ``reply_poll_s`` the ServerApp's
    ``reply-poll`` (None: the harness's and the app's defaults). The SuperNodes log at ``FLWR_LOG_LEVEL=DEBUG``
    (timestamps): ``timeline`` is :func:`hacrl_tools.bench.deploy_timeline.timeline` of their logs, the median
    seconds of each piece of a round message's cycle.
    """
    from hacrl_fed.flower.settings import REPLY_POLL_S
    from hacrl_tools.deploy_local import FAST_POLL_ENV, identity_overrides

    base = [f"federation.rounds={rounds}", "federation.eval_every=0", "task.eval_size=8"]
    log("  deployment: in-process baseline ...")
    inproc = run_child("inprocess", SMOKE, base, work, "deploy-inprocess")
    from hacrl_fed.config import load_config

    orgs = [o.id for o in load_config(SMOKE, base).orgs]
    dep_dir = Path(tempfile.mkdtemp(prefix="hacrl-deploy-"))  # short: unix socket paths must fit
    overrides = [*base, *identity_overrides(dep_dir / "identity_set", orgs)]
    run_dir = dep_dir / "run"
    log("  deployment: SuperLink + SuperNodes + workers on loopback ...")
    env, run_config = _deployment_settings(overrides, run_dir, task_poll_s, reply_poll_s)
    try:
        started, run_s, processes, pieces = _run_deployment(dep_dir, env, orgs, overrides, run_config, timeout_s)
        rows = phase_rows(read_metrics(run_dir))
    finally:
        shutil.rmtree(dep_dir, ignore_errors=True)
    dep_s, in_s = summarize_rows(warm(rows)), summarize_rows(warm(inproc["rows"]))
    where = {o: _org_calls(o, dep_s, in_s) for o in orgs}
    return {
        "config": str(SMOKE),
        "rounds": rounds,
        "task_poll_s": float(env.get(POLL_ENV) or os.environ.get(POLL_ENV) or FAST_POLL_ENV[POLL_ENV]),
        "reply_poll_s": REPLY_POLL_S if reply_poll_s is None else reply_poll_s,
        "timeline": pieces,
        "start_s": started,
        "run_s": run_s,
        "processes": processes,
        "round_wall_s": dep_s["wall"],
        "inprocess_round_wall_s": in_s["wall"],
        "fixed_cost_per_round_s": dep_s["wall"] - in_s["wall"],
        "generate_fanout_s": dep_s["generate_fanout"],
        "train_fanout_s": dep_s["train_fanout"],
        "step_fanout_s": dep_s["step_fanout"],
        "coordinator_s": dep_s["coordinator"],
        "exchange_s": dep_s["exchange"],
        "per_org": where,
        "clientapp_messages_per_round": dep_s["messages"],
        # every message runs in a new flwr-clientapp process: the time outside the workers, per message
        "outside_worker_s_per_message": dep_s["exchange"] / max(dep_s["messages"], 1.0),
    }


# ------------------------------------------------------------------------------------------------ printing


def _f(x: Any, d: int = 3) -> str:
    return "–" if x is None else f"{x:.{d}f}"


def format_tables(result: Mapping[str, Any]) -> str:
    """The printed report: the transports' phases and wire bytes, the scaling runs, the deployment engine."""
    lines = []
    tr = result.get("transports")
    if tr:
        lines += format_transports(tr)
    scaling = result.get("scaling") or []
    for sc in [scaling] if isinstance(scaling, Mapping) else scaling:  # a dict: one transport (older results)
        lines += format_scaling(sc)
    dp = result.get("deployment")
    if dp:
        lines += format_deployment(dp, result.get("deployment_variants") or [dp])
    return "\n".join(lines)


def format_transports(tr: Mapping[str, Any]) -> list[str]:
    """Per-round phases per transport and the wire bytes per rollout against its text."""
    lines = [
        f"Per-round phases, medians over warm rounds ({tr['rounds']} rounds x {tr['repeats']} repeats; "
        "phases summed over orgs, seconds):",
        "",
    ]
    head = ["transport", "round", "x in-process", *PHASES]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join("---" for _ in head) + "|")
    for t, s in tr["summary"].items():
        lines.append(
            "| "
            + " | ".join([t, _f(s["wall"]), _f(tr["overhead_vs_inprocess"].get(t), 2), *[_f(s.get(p)) for p in PHASES]])
            + " |"
        )
    lines += [
        "",
        "Wire bytes per rollout vs its text:",
        "",
        "| transport | generate B/rollout | train B/foreign rollout | text B/rollout | generate / text "
        "| train / text |",
        "|---|---|---|---|---|---|",
    ]
    for t, w in tr["wire"].items():
        lines.append(
            f"| {t} | {_f(w['generate_bytes_per_rollout'], 0)} | {_f(w['train_bytes_per_foreign_rollout'], 0)} "
            f"| {_f(w['text_bytes_per_rollout'], 1)} | {_f(w['generate_vs_text'], 1)} "
            f"| {_f(w['train_vs_text'], 1)} |"
        )
    lines.append("")
    return lines


def format_deployment(dp: Mapping[str, Any], variants: Sequence[Mapping[str, Any]]) -> list[str]:
    """The Flower deployment engine's round: fixed cost, fan-outs, per-org calls, start-up, then the timelines of
    ``variants``."""
    lines = [
        "Flower deployment engine on loopback (smoke config, medians per round):",
        "",
        f"- round: {_f(dp['round_wall_s'], 2)} s vs {_f(dp['inprocess_round_wall_s'], 2)} s in-process: "
        f"fixed cost {_f(dp['fixed_cost_per_round_s'], 2)} s per round "
        f"({dp['clientapp_messages_per_round']} ClientApp messages per round)",
        f"- generate fan-out {_f(dp['generate_fanout_s'], 2)} s, train fan-out {_f(dp['train_fanout_s'], 2)} s, "
        f"fused step fan-out {_f(dp.get('step_fanout_s'), 2)} s, "
        f"coordinator {_f(dp['coordinator_s'], 3)} s, exchange (call minus worker compute, all orgs) "
        f"{_f(dp['exchange_s'], 2)} s, i.e. {_f(dp['outside_worker_s_per_message'], 2)} s per ClientApp "
        "message (each message starts a new flwr-clientapp process)",
    ]
    for o, w in dp["per_org"].items():
        lines.append(
            f"- {o}: calls {_f(w['call_s'], 2)} s, worker compute {_f(w['compute_s'], 3)} s, outside the "
            f"worker {_f(w.get('outside_worker_s'), 2)} s (in-process calls {_f(w['inprocess_call_s'], 3)} s)"
        )
    ready = {k: v.get("ready_s") for k, v in dp["processes"].items() if v.get("ready_s") is not None}
    lines.append(
        f"- start-up: {_f(dp['start_s'], 1)} s to a ready deployment; ready after (s): "
        + ", ".join(f"{k} {v:.1f}" for k, v in ready.items())
    )
    lines.append("")
    lines += format_timelines(variants)
    return lines


def format_scaling(sc: Mapping[str, Any]) -> list[str]:
    """One table per selection variant of one transport's scaling run."""
    lines: list[str] = []
    variants = sc.get("variants") or {"config": {"set": [], "orgs": sc.get("orgs", {})}}  # older results
    head = [
        "orgs",
        "foreign rows per org",
        "round s",
        "per-org generate s",
        "CPU",
        "per-org train s",
        "CPU",
        "CPU: screening",
        "CPU: update",
        "CPU train share",
        "coordinator s",
        "coordinator CPU s",
        "coordinator peak MiB",
        "worker peak MiB (max)",
        "load 1-min before/after",
    ]
    for label, var in variants.items():
        lines += [
            f"Scaling over {sc['transport']}, selection {label} (micro agents; medians of the warm rounds, per org "
            "the median over orgs; seconds per round; train = the train call: screening, scoring, update; CPU = "
            "the worker's own process CPU seconds):",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "|".join("---" for _ in head) + "|",
        ]
        for n, s in sorted(var["orgs"].items(), key=lambda item: int(item[0])):  # JSON sorts the keys as text
            peaks = [v for v in (s.get("worker_peak_rss_mb") or {}).values() if v is not None]
            load = [x[0] if x else None for x in (s.get("loadavg_before"), s.get("loadavg_after"))]
            cells = [
                n,
                _f(s.get("per_org_foreign_selected"), 0),
                _f(s["round_wall_s"]),
                _f(s.get("per_org_generate_s")),
                _f(s.get("per_org_generate_cpu_s")),
                _f(s.get("per_org_train_s")),
                _f(s.get("per_org_train_cpu_s")),
                _f(s.get("per_org_screen_cpu_s")),
                _f(s.get("per_org_update_cpu_s")),
                _f(s.get("cpu_train_share"), 2),
                _f(s.get("coordinator_s_per_round")),
                _f(s.get("coordinator_cpu_s_per_round")),
                _f(s.get("coordinator_peak_rss_mb"), 0),
                _f(max(peaks) if peaks else None, 0),
                f"{_f(load[0], 1)} / {_f(load[1], 1)}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def format_timelines(variants: Sequence[Mapping[str, Any]]) -> list[str]:
    """One column per deployment run: the median seconds of each piece of a round message's cycle
    (:mod:`hacrl_tools.bench.deploy_timeline`), then the run's fixed cost per round and per message."""
    from hacrl_tools.bench.deploy_timeline import PIECES

    runs = [v for v in variants if v.get("timeline", {}).get("messages")]
    if not runs:
        return []
    head = [f"task poll {_f(v['task_poll_s'], 2)} s, reply poll {_f(v['reply_poll_s'], 2)} s" for v in runs]
    lines = [
        "Where a round message's seconds go (median ± standard error of the mean over the SuperNodes' round "
        "messages, from their DEBUG logs):",
        "",
        "| piece | " + " | ".join(head) + " |",
        "|---" * (len(runs) + 1) + "|",
    ]
    for piece in [p for p, _, _ in PIECES] + ["cycle"]:
        cells = (f"{_f(v['timeline'].get(piece))} ± {_f(v['timeline'].get(piece + '_se'))}" for v in runs)
        lines.append(f"| {piece} | " + " | ".join(cells) + " |")
    lines.append("| messages | " + " | ".join(_f(v["timeline"]["messages"], 0) for v in runs) + " |")
    per_org = [max(v["clientapp_messages_per_round"] // max(len(v["per_org"]), 1), 1) for v in runs]
    per_msg = [v["fixed_cost_per_round_s"] / n for v, n in zip(runs, per_org)]  # an org's messages run in turn
    lines.append("| fixed cost / round | " + " | ".join(_f(v["fixed_cost_per_round_s"], 2) for v in runs) + " |")
    lines.append("| fixed cost / message | " + " | ".join(_f(x, 2) for x in per_msg) + " |")
    return [*lines, ""]


def parse_variant(text: str) -> tuple[float | None, float | None]:
    """``TASK/REPLY`` (seconds, or ``default``) or ``default`` -> ``(task_poll_s, reply_poll_s)``, None = default
    (argparse's type for ``--deploy-variants``: its error is the one-line usage error, exit 2)."""
    parts = ["default", "default"] if text == "default" else text.split("/")
    try:
        if len(parts) != 2:
            raise ValueError
        task, reply = (None if x == "default" else float(x) for x in parts)
    except ValueError:
        raise ValueError(f"{text!r} is not TASK/REPLY (seconds or 'default') nor 'default'") from None
    return task, reply


# ------------------------------------------------------------------------------------------------ command


@dataclass(frozen=True)
class SystemOptions:
    """What ``hacrl-fed bench system`` was asked (:mod:`hacrl_fed.cli.bench` parses it; defaults there)."""

    config: Path
    rounds: int
    repeats: int
    eval_size: int
    transports: list[str]
    scale_orgs: list[int]
    scale_rounds: int
    scale_transport: list[tuple[str, int | None]]  # (transport, largest org count on it or None)
    scale_selection: list[str]
    deploy_rounds: int
    deploy_variants: list[tuple[float | None, float | None]]
    overrides: list[str]
    out: Path
    keep_work: bool


def run_system(opts: SystemOptions) -> int:
    """Every part asked for (transports, scaling, deployment), ``<out>/system.json`` and the printed tables."""
    opts.out.mkdir(parents=True, exist_ok=True)
    # scratch outside the checkout: `flwr run` scans the app dir (the repository) when it packages the app
    work = Path(tempfile.mkdtemp(prefix="hacrl-bench-system-"))
    extra = list(opts.overrides)
    from hacrl_tools.bench.learning import _git_version, machine_info

    result: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": machine_info(),
        "code": _git_version(),
    }
    t0 = time.perf_counter()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        if opts.transports:
            result["transports"] = bench_transports(
                opts.config, opts.transports, opts.rounds, opts.repeats, opts.eval_size, extra, work, log
            )
        if opts.scale_orgs:
            result["scaling"] = [
                bench_scaling(opts.scale_orgs, opts.scale_rounds, work, name, log, opts.scale_selection, cap)
                for name, cap in opts.scale_transport
            ]
        if opts.deploy_rounds:
            variants = [
                bench_deployment(opts.deploy_rounds, work, log, task_poll_s=task, reply_poll_s=reply)
                for task, reply in opts.deploy_variants
            ]
            result["deployment"] = variants[-1]
            if len(variants) > 1:
                result["deployment_variants"] = variants
    finally:
        result["wall_s"] = time.perf_counter() - t0
        (opts.out / "system.json").write_text(json.dumps(result, indent=1, sort_keys=True))
        if opts.keep_work:
            print(f"run dirs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(format_tables(result))
    print(f"system.json: {opts.out / 'system.json'} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":  # the child process of run_child (not a command)
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        raise SystemExit(child_main(sys.argv[2:]))
    raise SystemExit("usage: hacrl-fed bench system (this module's own entry is run_child's child process)")
