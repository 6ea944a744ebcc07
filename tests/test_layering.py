"""The package's shape, read from its source (docs/design.md, section 3): no two modules import each other,
nothing outside `engine/` reaches into an engine's parts (the engine is the only door to them), and no Python
file under src/ is past 350 lines. Each check is also run on a small bad example, so that it can fail."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import rhymerl

SRC = Path(rhymerl.__file__).resolve().parent  # src/rhymerl (PYTHONPATH picks the worktree's)
MAX_LINES = 350
# An engine's parts: its scheduler, model runner (and the KV cache it runs on) and HistoSpec speculator.
# Callers use the engine's own methods instead (`take_stats`, `state_dict`, `cost_model`, `extract`, `adopt`).
ENGINE_PARTS = {"scheduler", "runner", "speculator", "cache"}
ENGINE_NAME = re.compile(r"(^|_)engines?$")  # engine, self.engine, plain_engine, engines[k] ...


def module_name(path: Path) -> str:
    """'rhymerl.rollout.worker' for src/rhymerl/rollout/worker.py; a package's __init__ is the package."""
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def imported(tree: ast.AST, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The rhymerl modules that module `name` imports anywhere in its body (at the top, inside functions or
    under TYPE_CHECKING alike): `from P import N` counts as P.N where that is a module, else as P."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1 more
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import rhymerl.a.b` names rhymerl.a.b; an object's module otherwise
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imported(ast.parse(path.read_text()), name, path.name == "__init__.py", known)
            for name, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_engine(node: ast.AST) -> bool:
    if isinstance(node, ast.Subscript):
        node = node.value
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return bool(ENGINE_NAME.search(name))


def engine_part_uses(source: str) -> list[tuple[int, str]]:
    """(line, expression) of each `<engine>.<part>` in `source`, and of each attribute of an engine it assigns
    (`engine.stats = ...`)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _is_engine(node.value) and \
                (node.attr in ENGINE_PARTS or isinstance(node.ctx, ast.Store)):
            out.append((node.lineno, ast.unparse(node)))
    return sorted(out)


def test_no_two_modules_import_each_other():
    graph = import_graph()
    assert len(graph) > 50 and graph["rhymerl.rollout.worker"] >= {"rhymerl.engine.engine", "rhymerl.config"}
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    known = {"rhymerl.engine", "rhymerl.engine.engine", "rhymerl.engine.migration"}
    tree = ast.parse("from rhymerl.engine import migration\nimport rhymerl.engine.engine as e\n"
                     "def f():\n    from . import engine\n")
    assert imported(tree, "rhymerl.engine.sequence", False, known) == {"rhymerl.engine.migration",
                                                                       "rhymerl.engine.engine"}


def test_nothing_outside_the_engine_touches_its_parts():
    uses = {f"{path.relative_to(SRC)}:{line}": expr for path in sorted(SRC.rglob("*.py"))
            if path.relative_to(SRC).parts[0] != "engine" for line, expr in engine_part_uses(path.read_text())}
    assert uses == {}


def test_the_engine_parts_check_finds_a_reach():
    code = ("x = self.engine.speculator.cost\nworker.engine.stats = None\nn = len(engine.scheduler.waiting)\n"
            "r = engines[0].runner\nengine.take_stats()\nengine.cost_model\n")
    assert engine_part_uses(code) == [(1, "self.engine.speculator"), (2, "worker.engine.stats"),
                                      (3, "engine.scheduler"), (4, "engines[0].runner")]


def test_no_source_file_is_past_350_lines():
    sizes = {str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}
    assert len(sizes) > 50
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}
