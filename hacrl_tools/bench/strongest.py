"""Why the strongest org gains little: its update decomposed round by round (issue 30, BENCHMARKS.md
"Why the strongest org gains little").

Two pure functions of one round's training rows, and a runner that computes them from a real run:

- :func:`own_shift`: what the rest of the learner's joint group does to its **own** rows' advantages. Each own row's
  advantage as the update computed it (``adv``: HACPO's joint-group baseline, or GSPO×2's group of ``2G``) is
  compared with the advantage it would have in a **reference group** of ``ref_size`` own rows of the same prompt
  (consecutive in sampling order): the learner's own group alone (HACPO, ``ref_size = G``), or one ``G``-row half of
  GSPO×2's group (``ref_size = G``: the group GSPO would use). Per prompt category of the reference group (``fail``:
  every row wrong, ``partial``, ``solved``: every row right; "right" = reward > 0, as rule ``successes`` reads it)
  it counts rows, right rows, right rows whose advantage shrank (``adv < ref``), wrong rows pushed harder
  (``adv < ref``), rows with a non-zero advantage either way, and sums the advantages.
- :func:`prompt_outcomes`: per prompt, the category of the reference group against whether the *other* rows of the
  group (the foreign rows the learner trains on; for GSPO×2 the other half) hold a success: a success where the
  reference group failed is the only row that shows the learner something its own group did not.

:func:`run_decomposition` runs one matrix cell (``configs/bench/matrix.yaml``: setting, method, seed) in-process
and wraps :meth:`hacrl_fed.trainer.LocalTrainer.update` to apply both functions to the watched learner's rows and
advantages each round (the advantages are recomputed with the trainer's own estimator: pure, deterministic), and
reads the share of foreign rows with a gradient from the update's own metrics (``hacpo/num_cross_grad``,
``hacpo/num_cross_in_band``, ``hacpo/num_cross``). ``scripts/strongest_decomposition.py`` is its command line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hacrl_fed.algorithm.advantages import ADV_EPS, group_advantages

CATEGORIES = ("fail", "partial", "solved")
SHIFT_COUNTS = (
    "rows",
    "right",
    "wrong",
    "right_shrunk",
    "wrong_pushed",
    "nonzero",
    "nonzero_ref",
    "sum_adv",
    "sum_ref",
    "sum_adv_right",
    "sum_ref_right",
    "sum_adv_wrong",
    "sum_ref_wrong",
)
CROSS_KEYS = ("num_cross", "num_cross_in_band", "num_cross_grad")


def reference_ids(group_ids: Sequence[int], own: Sequence[bool], ref_size: int) -> list[int]:
    """Per row, the index of its reference group: own rows of one prompt in chunks of ``ref_size`` consecutive rows
    (chunk ``c`` of prompt ``p``: a dense id per (p, c)); -1 for the other rows."""
    if ref_size < 1:
        raise ValueError(f"ref_size must be >= 1, got {ref_size}")
    seen: dict[int, int] = {}
    dense: dict[tuple[int, int], int] = {}
    out = []
    for g, is_own in zip(group_ids, own):
        if not is_own:
            out.append(-1)
            continue
        k = seen.get(int(g), 0)
        seen[int(g)] = k + 1
        out.append(dense.setdefault((int(g), k // ref_size), len(dense)))
    return out


def category(rewards: Sequence[float]) -> str:
    """``fail`` (no reward > 0), ``solved`` (every reward > 0) or ``partial``."""
    right = sum(1 for r in rewards if r > 0)
    return "fail" if right == 0 else "solved" if right == len(rewards) else "partial"


def own_shift(
    rewards: Sequence[float],
    group_ids: Sequence[int],
    own: Sequence[bool],
    adv: Sequence[float],
    ref_size: int,
    eps: float = 1e-6,
) -> dict[str, dict[str, float]]:
    """``{category: {count: value}}`` over the own rows (module docstring). ``adv[N]``: the update's advantages of
    every row; the reference advantage of an own row is ``(R − mean_ref) / (std_ref + eps)`` over its reference
    group (:func:`reference_ids`; 0 in a uniform one), GSPO's with ``G = ref_size``."""
    ref_ids = reference_ids(group_ids, own, ref_size)
    idx = [i for i, r in enumerate(ref_ids) if r >= 0]
    out = {c: dict.fromkeys(SHIFT_COUNTS, 0.0) for c in CATEGORIES}
    if not idx:
        return out
    own_r = torch.tensor([float(rewards[i]) for i in idx], dtype=torch.float64)
    ref = group_advantages(own_r, torch.tensor([ref_ids[i] for i in idx]), eps=eps).tolist()  # GSPO's A
    members: dict[int, list[float]] = {}
    for i in idx:
        members.setdefault(ref_ids[i], []).append(float(rewards[i]))
    for k, i in enumerate(idx):
        c, r, a, a0 = out[category(members[ref_ids[i]])], float(rewards[i]), float(adv[i]), ref[k]
        side = "right" if r > 0 else "wrong"
        c["rows"] += 1
        c[side] += 1
        c["right_shrunk" if r > 0 else "wrong_pushed"] += a < a0 - 1e-5  # below the reference (float32 adv)
        c["nonzero"] += abs(a) > 1e-5
        c["nonzero_ref"] += abs(a0) > 1e-5
        c["sum_adv"] += a
        c["sum_ref"] += a0
        c[f"sum_adv_{side}"] += a
        c[f"sum_ref_{side}"] += a0
    return out


def prompt_outcomes(
    rewards: Sequence[float], group_ids: Sequence[int], own: Sequence[bool], ref_size: int
) -> dict[str, float]:
    """Per reference group (:func:`reference_ids`): ``<category>/other_success`` when some other row of its prompt
    (the foreign rows, or the learner's other own rows: GSPO×2's other half) has reward > 0, else
    ``<category>/no_other_success``; counts of reference groups. ``other_successes/<category>``: those rows."""
    ref_ids = reference_ids(group_ids, own, ref_size)
    members: dict[int, list[float]] = {}
    prompt_of: dict[int, int] = {}
    for i, k in enumerate(ref_ids):
        if k >= 0:
            members.setdefault(k, []).append(float(rewards[i]))
            prompt_of[k] = int(group_ids[i])
    out = {f"{c}/{o}": 0.0 for c in CATEGORIES for o in ("other_success", "no_other_success")}
    out.update({f"other_successes/{c}": 0.0 for c in CATEGORIES})
    for k, rs in members.items():
        others = sum(
            1 for i, r in enumerate(rewards) if int(group_ids[i]) == prompt_of[k] and ref_ids[i] != k and float(r) > 0
        )
        c = category(rs)
        out[f"{c}/{'other_success' if others else 'no_other_success'}"] += 1
        out[f"other_successes/{c}"] += others
    return out


def summarize(shift: dict[str, dict[str, float]], outcomes: dict[str, float], cross: dict[str, float]) -> dict:
    """The decomposition's figures from the counts summed over rounds (see BENCHMARKS.md for their reading)."""
    tot = {k: sum(shift[c][k] for c in CATEGORIES) for k in SHIFT_COUNTS}

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    per_cat = {
        c: {
            "own_rows_share": ratio(shift[c]["rows"], tot["rows"]),
            "mean_adv": ratio(shift[c]["sum_adv"], shift[c]["rows"]),
            "mean_ref": ratio(shift[c]["sum_ref"], shift[c]["rows"]),
            "mean_adv_right": ratio(shift[c]["sum_adv_right"], shift[c]["right"]),
            "mean_ref_right": ratio(shift[c]["sum_ref_right"], shift[c]["right"]),
            "mean_adv_wrong": ratio(shift[c]["sum_adv_wrong"], shift[c]["wrong"]),
            "mean_ref_wrong": ratio(shift[c]["sum_ref_wrong"], shift[c]["wrong"]),
            "right_shrunk_share": ratio(shift[c]["right_shrunk"], shift[c]["right"]),
            "wrong_pushed_share": ratio(shift[c]["wrong_pushed"], shift[c]["wrong"]),
            "shift_contribution": ratio(shift[c]["sum_adv"] - shift[c]["sum_ref"], tot["rows"]),
        }
        for c in CATEGORIES
    }
    groups = sum(outcomes[f"{c}/{o}"] for c in CATEGORIES for o in ("other_success", "no_other_success"))
    return {
        "own_rows": tot["rows"],
        "mean_adv_own": ratio(tot["sum_adv"], tot["rows"]),
        "mean_ref_own": ratio(tot["sum_ref"], tot["rows"]),
        "mean_shift": ratio(tot["sum_adv"] - tot["sum_ref"], tot["rows"]),
        "right_shrunk_share": ratio(tot["right_shrunk"], tot["right"]),
        "wrong_pushed_share": ratio(tot["wrong_pushed"], tot["wrong"]),
        "nonzero_share": ratio(tot["nonzero"], tot["rows"]),
        "nonzero_ref_share": ratio(tot["nonzero_ref"], tot["rows"]),
        "by_category": per_cat,
        "prompts": {k: ratio(v, groups) for k, v in outcomes.items() if "/" in k and not k.startswith("other_")},
        "other_successes_per_group": {
            c: ratio(
                outcomes[f"other_successes/{c}"], outcomes[f"{c}/other_success"] + outcomes[f"{c}/no_other_success"]
            )
            for c in CATEGORIES
        },
        "foreign_rows": cross.get("num_cross", 0.0),
        "foreign_in_band_share": ratio(cross.get("num_cross_in_band", 0.0), cross.get("num_cross", 0.0)),
        "foreign_grad_share": ratio(cross.get("num_cross_grad", 0.0), cross.get("num_cross", 0.0)),
    }


class Recorder:
    """The counts of one watched learner, summed over the rounds of a run (and kept per round)."""

    def __init__(self, learner: str, ref_size: int, eps: float) -> None:
        self.learner, self.ref_size, self.eps = learner, ref_size, eps
        self.shift = {c: dict.fromkeys(SHIFT_COUNTS, 0.0) for c in CATEGORIES}
        self.outcomes: dict[str, float] = {}
        self.cross = dict.fromkeys(CROSS_KEYS, 0.0)
        self.rounds: list[dict[str, Any]] = []

    def add(self, rows: Sequence[Any], adv: Sequence[float], update: dict[str, float], algo: str) -> None:
        rewards = [float(r.reward) for r in rows]
        groups = [int(r.group) for r in rows]
        own = [bool(r.is_self) for r in rows]
        shift = own_shift(rewards, groups, own, adv, self.ref_size, self.eps)
        outcomes = prompt_outcomes(rewards, groups, own, self.ref_size)
        for c in CATEGORIES:
            for k in SHIFT_COUNTS:
                self.shift[c][k] += shift[c][k]
        for k, v in outcomes.items():
            self.outcomes[k] = self.outcomes.get(k, 0.0) + v
        cross = {k: float(update.get(f"{algo}/{k}", 0.0)) for k in CROSS_KEYS}
        for k, v in cross.items():
            self.cross[k] += v
        self.rounds.append({"shift": shift, "outcomes": outcomes, "cross": cross})

    def result(self) -> dict[str, Any]:
        return summarize(self.shift, self.outcomes, self.cross)


def _wrap_update(recorders: dict[str, Recorder]):
    """Wrap :meth:`LocalTrainer.update` so that each watched learner's round lands in its :class:`Recorder`;
    returns a function that restores the original."""
    from hacrl_fed.trainer import LocalTrainer

    original = LocalTrainer.update

    def update(self, rows, learner, capability, names=None, prepared=None, importance=None, reweigh=None):
        prepared = self.prepare(rows, names) if prepared is None and rows else prepared
        out = original(self, rows, learner, capability, names, prepared, importance, reweigh)
        rec = recorders.get(names[learner]) if names is not None and rows else None
        if rec is not None:  # the update's own (pure) advantages
            adv = self.advantages(rows, learner, capability, prepared).tolist()
            rec.add(rows, adv, out, self.algo.name)
        return out

    LocalTrainer.update = update  # type: ignore[method-assign]

    def restore() -> None:
        LocalTrainer.update = original  # type: ignore[method-assign]

    return restore


def run_decomposition(
    setting: str,
    method: str,
    seed: int,
    *,
    rounds: int,
    eval_size: int,
    ref_size: int,
    extra: dict[str, Any] | None = None,
    org_rules: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run cell ``setting/method/seed`` of the matrix for ``rounds`` rounds (held-out accuracy on ``eval_size``
    prompts before and after) and decompose every org's update; the result per org: its accuracy before and after
    and :func:`summarize`'s figures. ``org_rules``: ``{org: selection rule}`` set for those orgs only
    (``orgs[].trainer.selection.rule``; the others keep the method's)."""
    import tempfile
    from pathlib import Path

    from hacrl_tools.bench.learning import run_cell
    from hacrl_tools.bench.matrix import build_cell, load_matrix

    matrix = load_matrix()
    overrides = {"task.eval_size": int(eval_size), "federation.eval_every": int(rounds), **(extra or {})}
    cell = build_cell(matrix, setting, method, seed, "decomposition", rounds=rounds, extra=overrides)
    if org_rules and cell.config_dict is not None:
        orgs = [dict(o) for o in cell.config_dict["orgs"]]
        for o in orgs:
            if o["id"] in org_rules:
                o["trainer"] = {**o.get("trainer", {}), "selection": {"rule": org_rules[o["id"]]}}
        overrides["orgs"] = orgs
        cell = build_cell(matrix, setting, method, seed, "decomposition", rounds=rounds, extra=overrides)
    if cell.config is None:
        raise ValueError(f"{cell.key} does not run: {cell.skip}")
    eps = ADV_EPS
    recorders = {o.id: Recorder(o.id, ref_size, eps) for o in cell.config.orgs}
    restore = _wrap_update(recorders)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            result = run_cell(cell, Path(tmp), allow_build=False)
    finally:
        restore()
    return {
        "setting": setting,
        "method": method,
        "seed": seed,
        "rounds": rounds,
        "eval_size": eval_size,
        "ref_size": ref_size,
        "overrides": cell.overrides,
        "org_rules": org_rules or {},
        "code": result["code"],
        "run_s": result["run_s"],
        "orgs": {
            org: {
                "accuracy_before": result["agents"][org]["accuracy_before"],
                "accuracy_after": result["agents"][org]["accuracy_after"],
                **rec.result(),
            }
            for org, rec in recorders.items()
        },
    }


TABLE_HEAD = (
    "| setting | method | org | acc. before → after | mean own A (GSPO: 0) | from partial / fail prompts "
    "| right rows shrunk | wrong rows pushed | mean A of own right rows (GSPO's) | foreign rows a round, with gradient "
    "| prompts: failed, peer succeeds | partial, peer succeeds | failed, no peer success |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def table_rows(runs: Sequence[dict[str, Any]], orgs: Sequence[str] = ()) -> list[str]:
    """One markdown row per (run, org) of :data:`TABLE_HEAD` (``orgs``: only these; empty: all)."""

    def f(x: float | None, spec: str = "+.2f") -> str:
        return "–" if x is None else format(x, spec)

    out = []
    for r in runs:
        method = r["method"] + "".join(f", {o}: {rule}" for o, rule in r.get("org_rules", {}).items())
        for org, o in r["orgs"].items():
            if orgs and org not in orgs:
                continue
            cat, p = o["by_category"], o["prompts"]
            grad = f"{o['foreign_rows'] / r['rounds']:.0f}, {f(o['foreign_grad_share'], '.2f')}"
            out.append(
                f"| `{r['setting']}` | {method} | {org} | {o['accuracy_before']:.3f} → {o['accuracy_after']:.3f} "
                f"| {f(o['mean_shift'])} | {f(cat['partial']['shift_contribution'])} / "
                f"{f(cat['fail']['shift_contribution'])} | {f(o['right_shrunk_share'], '.2f')} "
                f"| {f(o['wrong_pushed_share'], '.2f')} | {f(cat['partial']['mean_adv_right'])} "
                f"({f(cat['partial']['mean_ref_right'])}) | {grad if o['foreign_rows'] else '–'} "
                f"| {p['fail/other_success']:.2f} | {p['partial/other_success']:.2f} "
                f"| {p['fail/no_other_success']:.2f} |"
            )
    return out


def method_label(run: dict[str, Any]) -> str:
    """A run's method with its per-org rules (``hacpo_defended, acme: all``)."""
    return run["method"] + "".join(f", {o}: {rule}" for o, rule in run.get("org_rules", {}).items())


def compare_rows(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown rows: per setting and org, the final accuracy of each method label (mean over the seeds it ran,
    and the seeds' own values), and each label's difference from ``gspo_x2`` paired by seed."""
    acc: dict[tuple[str, str], dict[str, dict[int, float]]] = {}
    for r in runs:
        for org, o in r["orgs"].items():
            acc.setdefault((r["setting"], org), {}).setdefault(method_label(r), {})[r["seed"]] = o["accuracy_after"]
    out = []
    for (setting, org), by_label in acc.items():
        ref = by_label.get("gspo_x2", {})
        for label, seeds in by_label.items():
            mean = sum(seeds.values()) / len(seeds)
            paired = [100 * (seeds[k] - ref[k]) for k in seeds if k in ref]
            delta = f"{sum(paired) / len(paired):+.1f}" if paired and label != "gspo_x2" else "–"
            vals = ", ".join(f"{seeds[k]:.3f}" for k in sorted(seeds))
            out.append(f"| `{setting}` | {org} | {label} | {len(seeds)} | {mean:.3f} ({vals}) | {delta} |")
    return out
