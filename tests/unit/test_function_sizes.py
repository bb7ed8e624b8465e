"""No function in ``autopar/`` runs over 80 lines (issue 36: long functions split into named steps)."""
from __future__ import annotations

import ast
from pathlib import Path

import autopar

LIMIT = 80
PACKAGE = Path(autopar.__file__).parent
EXCEPTIONS: dict[str, str] = {}     # "path.py:qualified.name" -> why it stays longer; none today


def _functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")


def long_functions(root: Path = PACKAGE, limit: int = LIMIT) -> list[str]:
    """``path:name (N lines)`` of every function (decorators included) over ``limit`` lines."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for name, node in _functions(ast.parse(path.read_text(), str(path))):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            lines = node.end_lineno - start + 1
            if lines > limit and f"{rel}:{name}" not in EXCEPTIONS:
                out.append(f"{rel}:{name} ({lines} lines)")
    return out


def test_no_function_over_80_lines():
    too_long = long_functions()
    assert not too_long, (f"functions over {LIMIT} lines (split them into named steps, or list one in "
                          f"EXCEPTIONS with the reason): " + ", ".join(too_long))


def test_the_check_names_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "m.py").write_text(f"class C:\n    def f(self):\n{body}\n        return 0\n".replace("\n    x", "\n        x"))
    assert long_functions(tmp_path) == [f"m.py:C.f ({LIMIT + 2} lines)"]
    assert long_functions(tmp_path, LIMIT + 2) == []


PARAM_LIMIT = 8
SOLVER = PACKAGE / "solver"


def wide_functions(root: Path = SOLVER, limit: int = PARAM_LIMIT) -> list[str]:
    """``path:name (N parameters)`` of every function taking more than ``limit`` parameters: positional,
    keyword-only, ``*args`` and ``**kwargs`` each count; a method's ``self``/``cls`` does not."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for name, node in _functions(ast.parse(path.read_text(), str(path))):
            a = node.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
            if names and names[0] in ("self", "cls"):
                names = names[1:]
            count = len(names) + (a.vararg is not None) + (a.kwarg is not None)
            if count > limit:
                out.append(f"{rel}:{name} ({count} parameters)")
    return out


def test_no_solver_function_takes_more_than_8_parameters():
    wide = wide_functions()
    assert not wide, (f"solver functions over {PARAM_LIMIT} parameters (pass the recurring inputs as a "
                      "solver.request.SolveRequest, or a small dataclass for values that travel together): "
                      + ", ".join(wide))


def test_the_check_counts_every_kind_of_parameter(tmp_path):
    (tmp_path / "m.py").write_text("class C:\n    def f(self, a, b, /, c, *d, e, f=1, **g):\n        return 0\n"
                                   "def h(a, b, c, d, e, f, g, h):\n    return 0\n")
    assert wide_functions(tmp_path, 6) == ["m.py:C.f (7 parameters)", "m.py:h (8 parameters)"]
    assert wide_functions(tmp_path) == []
