"""Imports only go down the layers of docs/architecture.md, and no modules import each other in a cycle."""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2] / "autopar"

# lowest first; a module may import its own layer and the ones before it (docs/architecture.md)
LAYERS = [
    ("core", {"core"}),
    ("frontend", {"frontend"}),
    ("graph", {"graph"}),
    ("sharding", {"sharding"}),
    ("cost_models", {"cost_models"}),
    ("schedules", {"schedules"}),
    ("plan", {"plan"}),
    ("solver", {"solver"}),
    ("report", {"report"}),
    ("collectives", {"collectives"}),
    ("passes", {"passes"}),
    ("runtime", {"runtime"}),
    ("modules", {"modules"}),
    ("entry", {"api", "cli", ""}),
]


def module_name(path: Path) -> str:
    parts = ["autopar", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for i, (_, members) in enumerate(LAYERS):
        if top in members:
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS here and to docs/architecture.md")


def imports(path: Path, modules: set[str]) -> set[str]:
    """autopar modules that ``path`` imports, at module level or inside functions."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "autopar")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.split(".")[0] != "autopar":
                continue
            subs = {f"{base}.{a.name}" for a in node.names} & modules
            out.update(subs if len(subs) == len(node.names) else subs | {base})
    out.discard(name)
    return out


def import_graph() -> nx.DiGraph:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    g = nx.DiGraph()
    for p in paths:
        g.add_node(module_name(p), path=p)
        for target in imports(p, modules):
            g.add_edge(module_name(p), target)
    return g


def upward_imports(g: nx.DiGraph) -> list[str]:
    bad = []
    for src, dst in g.edges:
        a, b = layer_of(src), layer_of(dst)
        if b > a:
            bad.append(f"{g.nodes[src]['path'].relative_to(ROOT.parent)} ({LAYERS[a][0]}) imports {dst} "
                       f"({LAYERS[b][0]}), a higher layer")
    return sorted(bad)


def test_imports_only_go_down():
    bad = upward_imports(import_graph())
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    cycles = [" -> ".join([*c, c[0]]) for c in nx.simple_cycles(import_graph())]
    assert not cycles, "import cycles:\n" + "\n".join(sorted(cycles))


def test_an_upward_import_is_caught():
    g = import_graph()
    g.add_node("autopar.solver.fake", path=ROOT / "solver" / "fake.py")
    g.add_edge("autopar.solver.fake", "autopar.runtime.launch")
    assert "autopar/solver/fake.py (solver) imports autopar.runtime.launch (runtime), a higher layer" in upward_imports(g)
