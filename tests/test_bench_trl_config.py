"""What ``hacrl-fed bench trl`` runs on our side (:mod:`hacrl_tools.bench.trl_ours`), checked against what was
decided: a new project default must not change the like-for-like comparison with TRL unnoticed (issue 43: the outcome
guard became a default and the bench's "ours" silently ran its shadow, 0.44 x instead of 1.80 x).

When the first test fails, a default changed what the like-for-like side resolves to. Decide whether TRL's
``GRPOTrainer`` does that work: if not, set the option in ``LIKE_FOR_LIKE`` (with TRL's value and why); then
rewrite the snapshot (``UPDATE_SNAPSHOT=1 pytest tests/test_bench_trl_config.py``) and say so in BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from hacrl_fed.cli.bench import trl_parser
from hacrl_tools.bench import trl_compare, trl_ours

SNAPSHOT = Path(__file__).parent / "data" / "bench_trl_ours_config.json"


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": [{"d": 2}]}`` -> ``{"a.b": 1, "c.0.d": 2}`` (an empty dict or list is a leaf)."""
    if isinstance(tree, list):
        tree = dict(enumerate(tree))
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> dict[str, Any]:
    """The spec ``hacrl-fed bench trl`` writes with its default options (the default model's prompts)."""
    out = tmp_path_factory.mktemp("trl")
    args = trl_parser(trl_compare).parse_args(["--threads", "2", "--out", str(out)])
    return trl_compare.make_spec(trl_compare.TrlOptions(**vars(args)), out / "spec.json")


def resolved(spec: dict[str, Any], side: str) -> dict[str, Any]:
    """The side's resolved config, the model folder (machine-dependent) named by its placeholder."""
    cfg = flatten(trl_ours.resolved(spec, side))
    return {k: ("<model_dir>" if v == spec["model_dir"] else v) for k, v in cfg.items()}


def test_the_like_for_like_side_resolves_to_the_committed_config(spec):
    """Every field of the like-for-like side's resolved config equals the committed snapshot's: a new default (or
    a new field) changes what the bench runs only through a reviewed change of the snapshot."""
    now = resolved(spec, "ours")
    if os.environ.get("UPDATE_SNAPSHOT"):
        SNAPSHOT.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    committed = json.loads(SNAPSHOT.read_text())
    changed = {k: (committed.get(k, "<absent>"), now.get(k, "<absent>")) for k in committed.keys() | now.keys()}
    changed = {k: v for k, v in changed.items() if v[0] != v[1]}
    assert not changed, (
        f"bench trl's like-for-like side now runs differently (field: committed -> now): {changed}; "
        "see this module's docstring"
    )


def test_no_switch_resolves_on_in_the_like_for_like_side_unless_named(spec):
    """A switch that resolves on in the like-for-like side (a new default-on feature) must be one LIKE_FOR_LIKE
    names: today none is on, since TRL has none of ours."""
    on = {k for k, v in resolved(spec, "ours").items() if v is True}
    assert on <= set(trl_ours.LIKE_FOR_LIKE), f"switches on that TRL lacks, not set by the bench: {on}"


def test_the_defaults_side_differs_only_in_the_like_for_like_options(spec):
    """The defaults side runs the same work; it differs from the like-for-like side only where LIKE_FOR_LIKE
    sets an option, and there it holds the project's default (the guard on, among others)."""
    ours, defaults = resolved(spec, "ours"), resolved(spec, "defaults")
    differ = {k for k in ours if ours[k] != defaults[k]}
    assert differ <= set(trl_ours.LIKE_FOR_LIKE)
    assert {k for k, (v, _) in trl_ours.LIKE_FOR_LIKE.items() if ours[k] != v} == set()
    assert "trainer.outcome_guard.enabled" in differ  # the reason for the split (issue 43): the guard's cost
    table = trl_ours.like_for_like_table(trl_ours.resolved(spec, "defaults"))
    assert "| `trainer.outcome_guard.enabled` | false | true |" in table


def test_the_spec_renders_prompts_as_our_worker_does(spec):
    """Both sides condition on the prompt text our worker renders for the model (its PromptStyle)."""
    from transformers import AutoTokenizer

    from hacrl_fed.models.prompting import prompt_style
    from hacrl_fed.tasks import get_task

    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    task = get_task("arithmetic", {"difficulty": 2}, seed=spec["seed"])
    first = task.prompts("train", [0])[0]
    assert spec["prompts"][0]["text"] == prompt_style(tok, task).render(tok, first.messages)
    assert len(spec["prompts"]) == spec["prompts_per_batch"] * spec["batches"]


def test_the_model_option_takes_a_packaged_real_checkpoint(monkeypatch, tmp_path):
    """``--model smollm2-135m`` is the converted folder ``model.real`` would use; a folder is taken as given."""
    import hacrl_fed.models.real as real

    seen = []
    monkeypatch.setattr(real, "real_source", lambda name: seen.append(name) or tmp_path)
    assert trl_compare.model_dir("smollm2-135m") == tmp_path and seen == ["smollm2-135m"]
    assert trl_compare.model_dir(str(tmp_path)) == tmp_path and seen == ["smollm2-135m"]
    assert trl_compare.result_name("smollm2-135m") == "trl-smollm2-135m.json"
    assert trl_compare.result_name("qwen-char") == "trl.json"


def run(side: str, rep: int, batch_s: list[float], load: float = 1.0) -> dict[str, Any]:
    return {"side": side, "repeat": rep, "batch_s": batch_s, "completions_per_batch": 128, "peak_rss_mb": 500.0,
            "loadavg_before": [load, 0, 0], "loadavg_after": [load + 1, 0, 0]}  # fmt: skip


def test_the_ratios_are_paired_by_repeat_with_their_standard_error():
    """ours / TRL and defaults / ours are the mean of the per-repeat ratios ± SE; the load averages recorded."""
    runs = [
        run("ours", 0, [9.0, 1.0, 1.0]), run("trl", 0, [9.0, 2.0, 2.0]), run("defaults", 0, [9.0, 2.0, 6.0]),
        run("ours", 1, [9.0, 1.0, 1.0]), run("trl", 1, [9.0, 4.0, 4.0]), run("defaults", 1, [9.0, 4.0, 4.0], 3.0),
    ]  # fmt: skip
    s = trl_compare.compare(runs)
    assert s["paired_ours_over_trl"]["per_repeat"] == [2.0, 4.0]
    assert s["paired_ours_over_trl"]["mean"] == 3.0 and s["paired_ours_over_trl"]["se"] == pytest.approx(1.0)
    assert s["paired_defaults_over_ours"]["per_repeat"] == [0.25, 0.25]  # median batch 4 s against 1 s
    assert s["paired_defaults_over_ours_mean_batch"]["per_repeat"] == [0.25, 0.25]
    assert s["paired_defaults_over_trl"]["per_repeat"] == [0.5, 1.0]
    assert s["loadavg_1min"] == {"mean": pytest.approx(22 / 12), "min": 1.0, "max": 4.0}  # before and after
    text = trl_compare.format_summary(s)
    assert "ours / TRL (like for like): throughput x3.00 ± 1.00 (n=2: 2.00, 4.00)" in text
    assert "the defaults' cost: defaults / ours throughput x0.25 ± 0.00" in text
    assert "| defaults | 32.0 | 4.000 | 4.000 |" in text
    assert trl_compare.rate(21.03) == "21.0" and trl_compare.rate(0.03473) == "0.0347"  # a real model under load
    one = trl_compare.compare(runs[:3])
    assert one["paired_ours_over_trl"]["se"] is None and "no SE (one repeat)" in trl_compare.format_summary(one)
