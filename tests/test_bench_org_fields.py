"""A matrix method's per-org fields (configs/bench/matrix.yaml ``orgs:``; issue 30): one org's own settings."""

from pathlib import Path

import yaml

from hacrl_fed.config import org_trainer
from hacrl_tools.bench import matrix as bench_matrix


def _matrix(tmp_path: Path, orgs: dict) -> bench_matrix.Matrix:
    three = Path.cwd() / "configs" / "bench" / "three.yaml"
    data = {
        "settings": {"three": {"config": str(three)}},
        "methods": {"d": {"set": {"trainer.selection": {"rule": "successes"}}, "orgs": orgs}},
        "groups": {"g": {"settings": ["three"], "methods": ["d"]}},
    }
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(data))
    return bench_matrix.load_matrix(path)


def test_a_method_sets_one_orgs_fields_and_the_others_keep_the_methods(tmp_path):
    m = _matrix(tmp_path, {"acme": {"trainer.selection.budget_multiple": 1.0}})
    (cell,) = bench_matrix.plan_cells(m, seeds=[0])
    budgets = [org_trainer(cell.config, o).selection.budget_multiple for o in ("acme", "globex", "initech")]
    assert budgets == [1.0, 0.5, 0.5]
    plain = bench_matrix.plan_cells(_matrix(tmp_path, {}), seeds=[0])[0]
    assert plain.hash != cell.hash and org_trainer(plain.config, "acme").selection.budget_multiple == 0.5


def test_a_method_naming_an_org_the_setting_lacks_skips_the_cell(tmp_path):
    (cell,) = bench_matrix.plan_cells(_matrix(tmp_path, {"nobody": {"trainer.lr": 1.0}}), seeds=[0])
    assert cell.config is None and cell.skip == "the setting has no org nobody (method d sets its fields)"


def test_the_strongest_groups_remedy_is_retired_and_its_cells_still_read():
    """Rule rescue is gone (issue 42): its method no longer runs, names the commit its cells ran at, and the report
    tools still read those cells (they read the cells' JSON, not the config)."""
    from hacrl_tools.bench.report import load_results

    m = bench_matrix.load_matrix()
    assert m.groups["strongest"]["ref"] == "hacpo_defended"
    assert m.methods["hacpo_defended_rescue"].retired == {"commit": "2995b0d", "why": m.methods[
        "hacpo_defended_rescue"].retired["why"]}  # fmt: skip
    by = {(c.setting, c.method): c for c in bench_matrix.plan_cells(m, only=["strongest"], seeds=[0])}
    for setting in ("state", "size", "model", "three"):
        rescue, defended = by[(setting, "hacpo_defended_rescue")], by[(setting, "hacpo_defended")]
        assert rescue.config is None and "its cells ran at commit 2995b0d" in (rescue.skip or "")
        assert defended.skip is None and org_trainer(defended.config, "acme").selection.rule == "successes"
    cells = load_results(Path("benchmarks") / "results")
    for setting in ("state", "size", "model", "three"):
        runs = cells[(setting, "hacpo_defended_rescue")]
        assert [c["seed"] for c in runs] == [0, 1, 2, 3, 4]
        assert {c["code"]["commit"][:7] for c in runs} == {"2995b0d"}
