"""The benchmark matrix after issue 42 (hacrl_tools/bench/matrix.py): the bench-only fields of a method's ``set``
(the in-process virtual clock) split off the run config into the cell's bench layer and recorded back in its stored
config; a stored config holding a field the run config no longer has compares equal at the value today's code runs
with (``REMOVED_FIELDS``), and only there."""

from __future__ import annotations

from pathlib import Path

import yaml

from hacrl_fed.coordinator.virtual_clock import VirtualClock
from hacrl_tools.bench import matrix as bench_matrix


def _cell(tmp_path: Path, set_: dict) -> bench_matrix.Cell:
    model = Path.cwd() / "configs" / "bench" / "model.yaml"
    data = {
        "settings": {"model": {"config": str(model)}},
        "methods": {"m": {"set": set_}},
        "groups": {"g": {"settings": ["model"], "methods": ["m"]}},
    }
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(data))
    (cell,) = bench_matrix.plan_cells(bench_matrix.load_matrix(path), seeds=[0])
    return cell


def test_the_virtual_clock_of_a_method_is_the_cells_bench_layer(tmp_path):
    steps = {"acme": 4.0}
    cell = _cell(tmp_path, {"federation.staleness": 1, "federation.min_orgs": 1, "federation.virtual_step_s": steps})
    assert cell.skip is None and cell.bench == {"federation.virtual_step_s": steps}
    assert cell.clock() == VirtualClock({"acme": 4.0})
    assert not hasattr(cell.config.federation, "virtual_step_s")  # not in the run config
    assert cell.overrides["federation.virtual_step_s"] == steps  # the cell's JSON keeps what the method set
    stored = cell.stored_config()  # where the run config held it: older cells and their readers agree
    assert stored["federation"]["virtual_step_s"] == steps and stored["federation"]["virtual_dies"] == {}
    assert all(o["emulate_slowdown"] == 1.0 for o in stored["orgs"])
    assert bench_matrix.same_run_config(stored, cell.config, cell.bench)
    slower = dict(stored, federation={**stored["federation"], "virtual_step_s": {"acme": 2.0}})
    assert not bench_matrix.same_run_config(slower, cell.config, cell.bench)
    plain = _cell(tmp_path, {"federation.staleness": 1, "federation.min_orgs": 1})
    assert plain.hash != cell.hash and plain.clock() == VirtualClock()


def test_a_bad_clock_skips_the_cell_naming_the_field(tmp_path):
    cell = _cell(tmp_path, {"federation.staleness": 1, "federation.min_orgs": 1, "federation.virtual_step_s": {"x": 1}})
    assert cell.config is None and "federation.virtual_step_s names orgs not in the run" in (cell.skip or "")


def test_a_removed_field_compares_equal_only_at_the_value_the_code_runs_with(tmp_path, monkeypatch):
    cell = _cell(tmp_path, {"algorithm.name": "hacpo", "trainer.likelihood_screen.enabled": True})
    stored = cell.stored_config()
    assert bench_matrix.same_run_config(stored, cell.config)
    screen = stored["trainer"]["likelihood_screen"]
    for value, same in ((0.8, True), (0.5, False)):  # history_decay: a constant 0.8 since issue 42
        screen["history_decay"] = value
        assert bench_matrix.same_run_config(stored, cell.config) is same
    del screen["history_decay"]
    stored["trainer"]["nonexistent"] = 1  # a field never known: a difference
    assert not bench_matrix.same_run_config(stored, cell.config)
    del stored["trainer"]["nonexistent"]
    monkeypatch.setitem(bench_matrix.REMOVED_FIELDS, "trainer.gone", {"enabled": False})  # a removed section
    stored["trainer"]["gone"] = {"enabled": False, "lr": 3.0}
    assert bench_matrix.same_run_config(stored, cell.config)
    stored["trainer"]["gone"]["enabled"] = True
    assert not bench_matrix.same_run_config(stored, cell.config)
