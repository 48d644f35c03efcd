"""``hacrl-fed bench report``: the learning matrix's JSON results as Markdown tables and PNG learning curves.

    hacrl-fed bench report [--results benchmarks/results] [--matrix configs/bench/matrix.yaml]

Writes ``<results>/REPORT.md`` and ``<results>/curves/<setting>.png`` (plus ``<setting>-ablations.png``). Per
setting and agent: held-out greedy accuracy as mean ± sample std over seeds, with the gain over the warm start in
points, (a) at equal rounds (the end of the run) and (b) at equal generated rollouts (the rollouts every method
with G samples has generated at the end; GSPO x2 reaches them halfway, linear interpolation between evaluations);
then what each learner generated and trained on, wall time, and the ratio / clip statistics that explain the
result; then the targets of the benchmark issue, checked on the numbers. Cells that did not run are listed with
the reason (a missing config knob, an identical config).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hacrl_tools.bench.matrix import Matrix, load_matrix, plan_cells

MAIN_METHODS = ("grpo", "gspo", "gspo_x2", "naive", "hacpo")


def load_results(results: str | Path) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """``{(setting, method): [cell JSON, ...]}`` sorted by seed, from ``<results>/<setting>/<method>/seed*.json``."""
    out: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for path in sorted(Path(results).glob("*/*/seed*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and "agents" in data:
            out[(data["setting"], data["method"])].append(data)
    for cells in out.values():
        cells.sort(key=lambda d: d["seed"])
    return dict(out)


def acc_at_rollouts(curve: list[list[float]], budget: float) -> float | None:
    """Held-out accuracy after ``budget`` generated rollouts: linear interpolation on ``[round, rollouts, acc]``
    points (None when the curve never reached the budget)."""
    pts = sorted((float(r), float(a)) for _, r, a in curve)
    if not pts or budget > pts[-1][0] + 1e-9:
        return None
    prev = None
    for r, a in pts:
        if abs(r - budget) < 1e-9:
            return a
        if r > budget:
            if prev is None:
                return None
            r0, a0 = prev
            return a0 + (a - a0) * (budget - r0) / (r - r0)
        prev = (r, a)
    return pts[-1][1]


def mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None, None
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else None)


def fmt_acc(values: list[float | None], before: list[float | None]) -> str:
    """``0.585 ± 0.021 (+12.5)``: mean ± std over seeds, gain over the warm start in points (mean of per-seed
    gains)."""
    m, s = mean_std([v for v in values if v is not None])
    if m is None:
        return "–"
    gains = [a - b for a, b in zip(values, before) if a is not None and b is not None]
    g, _ = mean_std(gains)
    text = f"{m:.3f}" + (f" ± {s:.3f}" if s is not None else "")
    return text + (f" ({100 * g:+.1f})" if g is not None else "")


def _agents(cells: list[dict[str, Any]]) -> list[str]:
    return list(cells[0]["agents"]) if cells else []


def budget_of(by_method: dict[str, list[dict[str, Any]]], org: str) -> float | None:
    """The equal-rollouts budget for ``org``: the smallest final rollout count over the methods that ran."""
    finals = [
        c["agents"][org]["rollouts_generated"]
        for cells in by_method.values()
        for c in cells
        if org in c["agents"] and c["agents"][org]["curve"]
    ]
    return float(min(finals)) if finals else None


def _stat(agent: dict[str, Any], key: str, which: str = "mean") -> float | None:
    s = (agent.get("stats") or {}).get(key)
    return None if s is None else s.get(which)


def ratio_summary(method_cells: list[dict[str, Any]], org: str) -> str:
    """The ratio / clip statistics of the method's algorithm, mean over rounds and seeds."""
    algo = method_cells[0]["config"]["algorithm"]["name"]

    def m(key: str) -> float | None:
        """A share over each whole run (from its counts; older results: mean of per-round shares), or a mean
        statistic; then the mean over seeds."""
        vals = []
        for c in method_cells:
            agent = c["agents"][org]
            share = (agent.get("shares") or {}).get(f"{algo}/{key}")
            vals.append(share if share is not None else _stat(agent, f"{algo}/{key}"))
        return mean_std(vals)[0]

    def f(x: float | None, digits: int = 2) -> str:
        return "–" if x is None else f"{x:.{digits}f}"

    shared = [k for c in method_cells for k in (c["agents"][org].get("shares") or {})]
    sources = sorted({k.rpartition("/")[2] for k in shared if k.count("/") == 2})  # hacpo/<share>/<source>
    if algo == "hacpo":
        text = (
            f"cross s̄ {f(m('cross_ratio_mean'), 3)}, in band {f(m('cross_in_band_frac'))}, "
            f"below {f(m('cross_clip_low_frac'))}, above {f(m('cross_clip_high_frac'))}, "
            f"with gradient {f(m('cross_grad_frac'))}; self clip {f(m('self_clip_low_frac'))}/"
            f"{f(m('self_clip_high_frac'))}"
        )
        if len(sources) > 1:  # one pair per source (with two orgs the line above is that pair)
            text += "; per source in band/below/above/with gradient: " + ", ".join(
                f"{s} {f(m(f'cross_in_band_frac/{s}'))}/{f(m(f'cross_clip_low_frac/{s}'))}/"
                f"{f(m(f'cross_clip_high_frac/{s}'))}/{f(m(f'cross_grad_frac/{s}'))}"
                for s in sources
            )
        return text
    if algo == "naive":
        text = (
            f"cross s̄ {f(m('cross_ratio_mean'), 3)}, cross with gradient {f(m('cross_grad_frac'))}; "
            f"all rows clip low/high {f(m('clip_low_frac'))}/{f(m('clip_high_frac'))}"
        )
        if len(sources) > 1:
            text += "; with gradient per source: " + ", ".join(f"{s} {f(m(f'cross_grad_frac/{s}'))}" for s in sources)
        return text
    return f"s̄ {f(m('ratio_mean'), 4)}, clip low/high {f(m('clip_low_frac'))}/{f(m('clip_high_frac'))}"


def training_code_diff(commits: Sequence[str], root: Path | None = None) -> list[str] | None:
    """The files of the ``hacrl_fed`` package, ``hacrl_fed/bench`` (where the benchmark's own scripts lived before
    ``hacrl_tools``) excluded, that differ between the first commit and any other, in the git checkout at ``root``
    (default: the working directory); None when git cannot tell (no checkout, unknown commit)."""
    import subprocess

    known = [c for c in commits if c and c != "?"]
    if len(known) != len(commits):
        return None
    cwd = root  # None: the working directory (a checkout)
    changed: set[str] = set()
    for other in known[1:]:
        try:
            diff = subprocess.run(
                ["git", "diff", "--name-only", known[0], other, "--", "hacrl_fed", ":(exclude)hacrl_fed/bench"],
                cwd=cwd,
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        if diff.returncode != 0:
            return None
        changed.update(diff.stdout.split())
    return sorted(changed)


def same_training_code(commits: Sequence[str], root: Path | None = None) -> bool | None:
    """Whether every commit has the same ``hacrl_fed`` package apart from ``hacrl_fed/bench``; None when git
    cannot tell."""
    diff = training_code_diff(commits, root)
    return None if diff is None else not diff


def _mixed_note(commits: Sequence[str]) -> str:
    if len(commits) < 2:
        return ""
    diff = training_code_diff(commits)
    if diff is None:
        return " (MIXED: several commits)"
    if not diff:
        return " (several commits, the same training code: they differ only outside hacrl_fed or in hacrl_fed/bench)"
    shown = ", ".join(diff[:5]) + (f" and {len(diff) - 5} more" if len(diff) > 5 else "")
    return f" (MIXED: the training code differs in {shown})"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _agent_label(cells: list[dict[str, Any]], org: str) -> str:
    for o in cells[0]["config"]["orgs"]:
        if o["id"] == org:
            model = o["model"]
            return f"{org} ({model.get('zoo') or Path(model.get('path') or '?').name})"
    return org


def accuracy_tables(by_method: dict[str, list[dict[str, Any]]], methods: list[str]) -> list[str]:
    """Two tables: accuracy at equal rounds and at equal generated rollouts, one row per method."""
    present = [m for m in methods if by_method.get(m)]
    if not present:
        return []
    ref = by_method[present[0]]
    orgs = _agents(ref)
    labels = [_agent_label(ref, o) for o in orgs]
    lines = []
    rounds = sorted({c["rounds"] for m in present for c in by_method[m]})
    for view in ("rounds", "rollouts"):
        if view == "rounds":
            lines.append(
                f"Held-out greedy accuracy after {'/'.join(map(str, rounds))} rounds, mean ± std over "
                "seeds (gain over the warm start, points):"
            )
        else:
            budgets = {o: budget_of(by_method, o) for o in orgs}
            lines.append(
                "At equal generated rollouts per agent ("
                + ", ".join(f"{o} {int(b) if b else '–'}" for o, b in budgets.items())
                + "):"
            )
        lines.append("")
        rows = []
        for m in present:
            cells = by_method[m]
            row = [f"`{m}`", str(len(cells))]
            gains = []
            for o in orgs:
                before = [c["agents"][o]["accuracy_before"] for c in cells]
                if view == "rounds":
                    vals = [c["agents"][o]["accuracy_after"] for c in cells]
                else:
                    budget = budgets[o]
                    vals = [acc_at_rollouts(c["agents"][o]["curve"], budget) if budget else None for c in cells]
                row.append(fmt_acc(vals, before))
                g = mean_std([a - b for a, b in zip(vals, before) if a is not None and b is not None])[0]
                if g is not None:
                    gains.append(g)
            row.append(f"{100 * statistics.fmean(gains):+.1f}" if len(gains) == len(orgs) else "–")
            rows.append(row)
        lines += _table(["method", "seeds", *labels, "mean gain"], rows)
        lines.append("")
    return lines


def _per_agent_diffs(cells: list[dict[str, Any]], ref: list[dict[str, Any]]) -> dict[str, list[float]]:
    """``{org: [100 * (acc - ref acc) per seed both ran]}`` (points, paired by seed and agent)."""
    ref_by_seed = {c["seed"]: c for c in ref}
    out: dict[str, list[float]] = {}
    for cell in cells:
        base = ref_by_seed.get(cell["seed"])
        if base is None:
            continue
        for org, agent in cell["agents"].items():
            if org in base["agents"]:
                out.setdefault(org, []).append(100 * (agent["accuracy_after"] - base["agents"][org]["accuracy_after"]))
    return out


def _mean_se(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and standard error (std / sqrt(n); None for one value)."""
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return statistics.fmean(values), se


def paired_differences(
    by_method: dict[str, list[dict[str, Any]]], methods: list[str], ref: str
) -> dict[str, dict[str, Any]]:
    """Each method's final accuracy minus ``ref``'s on the same seed and agent, in points.

    ``{method: {"pairs": n, "mean": d̄, "se": std(d) / sqrt(n) or None, "per_agent": {org: mean d}}}`` over the
    (seed, agent) pairs both ran; pairing by seed removes the seed's shared prompts and warm start from the noise.
    """
    out: dict[str, dict[str, Any]] = {}
    for m in methods:
        if m == ref or not by_method.get(m):
            continue
        per_agent = _per_agent_diffs(by_method[m], by_method.get(ref, []))
        diffs = [d for ds in per_agent.values() for d in ds]
        if diffs:
            mean, se = _mean_se(diffs)
            out[m] = {
                "pairs": len(diffs),
                "mean": mean,
                "se": se,
                "per_agent": {o: statistics.fmean(ds) for o, ds in per_agent.items()},
            }
    return out


def paired_table(by_method: dict[str, list[dict[str, Any]]], methods: list[str], ref: str) -> list[str]:
    """The :func:`paired_differences` against ``ref`` as a Markdown table (nothing when no pairs)."""
    diffs = paired_differences(by_method, methods, ref)
    if not diffs:
        return []
    orgs = _agents(by_method[ref])
    rows = []
    for m, d in diffs.items():
        se = f" ± {d['se']:.1f}" if d["se"] is not None else ""
        agents = [f"{d['per_agent'][o]:+.1f}" if o in d["per_agent"] else "–" for o in orgs]
        rows.append([f"`{m}`", str(d["pairs"]), f"{d['mean']:+.1f}{se}", *agents])
    sizes = sorted({int(c["config"]["task"]["eval_size"]) for c in by_method[ref] if "config" in c})
    n = sizes[0] if len(sizes) == 1 else None
    # the binomial standard error of one accuracy near 0.5 on n prompts: 100 * sqrt(0.25 / n) points
    alone = (
        f"a {n}-prompt accuracy alone has a standard error of about {100 * (0.25 / n) ** 0.5:.1f} points"
        if n
        else ("the cells evaluate on different numbers of prompts")
    )
    return [
        f"Paired with `{ref}` on the same seed and agent: final accuracy difference in points, mean ± standard "
        f"error over the pairs, and per agent ({alone}):",
        "",
        *_table(["method", "pairs", f"Δ vs `{ref}`", *orgs], rows),
        "",
    ]


def group_variants(shown: Sequence[str]) -> list[str]:
    """The rows of a group table other than the ``hacpo`` reference (shown as ``hacpo`` or ``hacpo (= alias)``)."""
    return [k for k in shown if k != "hacpo" and not k.startswith("hacpo (= ")]


def summary_table(
    data: dict[tuple[str, str], list[dict[str, Any]]], settings: list[str], methods: list[str]
) -> list[str]:
    """One row per (setting, method): final accuracy per org (mean over seeds), the mean gain over the warm start
    and the paired difference to ``gspo`` (:func:`paired_differences`), all at equal rounds."""
    orgs: list[str] = []
    for (s, _), found in data.items():
        if s in settings:
            orgs += [o for o in _agents(found) if o not in orgs]
    rows = []
    for setting in settings:
        by_method = {m: cells for (s, m), cells in data.items() if s == setting}
        diffs = paired_differences(by_method, methods, "gspo")
        for m in methods:
            cells = by_method.get(m)
            if not cells:
                continue
            accs = [mean_std([c["agents"][o]["accuracy_after"] for c in cells if o in c["agents"]])[0] for o in orgs]
            gains = [
                100 * (c["agents"][o]["accuracy_after"] - c["agents"][o]["accuracy_before"])
                for c in cells
                for o in c["agents"]
            ]
            d = diffs.get(m)
            delta = f"{d['mean']:+.1f}" + (f" ± {d['se']:.1f}" if d and d["se"] is not None else "") if d else "–"
            rows.append(
                [
                    f"`{setting}`",
                    f"`{m}`",
                    *[f"{a:.3f}" if a is not None else "–" for a in accs],
                    f"{statistics.fmean(gains):+.1f}" if gains else "–",
                    delta,
                ]
            )
    if not rows:
        return []
    return [
        "Final held-out greedy accuracy per org (mean over seeds), mean gain over the warm start (points, over "
        "orgs and seeds) and the paired difference to `gspo` (points, mean ± standard error over seeds × orgs):",
        "",
        *_table(["setting", "method", *orgs, "mean gain", "Δ vs `gspo`"], rows),
        "",
    ]


def cost_table(by_method: dict[str, list[dict[str, Any]]], methods: list[str]) -> list[str]:
    present = [m for m in methods if by_method.get(m)]
    if not present:
        return []
    rows = []
    for m in present:
        cells = by_method[m]
        wall = mean_std([c["wall_time_s"] for c in cells])[0]
        for o in _agents(cells):
            a = [c["agents"][o] for c in cells]
            gen = mean_std([x["rollouts_generated"] for x in a])[0]
            seqs = mean_std([x.get("sequences_trained", 0) for x in a])[0]
            cross = mean_std([x.get("cross_sequences_trained", 0) for x in a])[0]
            t = mean_std([x.get("time_calls_s", 0.0) for x in a])[0]
            rows.append(
                [
                    f"`{m}`",
                    o,
                    f"{gen:.0f}",
                    f"{seqs:.0f} ({cross:.0f} cross)",
                    f"{t:.0f}",
                    f"{wall:.0f}",
                    ratio_summary(cells, o),
                ]
            )
    return [
        "What each learner generated and trained on (means over seeds; s̄ = mean sequence ratio, fractions "
        "of rows, mean over rounds):",
        "",
        *_table(
            [
                "method",
                "agent",
                "rollouts generated",
                "sequences trained on",
                "agent time s",
                "cell wall s",
                "ratios and clipping",
            ],
            rows,
        ),
        "",
    ]


def targets(by_method: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The issue's targets checked on this setting's numbers (equal rounds)."""
    need = ("gspo", "gspo_x2", "naive", "hacpo")
    if not all(by_method.get(m) for m in need):
        return []
    orgs = _agents(by_method["hacpo"])

    def final(m: str, o: str) -> float | None:
        return mean_std([c["agents"][o]["accuracy_after"] for c in by_method[m]])[0]

    lines = ["Targets (mean over seeds, equal rounds):", ""]
    per_agent = [(o, final("hacpo", o), final("gspo_x2", o)) for o in orgs]
    ok = all(h is not None and x is not None and h >= x for _, h, x in per_agent)
    lines.append(
        f"- HACPO ≥ GSPO×2 for every agent: {'yes' if ok else 'no'} ("
        + ", ".join(f"{o} {h:.3f} vs {x:.3f}" for o, h, x in per_agent if h is not None and x is not None)
        + ")"
    )
    pairs = [(final("hacpo", o), final("gspo", o)) for o in orgs]
    diffs = [h - g for h, g in pairs if h is not None and g is not None]
    if diffs:
        gain = 100 * statistics.fmean(diffs)
        lines.append(
            f"- mean gain of HACPO over isolated GSPO ≥ +3 points: {'yes' if gain >= 3 else 'no'} ({gain:+.1f})"
        )
    nv = [v for o in orgs if (v := final("naive", o)) is not None]
    hc = [v for o in orgs if (v := final("hacpo", o)) is not None]
    if len(nv) == len(hc) == len(orgs):
        lines.append(
            f"- naive < HACPO (mean over agents): {'yes' if statistics.fmean(nv) < statistics.fmean(hc) else 'no'}"
            f" ({statistics.fmean(nv):.3f} vs {statistics.fmean(hc):.3f})"
        )
    return lines + [""]


def _verdict(mean: float, se: float | None) -> str:
    """``above`` / ``below`` when |mean| > 2 standard errors, else ``not resolved``."""
    if se is None or abs(mean) <= 2 * se:
        return "not resolved"
    return "above" if mean > 0 else "below"


def rule_comparison(by_method: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Every method but the GSPO baselines against GSPO×2 per agent (paired by seed, ± standard error over seeds)
    and against naive over all (seed, agent) pairs, with the strongest agent's (highest GSPO×2 accuracy) distance
    to GSPO×2 and the issue's goal: every agent at or above GSPO×2 and the mean above naive, each claim only past
    two standard errors."""
    ref = by_method.get("gspo_x2")
    if not ref:
        return []
    orgs = _agents(ref)
    strongest = max(orgs, key=lambda o: statistics.fmean(c["agents"][o]["accuracy_after"] for c in ref))
    rows = []
    for m in sorted(by_method, key=lambda m: (m not in ("naive", "hacpo", "hacpo_per_byte"), m)):
        if m in ("gspo", "gspo_x2", "grpo") or not by_method[m]:
            continue
        diffs = _per_agent_diffs(by_method[m], ref)
        if not diffs:
            continue
        cells = []
        for o in orgs:
            if o in diffs:
                mean, se = _mean_se(diffs[o])
                cells.append(f"{mean:+.1f}" + (f" ± {se:.1f}" if se is not None else ""))
            else:
                cells.append("–")
        vs_naive = "–"
        if m != "naive" and by_method.get("naive"):
            nd = [d for ds in _per_agent_diffs(by_method[m], by_method["naive"]).values() for d in ds]
            if nd:
                mean, se = _mean_se(nd)
                vs_naive = f"{mean:+.1f}" + (f" ± {se:.1f}" if se is not None else "") + f" ({_verdict(mean, se)})"
        s_mean, s_se = _mean_se(diffs[strongest]) if strongest in diffs else (float("nan"), None)
        below = [o for o in orgs if o in diffs and _verdict(*_mean_se(diffs[o])) == "below"]
        goal = "no: " + ", ".join(below) + " below" if below else "no agent resolved below"
        seeds = len({c["seed"] for c in by_method[m]})
        rows.append([f"`{m}`", str(seeds), *cells, vs_naive, _verdict(s_mean, s_se), goal])
    if not rows:
        return []
    return [
        f"Every method against GSPO×2 on the same seed, per agent (points, mean ± standard error over seeds), and "
        f"against `naive` over all (seed, agent) pairs; the strongest agent is {strongest}. A verdict holds only past "
        "two standard errors. Every method here generates half GSPO×2's rollouts.",
        "",
        *_table(
            [
                "method",
                "seeds",
                *[f"Δ {o} vs GSPO×2" for o in orgs],
                "Δ vs naive (all agents)",
                f"{strongest} vs GSPO×2",
                "every agent ≥ GSPO×2",
            ],
            rows,
        ),
        "",
    ]


def plot_setting(by_method: dict[str, list[dict[str, Any]]], methods: list[str], out: Path, title: str) -> Path | None:
    """Accuracy vs round (top) and vs generated rollouts (bottom), one column per agent, one line per method
    (mean over seeds, band = ± std)."""
    present = [m for m in methods if by_method.get(m)]
    if not present:
        return None
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    orgs = _agents(by_method[present[0]])
    fig, axes = plt.subplots(2, len(orgs), figsize=(4.2 * len(orgs), 6.4), squeeze=False)
    for j, o in enumerate(orgs):
        for m in present:
            points: dict[int, list[tuple[float, float]]] = defaultdict(list)
            for c in by_method[m]:
                for rnd, rollouts, acc in c["agents"][o]["curve"]:
                    points[int(rnd)].append((float(rollouts), float(acc)))
            rounds = sorted(points)
            mean = [statistics.fmean(a for _, a in points[r]) for r in rounds]
            std = [statistics.stdev([a for _, a in points[r]]) if len(points[r]) > 1 else 0.0 for r in rounds]
            xs_roll = [statistics.fmean(x for x, _ in points[r]) for r in rounds]
            for ax, xs in ((axes[0][j], rounds), (axes[1][j], xs_roll)):
                (line,) = ax.plot(xs, mean, marker="o", ms=3, label=m)
                ax.fill_between(
                    xs,
                    [a - s for a, s in zip(mean, std)],
                    [a + s for a, s in zip(mean, std)],
                    color=line.get_color(),
                    alpha=0.15,
                )
        axes[0][j].set_title(_agent_label(by_method[present[0]], o))
        axes[0][j].set_xlabel("round")
        axes[1][j].set_xlabel("rollouts generated by this agent")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_ylabel("held-out accuracy (greedy)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def render(results: str | Path, matrix: Matrix | None = None, *, plots: bool = True) -> str:
    """The Markdown report of ``results`` (PNG curves written under ``<results>/curves/`` when ``plots``)."""
    results = Path(results)
    data = load_results(results)
    settings_order = list(matrix.settings) if matrix else sorted({s for s, _ in data})
    settings_order += sorted({s for s, _ in data} - set(settings_order))
    lines = _header(results, data)
    groups = matrix.groups if matrix else {"main": {"settings": settings_order, "methods": list(MAIN_METHODS)}}
    if "main" in groups:
        lines += ["## Summary (main group)", ""]
        lines += summary_table(data, list(groups["main"]["settings"]), list(groups["main"]["methods"]))
    for setting in settings_order:
        by_method = {m: cells for (s, m), cells in data.items() if s == setting}
        lines += _setting_section(setting, by_method, groups, matrix, results / "curves" if plots else None)
    return "\n".join(lines + _footer(data, matrix))


def _header(results: Path, data: dict[tuple[str, str], list[dict[str, Any]]]) -> list[str]:
    """The title, where the cells come from, the commits and machines they ran on."""
    lines = [
        "# Learning benchmark results",
        "",
        f"Generated by `hacrl-fed bench report` from the JSON under `{_rel(results)}` "
        f"({sum(len(v) for v in data.values())} cells).",
        "",
    ]
    commits = sorted({(c.get("code") or {}).get("commit") or "?" for v in data.values() for c in v})
    machines = sorted(
        {
            f"{(c.get('machine') or {}).get('cpus')} CPUs, torch {(c.get('machine') or {}).get('torch')}"
            for v in data.values()
            for c in v
        }
    )
    if commits:
        lines += [
            f"Code: {', '.join(x[:12] for x in commits)}{_mixed_note(commits)}; machine: {'; '.join(machines)}.",
            "",
        ]
    return lines


def _setting_section(
    setting: str, by_method: dict[str, list[dict[str, Any]]], groups: dict, matrix: Matrix | None, curves: Path | None
) -> list[str]:
    """One setting: its main group's tables, targets, costs, rule comparison and curve, then each other group."""
    group_methods = {g: [m for m in spec["methods"]] for g, spec in groups.items() if setting in spec["settings"]}
    about = matrix.settings[setting]["about"] if matrix and setting in matrix.settings else ""
    lines = [f"## {setting}", "", about, ""] if about else [f"## {setting}", ""]
    if not by_method:
        return lines + ["No results yet.", ""]
    main = group_methods.get("main", [m for m in MAIN_METHODS if m in by_method])
    lines += accuracy_tables(by_method, main)
    lines += paired_table(by_method, main, "gspo")
    lines += targets(by_method)
    lines += cost_table(by_method, main)
    comparison = rule_comparison(by_method)
    if comparison and len(by_method) > len(main):
        lines += [f"### {setting}: every rule against GSPO×2 and naive", "", *comparison]
    if curves is not None and plot_setting(by_method, main, curves / f"{setting}.png", f"{setting}: {about}"):
        lines += [f"![{setting}](curves/{setting}.png)", ""]
    for g, methods in group_methods.items():
        if g != "main":
            lines += _group_section(setting, g, methods, by_method, groups[g].get("ref"), matrix, curves)
    return lines


def _group_section(
    setting: str,
    g: str,
    methods: list[str],
    by_method: dict[str, list[dict[str, Any]]],
    ref: Any,
    matrix: Matrix | None,
    curves: Path | None,
) -> list[str]:
    """Group ``g`` of ``setting``: its methods (aliases shown as the method they equal) against ``hacpo`` and
    against the group's own reference ``ref``, their costs and curve."""
    shown = {"hacpo": by_method["hacpo"]} if by_method.get("hacpo") else {}
    for m in methods:  # an alias (same_as) is the row of the method it equals
        target = matrix.methods[m].same_as if matrix and m in matrix.methods else None
        if target is not None:
            if target in shown:
                shown[f"{target} (= {m})"] = shown.pop(target)
        elif by_method.get(m):
            shown[m] = by_method[m]
    lines = [f"### {setting}: {g}", ""]
    if len(shown) <= 1:
        return lines + ["Only the `hacpo` reference so far." if shown else "No results yet.", ""]
    lines += accuracy_tables(shown, list(shown))
    if by_method.get("hacpo"):  # each variant against the paper's form on the same seeds
        lines += paired_table({**shown, "hacpo": by_method["hacpo"]}, group_variants(list(shown)), "hacpo")
    if isinstance(ref, str) and by_method.get(ref):  # and against the group's own reference (e.g. the screen off)
        lines += paired_table(shown, [m for m in group_variants(list(shown)) if m != ref], ref)
    lines += cost_table(shown, list(shown))
    if curves is not None and plot_setting(shown, list(shown), curves / f"{setting}-{g}.png", f"{setting}: {g}"):
        lines += [f"![{setting} {g}](curves/{setting}-{g}.png)", ""]
    return lines


def _footer(data: dict[tuple[str, str], list[dict[str, Any]]], matrix: Matrix | None) -> list[str]:
    """The cells with disturbed timings, the matrix's cells not run, and the note on shares."""
    lines: list[str] = []
    busy = [
        f"{c['setting']}/{c['method']}/seed{c['seed']}"
        for v in data.values()
        for c in v
        if (c.get("round_time_s") or {}).get("min") and c["round_time_s"]["mean"] > 2 * c["round_time_s"]["min"]
    ]
    if busy:
        lines += [
            "## Disturbed timings",
            "",
            "Cells whose mean round time is more than twice their fastest round (the machine was busy with "
            "something else; their wall times overstate the cost, their accuracies are unaffected): "
            + ", ".join(f"`{b}`" for b in busy),
            "",
        ]
    if matrix is not None:
        skipped = {}
        for cell in plan_cells(matrix):
            if cell.skip is not None and not cell.same_as and matrix.methods[cell.method].retired is None:
                skipped[f"{cell.setting}/{cell.method}"] = cell.skip
        if skipped:
            lines += ["## Not run", ""] + [f"- `{k}`: {why}" for k, why in skipped.items()] + [""]
        retired = {n: m.retired for n, m in matrix.methods.items() if m.retired is not None}
        if retired:
            lines += ["## Retired methods", "", "Reported from their committed cells; the code no longer runs them:"]
            lines += [""]
            lines += [f"- `{n}`: {r['why']} (its code last at commit {r['commit']})" for n, r in retired.items()] + [""]
    return lines + [
        "Notes: every `*_frac` share is over all rows of its kind in the whole run (summed counts over summed "
        "denominators, docs/METRICS.md); ratio means are means over rounds.",
        "",
    ]


def _rel(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def write_report(results: str | Path, matrix: Matrix | None = None, *, plots: bool = True) -> Path:
    """Write ``<results>/REPORT.md`` (and the curves); returns its path."""
    results = Path(results)
    results.mkdir(parents=True, exist_ok=True)
    out = results / "REPORT.md"
    out.write_text(render(results, matrix, plots=plots))
    return out


def print_report(results: Path, matrix: Path | None, *, plots: bool = True) -> int:
    """``hacrl-fed bench report``: rewrite and print ``<results>/REPORT.md`` (the matrix file, where it exists,
    names the cells that did not run)."""
    m = load_matrix(matrix) if matrix and Path(matrix).is_file() else None
    out = write_report(results, m, plots=plots)
    print(out.read_text())
    print(f"report: {out}", file=sys.stderr)
    return 0
