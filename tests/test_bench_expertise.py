"""The expertise settings (issue 30): recipes of the slice specialists, the configs whose held-out eval mixes their
slices, and the matrix cells that run them (the agents themselves are built by ``hacrl-fed bench agents build``)."""

from __future__ import annotations

import pytest

from hacrl_fed.tasks import get_task
from hacrl_tools.bench import agents, learning
from hacrl_tools.bench import matrix as bench_matrix
from tests.helpers_scripts import load_script

EXPERTS = {"qwen-char-add": "add", "qwen-char-sub": "sub", "qwen-char-mul": "mul"}


@pytest.mark.parametrize(("name", "slice_name"), list(EXPERTS.items()))
def test_each_specialists_sft_draws_its_own_slice_only(name, slice_name):
    entry = agents.BENCH_AGENTS[name]
    assert entry.task_params == {"difficulty": 2, **agents.EXPERTISE_SLICES[slice_name]}
    task = get_task(entry.task, dict(entry.task_params), seed=entry.task_seed)
    ops = set(agents.EXPERTISE_SLICES[slice_name]["ops"])
    for i in range(200):
        expr = task.problem("train", i).expression
        assert set(expr) - set("0123456789") == ops, expr


def test_the_specialists_differ_only_in_slice_and_seed():
    entries = [agents.BENCH_AGENTS[n] for n in EXPERTS]
    assert len({e.recipe_hash() for e in entries}) == len({e.sft.seed for e in entries}) == 3
    assert len({(e.arch, e.tokenizer, tuple(sorted(e.arch_kwargs.items()))) for e in entries}) == 1


def test_a_missing_specialist_names_the_command_that_builds_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="hacrl-fed bench agents build qwen-char-mul"):
        agents.ensure_agent(tmp_path / "qwen-char-mul", allow_build=False)


def test_the_expertise_cells_mix_every_orgs_slice_in_the_eval():
    cells = bench_matrix.plan_cells(bench_matrix.load_matrix(), only=["expertise"], seeds=[0])
    by = {(c.setting, c.method): c for c in cells}
    assert set(by) == {
        (s, m) for s in ("expertise2", "expertise3") for m in ("gspo", "gspo_x2", "hacpo", "hacpo_defended")
    }
    for setting, n in (("expertise2", 2), ("expertise3", 3)):
        cell = by[(setting, "hacpo")]
        names = [a.name for a in cell.agents]
        assert len(names) == n == len(cell.config.orgs) and set(names) <= set(EXPERTS)
        slices = cell.config.task.params["slices"]
        task = get_task(cell.config.task.name, dict(cell.config.task.params))  # the config's params validate
        assert {task.slice_label("test", i) for i in range(60)} == set(slices)
        assert slices == {EXPERTS[a]: agents.EXPERTISE_SLICES[EXPERTS[a]] for a in names}  # one slice per org


def test_a_cell_keeps_each_orgs_accuracy_per_slice_and_nothing_new_without_slices():
    rec0 = {"eval/acme/accuracy": 0.5, "eval/acme/slice/add/accuracy": 0.9, "eval/acme/slice/sub/accuracy": 0.1,
            "eval/acme/slice/add/prompts": 10.0, "eval/globex/slice/add/accuracy": 0.2}  # fmt: skip
    rec1 = {"eval/acme/accuracy": 0.6, "eval/acme/slice/add/accuracy": 0.95, "eval/acme/slice/sub/accuracy": 0.25}
    got = learning.summarize_agent("acme", [(0, rec0), (10, rec1)])
    assert got["slice_curves"] == {"add": [[0, 0.9], [10, 0.95]], "sub": [[0, 0.1], [10, 0.25]]}
    plain = learning.summarize_agent("acme", [(0, {"eval/acme/accuracy": 0.5})])
    assert "slice_curves" not in plain and plain["curve"] == [[0, 0, 0.5]]


MIXED = {"qwen-char-mostly-add": "add", "qwen-char-mostly-sub": "sub", "qwen-char-mostly-mul": "mul"}


@pytest.mark.parametrize(("name", "slice_name"), list(MIXED.items()))
def test_each_mixed_agents_sft_draws_mostly_its_own_slice_and_every_other(name, slice_name):
    entry = agents.BENCH_AGENTS[name]
    task = get_task(entry.task, dict(entry.task_params), seed=entry.task_seed)
    labels = [task.slice_label("train", i) for i in range(1200)]
    assert set(labels) == set(agents.EXPERTISE_SLICES)
    assert 0.70 < labels.count(slice_name) / len(labels) < 0.80  # 6:1:1


def test_the_mixed_cells_run_every_orgs_mostly_agent_on_the_uniform_eval():
    cells = bench_matrix.plan_cells(bench_matrix.load_matrix(), only=["mixed"], seeds=[0])
    by = {(c.setting, c.method): c for c in cells}
    assert set(by) == {(s, m) for s in ("mixed2", "mixed3") for m in ("gspo", "gspo_x2", "hacpo", "hacpo_defended_split")}
    for setting, n in (("mixed2", 2), ("mixed3", 3)):
        cell = by[(setting, "hacpo")]
        names = [a.name for a in cell.agents]
        assert len(names) == n and set(names) <= set(MIXED)
        slices = cell.config.task.params["slices"]
        assert slices == {MIXED[a]: agents.EXPERTISE_SLICES[MIXED[a]] for a in names}  # uniform: no weights


def test_org_gains_pairs_each_org_with_its_references_by_seed(tmp_path, capsys):
    """Hand-computed: acme +10 and +20 points over GSPO at seeds 0 and 1 (mean 15, se 5: above); globex -1 and +1."""
    import json

    def cell(method, seed, acme, globex):
        path = tmp_path / "s" / method / f"seed{seed}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        agents = {o: {"accuracy_after": a, "slice_curves": {"add": [[0, 0.1], [60, a]]}} for o, a in
                  (("acme", acme), ("globex", globex))}  # fmt: skip
        path.write_text(json.dumps({"setting": "s", "method": method, "seed": seed, "agents": agents}))

    for seed, (g, x2, h) in enumerate([((0.3, 0.5), (0.35, 0.5), (0.4, 0.49)), ((0.3, 0.5), (0.3, 0.5), (0.5, 0.51))]):
        cell("gspo", seed, *g)
        cell("gspo_x2", seed, *x2)
        cell("hacpo", seed, *h)
    mod = load_script("org_gains")
    assert mod.main(["s", "--methods", "hacpo", "--results", str(tmp_path), "--json", str(tmp_path / "o.json")]) == 0
    rows = {r["org"]: r for r in json.loads((tmp_path / "o.json").read_text())}
    assert rows["acme"]["gspo"]["mean"] == pytest.approx(15.0) and rows["acme"]["gspo"]["se"] == pytest.approx(5.0)
    assert rows["acme"]["gspo"]["verdict"] == "above" and rows["acme"]["gspo_x2"]["mean"] == pytest.approx(12.5)
    assert rows["globex"]["gspo"]["mean"] == pytest.approx(0.0) and rows["globex"]["gspo"]["verdict"] == "not resolved"
    assert rows["acme"]["slices"] == {"add": pytest.approx(0.45)} and rows["acme"]["seeds"] == [0, 1]
    assert "| `hacpo` | acme | 0,1 | 0.450 | +15.0 ± 5.0 (above)" in capsys.readouterr().out
    assert mod.main(["nothing", "--methods", "hacpo", "--results", str(tmp_path)]) == 2
