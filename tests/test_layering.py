"""The package's import graph, read from the source (AST): every import counts, module-level, inside a function
(lazy) or under ``if TYPE_CHECKING:``.

* The worker side never imports the coordinator package: what both sides run (prompt sampling, batch screening)
  lives below both, in ``hacrl_fed.plan``, which imports neither.
* ``hacrl_fed`` has no import cycle (the tooling that is being moved out of the package, ``hacrl_fed/bench``,
  ``hacrl_fed/gpu_check.py`` and ``hacrl_fed/deploy``, is left out).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hacrl_fed"
TOOLING = ("hacrl_fed.bench", "hacrl_fed.gpu_check", "hacrl_fed.deploy")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module of the package that ``name`` (a module, or a name inside one) is defined in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """Every ``hacrl_fed`` module that ``module`` imports anywhere in its source (relative imports resolved)."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # "from pkg import module"
    return {m for name in found if name.startswith("hacrl_fed") and (m := _owner(name)) and m != module}


def test_the_import_scan_sees_lazy_and_type_checking_imports():
    """The scan itself: a function-level import and a TYPE_CHECKING import are both edges."""
    assert "hacrl_fed.security.keyring" in imports_of("hacrl_fed.coordinator.loop")  # imported inside __init__
    assert "hacrl_fed.worker.policy_worker" in imports_of("hacrl_fed.worker")  # imported inside build_worker
    assert "hacrl_fed.plan.screening" in imports_of("hacrl_fed.worker.guard")


def test_the_worker_never_imports_the_coordinator():
    offenders = {
        m: sorted(d for d in imports_of(m) if d == "hacrl_fed.coordinator" or d.startswith("hacrl_fed.coordinator."))
        for m in MODULES
        if m == "hacrl_fed.worker" or m.startswith("hacrl_fed.worker.")
    }
    assert {m: d for m, d in offenders.items() if d} == {}


def test_the_plan_package_sits_below_the_coordinator_and_the_worker():
    above = ("hacrl_fed.coordinator", "hacrl_fed.worker")
    plan = [m for m in MODULES if m == "hacrl_fed.plan" or m.startswith("hacrl_fed.plan.")]
    assert len(plan) == 3
    assert {m: sorted(d for d in imports_of(m) if d.startswith(above)) for m in plan} == {m: [] for m in plan}
    assert "hacrl_fed.plan.screening" in imports_of("hacrl_fed.coordinator.trust")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycle():
    core = {m for m in MODULES if not m.startswith(TOOLING)}
    graph = {m: {d for d in imports_of(m) if d in core} for m in core}
    assert _cycles(graph) == []
