"""The package's layers, read from the source (AST): every import counts, at module level, inside a function (lazy)
or under ``if TYPE_CHECKING:``.

- Nothing in the federation's runtime (``hacrl_fed`` apart from its command line ``hacrl_fed.cli``, and the Flower
  apps ``server`` / ``client``) imports the tools package ``hacrl_tools``; the command line loads it only through
  :func:`hacrl_fed.cli.common.load_tools`.
- The tools find their inputs from arguments or the working directory, not from where they are installed.
- The worker side never imports the coordinator package: what both sides run (prompt sampling, batch screening)
  lives below both, in ``hacrl_fed.plan``, which imports neither.
- The generation engines and the wire (``hacrl_fed.engines``, ``hacrl_fed.wire``) never import the worker, and the
  metrics (``hacrl_fed.metrics``) never import the coordinator: both sit below what they serve.
- No import cycle anywhere in ``hacrl_fed`` and ``hacrl_tools``.
- No function in ``hacrl_fed`` is over 60 lines (from its ``def`` line to its last line, decorators excluded).

An edge goes to the module an import names (``from a.b import c``: ``a.b.c`` when that is a module, else ``a.b``);
the parent packages Python initialises on the way are not edges (a package ``__init__`` that re-exports its
submodules would otherwise be a cycle with each of them).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS = "hacrl_tools"

def _modules(*packages: str) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join(parts)
            if not name.startswith("hacrl_fed.v1"):  # generated protobuf modules
                out[name] = path
    return out


def _imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module ``name`` imports anywhere in its source (absolute names; relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in known else base)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module",
            "__import__",
        ):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                out.add(node.args[0].value)
    return out


def _graph(*packages: str) -> dict[str, set[str]]:
    mods = _modules(*packages)
    return {name: {m for m in _imported(name, path, mods) if m in mods and m != name} for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in sorted(graph):
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
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def _is_tool_or_cli(module: str) -> bool:
    return module == TOOLS or module.startswith(f"{TOOLS}.") or module.startswith("hacrl_fed.cli")


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}, "g": set()}
    assert sorted(map(sorted, _cycles(graph))) == [["a", "b", "c"], ["e", "f"]]
    mods = _modules("hacrl_fed")
    assert "hacrl_fed.coordinator.launcher" in _imported("hacrl_fed.cli.run", mods["hacrl_fed.cli.run"], mods)  # lazy


def test_no_runtime_module_imports_the_tools():
    mods = _modules("hacrl_fed", "server", "client", TOOLS)
    runtime = {n: p for n, p in mods.items() if not _is_tool_or_cli(n)}
    assert "hacrl_fed.lifecycle" in runtime and "server.app" in runtime and "hacrl_fed.wire.codec" in runtime
    offenders = {
        name: sorted(m for m in _imported(name, path, mods) if m == TOOLS or m.startswith(f"{TOOLS}."))
        for name, path in runtime.items()
    }
    assert {n: m for n, m in offenders.items() if m} == {}


def test_the_cli_loads_the_tools_only_through_load_tools():
    mods = _modules("hacrl_fed", TOOLS)
    cli = {n: p for n, p in mods.items() if n.startswith("hacrl_fed.cli")}
    assert {"hacrl_fed.cli.bench", "hacrl_fed.cli.deploy_local", "hacrl_fed.cli.gpu_check"} <= set(cli)
    direct = {n: sorted(m for m in _imported(n, p, mods) if m.startswith(TOOLS)) for n, p in cli.items()}
    assert {n: m for n, m in direct.items() if m} == {}


def test_domain_modules_parse_no_command_line():
    """argparse lives in the command line (hacrl_fed.cli) only; the tools' child processes take a spec instead."""
    mods = _modules("hacrl_fed", TOOLS)
    parsing = sorted(n for n, p in mods.items() if "argparse" in _imported(n, p, mods))
    assert parsing and all(n == "hacrl_fed.cli" or n.startswith("hacrl_fed.cli.") for n in parsing), parsing


def test_the_tools_find_their_inputs_from_arguments_or_the_working_directory():
    """``__file__`` only where code is located (a child's PYTHONPATH, the TRL runner script beside its caller)."""
    uses = {}
    for name, path in _modules(TOOLS).items():
        lines = [i for i, line in enumerate(path.read_text().splitlines(), 1) if "__file__" in line]
        if lines:
            uses[name] = len(lines)
    assert uses == {"hacrl_tools": 1, "hacrl_tools.bench.trl_compare": 1}


def test_the_tools_and_the_cli_are_in_no_import_cycle():
    graph = _graph("hacrl_fed", TOOLS)
    assert "hacrl_tools.bench.matrix" in graph["hacrl_tools.bench.report"]  # the matrix both import
    assert "hacrl_tools.bench.learning" not in graph["hacrl_tools.bench.report"]
    assert [c for c in _cycles(graph) if any(_is_tool_or_cli(m) for m in c)] == []


def _below(graph: dict[str, set[str]], module: str, packages: tuple[str, ...]) -> list[str]:
    return sorted(d for d in graph[module] if d in packages or d.startswith(tuple(f"{p}." for p in packages)))


def test_the_scan_sees_lazy_and_type_checking_imports():
    graph = _graph("hacrl_fed")
    assert "hacrl_fed.security.keyring" in graph["hacrl_fed.coordinator.loop"]  # imported inside __init__
    assert "hacrl_fed.worker.policy_worker" in graph["hacrl_fed.worker"]  # imported inside build_worker
    assert "hacrl_fed.plan.screening" in graph["hacrl_fed.worker.intake"]


def test_the_worker_never_imports_the_coordinator():
    graph = _graph("hacrl_fed")
    worker = [m for m in graph if m == "hacrl_fed.worker" or m.startswith("hacrl_fed.worker.")]
    assert len(worker) > 3
    assert {m: _below(graph, m, ("hacrl_fed.coordinator",)) for m in worker} == {m: [] for m in worker}


def test_the_plan_package_sits_below_the_coordinator_and_the_worker():
    graph = _graph("hacrl_fed")
    plan = [m for m in graph if m == "hacrl_fed.plan" or m.startswith("hacrl_fed.plan.")]
    assert len(plan) == 3
    above = ("hacrl_fed.coordinator", "hacrl_fed.worker")
    assert {m: _below(graph, m, above) for m in plan} == {m: [] for m in plan}
    assert "hacrl_fed.plan.screening" in graph["hacrl_fed.coordinator.trust"]


def test_the_package_has_no_import_cycle():
    """Every cycle in hacrl_fed and hacrl_tools, lazy and TYPE_CHECKING imports counted: none."""
    assert _cycles(_graph("hacrl_fed", TOOLS)) == []


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def test_the_engines_and_the_wire_never_import_the_worker():
    graph = _graph("hacrl_fed")
    lower = sorted(m for m in graph if _in(m, "hacrl_fed.engines") or _in(m, "hacrl_fed.wire"))
    assert {"hacrl_fed.engines.hf", "hacrl_fed.wire.codec", "hacrl_fed.wire.grpc_server"} <= set(lower)
    offenders = {m: d for m in lower if (d := _below(graph, m, ("hacrl_fed.worker",)))}
    assert offenders == {}, f"engines/wire modules importing the worker: {offenders}"


def test_the_metrics_never_import_the_coordinator():
    graph = _graph("hacrl_fed")
    assert "hacrl_fed.run_files" in graph["hacrl_fed.metrics"]  # the scan sees the module's imports
    offenders = _below(graph, "hacrl_fed.metrics", ("hacrl_fed.coordinator",))
    assert offenders == [], f"hacrl_fed.metrics imports the coordinator: {offenders}"


MAX_FUNCTION_LINES = 60


def _function_lengths(source: str) -> dict[str, int]:
    """``{qualified name: lines}`` of every function and method in ``source``, nested ones too: from the ``def``
    line to the function's last line (decorators excluded)."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out[name] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def test_the_function_length_counts_from_the_def_line_to_the_last():
    source = "@decorator\n@another(1)\ndef f(x):\n    y = x\n\n    return y\n\n\nclass C:\n    async def g(self):\n"
    source += "        def inner():\n            pass\n        return inner\n"
    assert _function_lengths(source) == {"f": 4, "C.g": 4, "C.g.inner": 2}


def test_no_function_in_the_package_is_over_60_lines():
    lengths = {}
    for name, path in _modules("hacrl_fed").items():  # the generated hacrl_fed.v1 left out
        lengths.update({f"{name}:{fn}": n for fn, n in _function_lengths(path.read_text()).items()})
    assert len(lengths) > 500 and max(lengths.values()) > 30  # the scan sees the package's functions
    long = {fn: n for fn, n in sorted(lengths.items(), key=lambda item: -item[1]) if n > MAX_FUNCTION_LINES}
    assert long == {}, f"{len(long)} functions over {MAX_FUNCTION_LINES} lines: {long}"
