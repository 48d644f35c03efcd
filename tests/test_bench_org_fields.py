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
    m = _matrix(tmp_path, {"acme": {"trainer.selection.rule": "rescue"}})
    (cell,) = bench_matrix.plan_cells(m, seeds=[0])
    rules = [org_trainer(cell.config, o).selection.rule for o in ("acme", "globex", "initech")]
    assert rules == ["rescue", "successes", "successes"]
    plain = bench_matrix.plan_cells(_matrix(tmp_path, {}), seeds=[0])[0]
    assert plain.hash != cell.hash and org_trainer(plain.config, "acme").selection.rule == "successes"


def test_a_method_naming_an_org_the_setting_lacks_skips_the_cell(tmp_path):
    (cell,) = bench_matrix.plan_cells(_matrix(tmp_path, {"nobody": {"trainer.lr": 1.0}}), seeds=[0])
    assert cell.config is None and cell.skip == "the setting has no org nobody (method d sets its fields)"


def test_the_strongest_group_pairs_the_remedy_with_the_defaults():
    m = bench_matrix.load_matrix()
    assert m.groups["strongest"]["ref"] == "hacpo_defended"
    by = {(c.setting, c.method): c.config for c in bench_matrix.plan_cells(m, only=["strongest"], seeds=[0])}
    for setting in ("state", "size", "model", "three"):
        rescue, defended = by[(setting, "hacpo_defended_rescue")], by[(setting, "hacpo_defended")]
        assert org_trainer(rescue, "acme").selection.rule == "rescue"
        assert rescue.model_dump(exclude={"orgs", "name"}) == defended.model_dump(exclude={"orgs", "name"})
