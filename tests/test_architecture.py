"""The house's shape (issue 40): data flows one way through autopar's layers, and the import graph
says so. A module sits above every module it imports, imports inside functions included; the
graph is read from the source with `ast`, so it also sees imports that never ran.

The layers, lowest first (a module imports only its own layer and those below):
  base       the vocabulary every layer speaks: errors, expressions (sympy helpers), placements, the plan's
             records and its data class (`plan.py` may reach up only for its thin facade:
             `report()`, `to_html()`, `estimate_at()`), its file format, the private-torch seam
  passes     capture and graph passes
  strategies each op's sharding rules and the facts its pricing needs
  cost_model pricing, and the devices it prices (mesh, cluster)
  solver     the generic ILP and the one evaluator
  planner    one plan on one mesh, the pipeline and mesh searches, the plan cache
  views      report, HTML, SVG, reading the scaling table
  runtime    the executors (beside the views: neither imports the other)
  api        the public entry points, the CLI, calibration (it runs the runtime it measures)
"""
from __future__ import annotations

import ast
import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "autopar"

LAYERS = [
    ("base", r"autopar\.(errors|expr|symbolic|compat|progress|placement|model_source|plan|plan_records|plan_file)"),
    ("passes", r"autopar\.passes(\..*)?"),
    ("strategies", r"autopar\.strategies(\..*)?"),
    ("cost_model", r"autopar\.(cost_model(\..*)?|mesh|cluster)"),
    ("solver", r"autopar\.solver(\..*)?"),
    ("planner", r"autopar\.planner(\..*)?"),
    ("views", r"autopar\.views(\..*)?"),
    ("runtime", r"autopar\.runtime(\..*)?"),
    ("api", r"autopar(\.(__init__|__main__|api|estimate|explain|backend|compiled|cli|calibrate(\..*)?))?"),
]
MAX_UPWARD = 6       # the bound; the plan's facade uses three of them


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
    """The autopar modules `name` imports anywhere in its source (a package's `__init__` counts for
    `from package import name` only where `name` is not a module of its own)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (path.name == "__init__.py")]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                found.add(f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> int:
    for i, (_, pattern) in enumerate(LAYERS):
        if re.fullmatch(pattern, module):
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on.discard(w); comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_every_module_is_in_a_layer():
    for module in _graph():
        _layer(module)


def test_the_import_graph_has_no_circles():
    assert _circles(_graph()) == []


def test_imports_run_down_the_layers():
    graph = _graph()
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if _layer(b) > _layer(a))
    assert len(upward) <= MAX_UPWARD, "imports that run back up:\n" + "\n".join(upward)
    plan_facade = {f"autopar.plan -> autopar.views.{v}" for v in ("report", "html", "scaling")}
    assert set(upward) <= plan_facade | {u for u in upward if not u.startswith("autopar.plan ")}


def test_the_checker_sees_a_circle_and_an_upward_import():
    """The measure itself can fail: a made-up graph with a circle and an import from the base up."""
    graph = {"autopar.errors": {"autopar.solver.ilp"}, "autopar.solver.ilp": {"autopar.errors"}}
    assert _circles(graph) == [["autopar.errors", "autopar.solver.ilp"]]
    assert _layer("autopar.solver.ilp") > _layer("autopar.errors")


OP_WORDS = re.compile(r"moe|vocab|expert|attention|sdpa|scaled_dot|softmax|cross_entropy|nll_loss|ulysses|"
                      r"allgather_kv|\bring\b|routed|aten\.", re.IGNORECASE)


def test_the_solver_names_no_op():
    """Op-specific knowledge lives with the op's rules (`strategies/`) and its prices in `cost_model/`:
    the solver builds and solves the problem for any op through one interface."""
    hits = [f"{path.relative_to(PACKAGE)}:{i}: {line.strip()}" for path in sorted((PACKAGE / "solver").rglob("*.py"))
            for i, line in enumerate(path.read_text().splitlines(), 1) if OP_WORDS.search(line)]
    assert hits == []


CHECKOUT_FIRST = re.compile(r'sys\.path\.insert\(0, (os\.path\.join\(.*, "\.\."\)|os\.path\.dirname\((HERE|os\.path\.dirname\('
                            r'os\.path\.abspath\(__file__\)\))\))\)')


def test_benchmarks_measure_the_checkout_they_sit_in():
    """A benchmark run as `python benchmarks/X.py` puts its own checkout first on the path before it
    imports autopar: otherwise the editable install's autopar (another worktree's) is what it measures."""
    late = []
    for path in sorted((PACKAGE.parent / "benchmarks").glob("*.py")):
        lines = path.read_text().splitlines()
        first = next((i for i, line in enumerate(lines) if re.match(r"(import|from) autopar\b", line)), None)
        if first is not None and not any(CHECKOUT_FIRST.search(line) for line in lines[:first]):
            late.append(path.name)
    assert late == []
