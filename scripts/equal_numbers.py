"""Equal numbers (issue 42): seeded short runs whose ``metrics.jsonl`` values must not move under a refactor.

    python scripts/equal_numbers.py --save FILE           # run them, write every value to FILE
    python scripts/equal_numbers.py --check FILE          # run them again, compare with FILE (exit 1 on a change)
    python scripts/equal_numbers.py --check FILE --against CURRENT   # compare two saved files, run nothing
    [--only NAME ...] [--jobs N] [--keep DIR] [--strict-keys]

The runs (:data:`RUNS`), each a fresh process in a fresh temp run dir, from the repository root:

* ``inprocess-fused``, ``inprocess-two-message``, ``grpc`` (worker processes), ``flower-simulation`` (Ray): the
  demo config (configs/demo.yaml: three orgs, the project's defaults, the outcome guard on) shortened to 3 rounds
  of 4 prompts (:data:`DEMO_OVERRIDES`): held-out evaluation before round 1, at round 2 and at the end, the guard's
  validation and its final choice, and train steps on foreign rows (the coverage check below);
* ``inprocess-guard-acts``: ``inprocess-fused`` with the guard's thresholds lowered (:data:`GUARD_ACTS`) so that it
  spares a regression after foreign rows and, at the last round, adopts the shadow's weights;
* ``bench-gspo``, ``bench-hacpo``, ``bench-gspo-x2``: three cells of kept methods of the learning matrix
  (``hacrl-fed bench learning``, setting ``model``, seed 0), 3 rounds, the held-out evaluation shortened.

Each run's values are every key of every record of its ``metrics.jsonl`` except the cost keys of :data:`IGNORED`
(why each is set aside is written there). Values compare by exact equality (floats too: tolerance 0; NaN equals
NaN); a key only in the current run is "added", only in the baseline "removed": listed, failing only with
``--strict-keys``. A record only on one side fails (the run did a different number of rounds or evaluations).

Determinism: every run has one torch thread (``OMP_NUM_THREADS=1``, ``--threads 1``, ``--num-cpus 1``: a
reduction split over another number of threads sums in another order, so the values would depend on the machine's
cores) and ``PYTHONHASHSEED=0``. Two runs of the same commit give identical values (BENCHMARKS.md, "Equal
numbers"); ``--jobs 2`` runs two at a time, each still on one thread, and changes no value.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = 1

# A key is set aside when it is `wall_time` or one of its `/`-separated segments is one of these: each measures what a
# run cost, not what it computed, so it differs between two runs of the same commit or is meant to change under a
# refactor of the same numbers.
IGNORED = {
    "wall_time": "the Unix time the record was written",
    "time": "durations in seconds (time/round, time/call/step/<org>, <org>/time/train, eval/<org>/time/eval, ...)",
    "cpu": "CPU seconds of a phase (<org>/cpu/generate, <org>/cpu/train, ...)",
    "bytes": "wire sizes of the messages (bytes/step/<org>): encoding and envelopes, not learning (issue 42 sets "
    "them aside)",
    "perf": "the cost profile of a phase (<org>/perf/<phase>/seconds, tokens_per_s, peak_rss_mb vary run to run; "
    "tokens counts the tokens the phase processed, which a refactor that scores a row once instead of three times "
    "is meant to change; what was generated is gen/mean_tokens, kept)",
}

# configs/demo.yaml shortened: 3 rounds of 4 prompts (x 8 samples x 3 orgs); evaluation before round 1, at round 2
# and after round 3; the outcome guard validates at round 2 and makes the last round's choice, on small splits
DEMO_OVERRIDES = [
    "federation.rounds=3",
    "federation.eval_every=2",
    "federation.prompts_per_round=4",
    "task.eval_size=16",
    "trainer.outcome_guard.every=2",
    "trainer.outcome_guard.val_size=16",
    "trainer.outcome_guard.final_size=16",
]
# the guard made to act in that short run: any net loss on the validation split is a regression (z 0.1, margin 0),
# and at the last round a learner below its shadow takes the shadow's weights (last_z 0.01): the weight-replacing
# decisions, which the demo's own thresholds never reach in 3 rounds
GUARD_ACTS = ["trainer.outcome_guard.z=0.1", "trainer.outcome_guard.margin=0", "trainer.outcome_guard.last_z=0.01"]
BENCH_SETTING, BENCH_SEED, BENCH_ROUNDS = "model", 0, 3
BENCH_OVERRIDES = ["task.eval_size=16", "federation.eval_every=2", "federation.prompts_per_round=4"]


@dataclass(frozen=True)
class Run:
    """One seeded run: ``argv(run_dir)`` is its command (after ``python -m hacrl_fed.cli``), ``metrics(run_dir)``
    where its metrics.jsonl lands, ``coverage`` the key fragments some record must hold with a value > 0."""

    name: str
    argv: Callable[[Path], list[str]]
    metrics: Callable[[Path], Path]
    coverage: tuple[str, ...]


def _sets(overrides: Sequence[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _demo(transport: str, protocol: str, more: Sequence[str] = ()) -> Callable[[Path], list[str]]:
    extra = [*DEMO_OVERRIDES, f"federation.protocol={protocol}", *more]
    if transport == "flower-simulation":
        return lambda d: [
            "simulate",
            "configs/demo.yaml",
            "--run-dir",
            str(d / "run"),
            "--num-cpus",
            "1",
            "--no-progress",
            *_sets(extra),
        ]
    return lambda d: [
        "run",
        "configs/demo.yaml",
        "--transport",
        transport,
        "--run-dir",
        str(d / "run"),
        "--no-progress",
        *_sets(extra),
    ]


def _bench(method: str) -> Callable[[Path], list[str]]:
    return lambda d: [
        "bench",
        "learning",
        "--only",
        f"{BENCH_SETTING}/{method}",
        "--seeds",
        str(BENCH_SEED),
        "--rounds",
        str(BENCH_ROUNDS),
        "--results",
        str(d / "results"),
        "--keep-runs",
        str(d / "keep"),
        "--no-report",
        "--threads",
        "1",
        *_sets(BENCH_OVERRIDES),
    ]


def _bench_metrics(method: str) -> Callable[[Path], Path]:
    return lambda d: d / "keep" / BENCH_SETTING / method / f"seed{BENCH_SEED}" / "metrics.jsonl"


# every demo run must evaluate, validate with the guard and train on foreign rows, or it proves little
DEMO_COVERAGE = ("eval/acme/accuracy", "/outcome/validated", "/train/num_cross", "/train/loss")
RUNS = {
    r.name: r
    for r in [
        Run("inprocess-fused", _demo("inprocess", "fused"), lambda d: d / "run" / "metrics.jsonl", DEMO_COVERAGE),
        Run(
            "inprocess-two-message",
            _demo("inprocess", "two_message"),
            lambda d: d / "run" / "metrics.jsonl",
            DEMO_COVERAGE,
        ),
        Run("grpc", _demo("grpc", "fused"), lambda d: d / "run" / "metrics.jsonl", DEMO_COVERAGE),
        Run(
            "flower-simulation",
            _demo("flower-simulation", "fused"),
            lambda d: d / "run" / "metrics.jsonl",
            DEMO_COVERAGE,
        ),
        Run(
            "inprocess-guard-acts",
            _demo("inprocess", "fused", GUARD_ACTS),
            lambda d: d / "run" / "metrics.jsonl",
            (*DEMO_COVERAGE, "/outcome/spared", "/outcome/adopted"),
        ),
        Run("bench-gspo", _bench("gspo"), _bench_metrics("gspo"), ("eval/acme/accuracy", "/train/loss")),
        Run(
            "bench-hacpo",
            _bench("hacpo"),
            _bench_metrics("hacpo"),
            ("eval/acme/accuracy", "/train/num_cross", "/train/loss"),
        ),
        Run("bench-gspo-x2", _bench("gspo_x2"), _bench_metrics("gspo_x2"), ("eval/acme/accuracy", "/train/loss")),
    ]
}


# ------------------------------------------------------------------------------------------------ values


def ignored(key: str) -> bool:
    """Whether ``key`` is a cost key of :data:`IGNORED` (``wall_time``, or a ``time`` / ``cpu`` / ``bytes`` /
    ``perf`` path segment)."""
    return key == "wall_time" or any(part in IGNORED for part in key.split("/"))


def read_values(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl, in order, without its ignored keys."""
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            rows.append({k: v for k, v in json.loads(line).items() if not ignored(k)})
    return rows


def missing_coverage(rows: list[dict[str, Any]], fragments: Sequence[str]) -> list[str]:
    """The fragments no key of any record holds with a numeric value > 0 (a run that never did that phase)."""

    def seen(fragment: str) -> bool:
        return any(fragment in k and isinstance(v, (int, float)) and v > 0 for r in rows for k, v in r.items())

    return [f for f in fragments if not seen(f)]


def same(a: Any, b: Any) -> bool:
    """Exact equality (tolerance 0), NaN equal to NaN; an int equals the float of the same value, a bool only a
    bool."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return type(a) is type(b) and a == b
    return a == b


@dataclass
class Comparison:
    """One run's comparison: ``differing`` holds (record, round, key, baseline, current)."""

    rows_compared: int
    rows_only_baseline: int
    rows_only_current: int
    keys_compared: int
    values_compared: int
    differing: list[tuple[int, Any, str, Any, Any]]
    added: list[str]
    removed: list[str]

    def failed(self, strict_keys: bool) -> bool:
        return bool(
            self.differing
            or self.rows_only_baseline
            or self.rows_only_current
            or (strict_keys and (self.added or self.removed))
        )


MISSING = "<absent>"


def compare_rows(baseline: list[dict[str, Any]], current: list[dict[str, Any]]) -> Comparison:
    """Record ``i`` of ``baseline`` against record ``i`` of ``current``, key by key. A key neither side's records
    ever hold is added / removed; a key both sides hold somewhere but one record lacks is a differing value
    (:data:`MISSING` on the side without it)."""
    keys_b = {k for r in baseline for k in r}
    keys_c = {k for r in current for k in r}
    shared = keys_b & keys_c
    differing, values = [], 0
    for i, (b, c) in enumerate(zip(baseline, current)):
        for key in sorted((b.keys() | c.keys()) & shared):
            values += 1
            old, new = b.get(key, MISSING), c.get(key, MISSING)
            if (key in b) != (key in c) or not same(old, new):
                differing.append((i, b.get("round"), key, old, new))
    n = min(len(baseline), len(current))
    return Comparison(
        n,
        len(baseline) - n,
        len(current) - n,
        len(shared),
        values,
        differing,
        sorted(keys_c - keys_b),
        sorted(keys_b - keys_c),
    )


# ------------------------------------------------------------------------------------------------ running


def run_env(flwr_home: Path) -> dict[str, str]:
    """The environment of every run: this checkout first on the path, one torch thread, a fixed hash seed,
    nothing from the network."""
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONHASHSEED="0",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        FLWR_HOME=str(flwr_home),
    )
    return env


def run_one(run: Run, work: Path, timeout_s: float) -> tuple[list[dict[str, Any]], float]:
    """Run ``run`` in ``work`` (fresh); its values and wall seconds. Raises RuntimeError with the log's tail."""
    work.mkdir(parents=True)
    cmd = [sys.executable, "-m", "hacrl_fed.cli", *run.argv(work)]
    t0 = time.perf_counter()
    with open(work / "log.txt", "w") as log:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=run_env(work / "flwr_home"), stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s
        )
    seconds = time.perf_counter() - t0
    metrics = run.metrics(work)
    if proc.returncode != 0 or not metrics.exists():
        tail = (work / "log.txt").read_text()[-3000:]
        raise RuntimeError(f"{run.name} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return read_values(metrics), seconds


def run_all(names: Sequence[str], jobs: int, keep: Path | None, timeout_s: float) -> dict[str, Any]:
    """Run ``names`` (``jobs`` at a time); ``{name: {"command", "seconds", "rows"}}``."""
    root = Path(tempfile.mkdtemp(prefix="equal-numbers-")) if keep is None else keep
    root.mkdir(parents=True, exist_ok=True)

    def one(name: str) -> tuple[str, dict[str, Any]]:
        run = RUNS[name]
        rows, seconds = run_one(run, root / name, timeout_s)
        print(f"  {name}: {len(rows)} records in {seconds:.0f} s", flush=True)
        if lacking := missing_coverage(rows, run.coverage):
            print(f"  warning: {name} has no value > 0 for {lacking}: it does not exercise that phase", flush=True)
        shown = run.argv(Path("RUN_DIR"))
        return name, {"command": ["hacrl-fed", *shown], "seconds": round(seconds, 1), "rows": rows}

    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            return dict(pool.map(one, names))
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ reporting


def print_table(results: dict[str, Comparison], strict_keys: bool, show: int = 10) -> bool:
    """One line per run, then the first ``show`` differing values and the added / removed keys; True when any run
    failed."""
    head = f"{'run':24s} {'rows':>6s} {'keys':>6s} {'values':>7s} {'differ':>7s} {'added':>6s} {'removed':>7s}  result"
    print(head)
    print("-" * len(head))
    failed = False
    for name, c in results.items():
        bad = c.failed(strict_keys)
        failed |= bad
        rows = f"{c.rows_compared}" + (
            f"(-{c.rows_only_baseline}+{c.rows_only_current})" if c.rows_only_baseline or c.rows_only_current else ""
        )
        print(
            f"{name:24s} {rows:>6s} {c.keys_compared:6d} {c.values_compared:7d} {len(c.differing):7d} "
            f"{len(c.added):6d} {len(c.removed):7d}  {'DIFFERENT' if bad else 'equal'}"
        )
    for name, c in results.items():
        for i, rnd, key, b, v in c.differing[:show]:
            print(f"  {name}: record {i} (round {rnd}) {key}: baseline {b!r}, now {v!r}")
        if len(c.differing) > show:
            print(f"  {name}: ... and {len(c.differing) - show} more differing values")
        if c.rows_only_baseline or c.rows_only_current:
            print(f"  {name}: {c.rows_only_baseline} records only in the baseline, {c.rows_only_current} only now")
        for label, keys in (("added", c.added), ("removed", c.removed)):
            if keys:
                print(f"  {name}: {label} keys: {', '.join(keys)}")
    return failed


def compare_files(baseline: dict[str, Any], current: dict[str, Any]) -> dict[str, Comparison]:
    """Every run of ``current`` against the same run of ``baseline`` (a run the baseline lacks: every row added)."""
    return {
        name: compare_rows(baseline["runs"].get(name, {}).get("rows", []), run["rows"])
        for name, run in current["runs"].items()
    }


def git_commit() -> tuple[str, bool]:
    """HEAD's hash and whether the tracked files differ from it."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode != 0
    return head or "unknown", dirty


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", type=Path, metavar="FILE", help="run, and write the values to FILE")
    mode.add_argument("--check", type=Path, metavar="FILE", help="run, and compare with FILE (exit 1 on a change)")
    p.add_argument(
        "--against", type=Path, metavar="FILE", help="with --check: compare FILE (a --save output) instead of running"
    )
    p.add_argument("--only", nargs="+", choices=sorted(RUNS), help="these runs only (default: all)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time, each on one torch thread (default 1)")
    p.add_argument("--keep", type=Path, help="keep the run dirs under this dir (default: a temp dir, removed)")
    p.add_argument("--strict-keys", action="store_true", help="added or removed keys fail too")
    p.add_argument("--timeout-s", type=float, default=1800, help="per run (default 1800)")
    args = p.parse_args(argv)
    baseline = json.loads(args.check.read_text()) if args.check else None
    names = args.only or (sorted(baseline["runs"], key=list(RUNS).index) if baseline else list(RUNS))
    if args.against:
        if baseline is None:
            p.error("--against needs --check")
        current = json.loads(args.against.read_text())
        current["runs"] = {n: r for n, r in current["runs"].items() if n in names}
    else:
        commit, dirty = git_commit()
        print(f"equal numbers: {len(names)} runs at {commit[:12]}{' (uncommitted changes)' if dirty else ''}")
        t0 = time.perf_counter()
        runs = run_all(names, args.jobs, args.keep, args.timeout_s)
        print(f"all runs in {time.perf_counter() - t0:.0f} s")
        current = {
            "schema": SCHEMA,
            "commit": commit,
            "dirty": dirty,
            "command": "python scripts/equal_numbers.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "ignored": IGNORED,
            "runs": {n: runs[n] for n in names},
        }
    if args.save:
        args.save.parent.mkdir(parents=True, exist_ok=True)
        args.save.write_text(json.dumps(current, indent=1, sort_keys=False) + "\n")
        print(
            f"saved {sum(len(r['rows']) for r in current['runs'].values())} records of {len(names)} runs to {args.save}"
        )
        return 0
    assert baseline is not None
    print(f"baseline {args.check}: commit {baseline.get('commit', '?')[:12]}; now {current.get('commit', '?')[:12]}")
    failed = print_table(compare_files(baseline, current), args.strict_keys)
    print("DIFFERENT: some value changed" if failed else "equal: every value compared is identical")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
