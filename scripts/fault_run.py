"""Fault-injection run (issue 45): SIGKILL the coordinator (``hacrl-fed run``) or one of its gRPC workers at seeded
random moments of a small run on loopback, do what a user would do next, and count what was lost.

``python scripts/fault_run.py --faults 10 --seed 0 [--out DIR] [--json PATH]``

Every run is two micro orgs (``micro-qwen-char``, ``micro-gpt2-bpe``) on easy arithmetic, ``--transport grpc``
(the CLI starts both workers), ``checkpoint_every: 1``, ``min_orgs: 1``, 5 rounds. First one uninterrupted
reference run; then fault ``i`` targets the coordinator for even ``i``, org ``b``'s worker for odd ``i``, a delay
uniform in ``[0, 6)`` s after round 1's metrics line:

* coordinator: SIGKILL the CLI (its workers must be gone within 10 s: else an orphan), then ``--resume``;
* worker: SIGKILL b's worker; the run goes on with a alone (``min_orgs: 1``), as the CLI cannot restart it.

Per fault it records: finished (exit 0, state at round 5), metric rows lost or duplicated, orphan processes (a
worker alive 10 s after its coordinator's kill, or any process of the run alive after it ended), checkpoints on
disk whose manifest does not verify (with the resumes that fell back past one), and whether the learning metrics
equal the reference's, and if not whether a gap explains it (``round/<org>/failure/stale_round``: an org whose
checkpoint was ahead of the coordinator's state refused the round it had trained, by design; or the killed worker's
``unreachable`` rounds). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hacrl_fed.worker.checkpoint_manifest import checkpoint_problem  # noqa: E402

ROUNDS = 5
ORGS = {"a": "micro-qwen-char", "b": "micro-gpt2-bpe"}


def write_config(folder: Path) -> Path:
    data = {
        "name": "faults",
        "seed": 1,
        "run_dir": str(folder / "runs"),
        "trainer": {"lr": 1e-3, "minibatch_size": 64, "micro_batch_size": 32},
        "generation": {"num_samples": 4, "max_new_tokens": 8, "eval_max_new_tokens": 8},
        "task": {"name": "arithmetic", "params": {"difficulty": 1, "max_operand": 9}, "eval_size": 4},
        "orgs": [{"id": o, "model": {"zoo": z}} for o, z in ORGS.items()],
        "federation": {
            "rounds": ROUNDS,
            "prompts_per_round": 4,
            "eval_every": 2,
            "min_orgs": 1,
            "round_timeout_s": 120.0,
            "checkpoint_every": 1,
        },
    }
    path = folder / "faults.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def cli(config: Path, run_dir: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    argv = [
        sys.executable,
        "-m",
        "hacrl_fed.cli",
        "run",
        str(config),
        "--transport",
        "grpc",
        "--run-dir",
        str(run_dir),
        "--no-progress",
        *extra,
    ]
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def children(pid: int) -> dict[int, list[str]]:
    out = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
    return out


def running(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def wait_round(run_dir: Path, round: int, proc: subprocess.Popen, timeout_s: float = 600) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if any(r["round"] == round for r in rows(run_dir)):
                return True
        except ValueError:  # a line being written
            pass
        time.sleep(0.05)
    return False


def learning(run_dir: Path) -> dict[int, dict]:
    skip = ("time", "bytes", "wall_time")
    return {
        r["round"]: {
            k: v
            for k, v in r.items()
            if not k.startswith(skip)
            and "/time/" not in k
            and "/cpu/" not in k
            and "/perf/" not in k
            and not k.endswith("/messages")
        }
        for r in rows(run_dir)
    }


def worker_pids(cli_pid: int) -> dict[str, int]:
    deadline, found = time.monotonic() + 120, {}
    while time.monotonic() < deadline and len(found) < len(ORGS):
        for pid, argv in children(cli_pid).items():
            if "worker" in argv and "--org" in argv:
                found[argv[argv.index("--org") + 1]] = pid
        time.sleep(0.1)
    return found


def inject(i: int, rng: random.Random, config: Path, folder: Path, reference: dict[int, dict]) -> dict:
    """Fault ``i`` (module docstring); returns its record."""
    target, run_dir = ("coordinator", "worker")[i % 2], folder / f"run-{i}"
    delay = rng.uniform(0, 6)
    proc = cli(config, run_dir)
    pids = worker_pids(proc.pid)
    orphans, injected = 0, False
    if wait_round(run_dir, 1, proc):
        time.sleep(delay)
        if target == "coordinator" and proc.poll() is None:
            proc.kill()
            proc.wait(30)
            injected = True
            deadline = time.monotonic() + 10
            while any(running(p) for p in pids.values()) and time.monotonic() < deadline:
                time.sleep(0.1)
            orphans += sum(running(p) for p in pids.values())
            proc = cli(config, run_dir, "--resume")
        elif target == "worker" and running(pids["b"]):
            os.kill(pids["b"], signal.SIGKILL)
            injected = True
    _, err = proc.communicate(timeout=900)
    time.sleep(1)
    orphans += sum(running(p) for p in pids.values())
    state = json.loads((run_dir / "coordinator_state.json").read_text()) if proc.returncode == 0 else {}
    counts = Counter(r["round"] for r in rows(run_dir))
    checkpoints = list((run_dir / "orgs").glob("*/checkpoints/*/round-*"))
    corrupt = [str(p) for p in checkpoints if checkpoint_problem(p) is not None]
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log"))
    got = learning(run_dir)
    gaps = any(
        v == 1.0
        for rec in got.values()
        for k, v in rec.items()
        if k.endswith(("/failure/stale_round", "/failure/unreachable"))
    )
    return {
        "fault": i,
        "target": target,
        "delay_s": round(delay, 2),
        "injected": injected,
        "finished": state.get("round") == ROUNDS,
        "lost_rows": sum(1 for t in range(ROUNDS + 1) if counts[t] == 0),
        "duplicated_rows": sum(n - 1 for n in counts.values() if n > 1),
        "orphans": orphans,
        "corrupt_checkpoints": len(corrupt),
        "recovered": logs.count("unusable ("),
        "equal_to_reference": got == reference,
        "gap_explains_difference": got != reference and gaps,
        "stderr_tail": err[-300:] if proc.returncode else "",
    }


def table(records: list[dict]) -> str:
    lines = [
        "| target | faults | finished | lost rows | duplicated rows | orphans | corrupt ckpt (recovered) "
        "| equal to reference | differ, gap explains | differ, unexplained |",
        "|" + "---|" * 10,
    ]
    for target in ("coordinator", "worker"):
        rs = [r for r in records if r["target"] == target and r["injected"]]
        eq = sum(r["equal_to_reference"] for r in rs)
        gap = sum(r["gap_explains_difference"] for r in rs)
        lines.append(
            f"| {target} | {len(rs)} | {sum(r['finished'] for r in rs)} | {sum(r['lost_rows'] for r in rs)} "
            f"| {sum(r['duplicated_rows'] for r in rs)} | {sum(r['orphans'] for r in rs)} "
            f"| {sum(r['corrupt_checkpoints'] for r in rs)} ({sum(r['recovered'] for r in rs)}) "
            f"| {eq} | {gap} | {len(rs) - eq - gap} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="work folder (default: a new temporary one)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    folder = args.out or Path(tempfile.mkdtemp(prefix="fault-run-"))
    folder.mkdir(parents=True, exist_ok=True)
    config, rng = write_config(folder), random.Random(args.seed)
    ref = cli(config, folder / "reference")
    _, err = ref.communicate(timeout=900)
    if ref.returncode != 0:
        sys.exit(f"the reference run failed: {err[-500:]}")
    reference = learning(folder / "reference")
    records = []
    for i in range(args.faults):
        records.append(inject(i, rng, config, folder, reference))
        print(json.dumps(records[-1]), flush=True)
    print(table(records))
    if args.json:
        args.json.write_text(json.dumps({"seed": args.seed, "faults": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
