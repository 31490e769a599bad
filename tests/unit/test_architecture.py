"""The house rules, checked on the source (operators, pipelines and benchmarks): operators never import
pipelines, neither imports benchmarks (benchmark code may import both), no import circle
(imports inside functions count: a lazy import hides a circle, it does not break it), no module
imports another's private name, and no module above 400 lines. The walls between a class and its
parts (no reading of attributes nothing assigns, no override with other parameters): test_attributes.py."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("operators", "pipelines", "benchmarks")
MAX_LINES = 400


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for file in sorted((ROOT / package).rglob("*.py")):
            parts = file.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = file
    return found


def imports(name: str, file: Path, known: dict[str, Path]) -> list[tuple[str, str | None, int]]:
    """(module imported, name taken from it or None, line) for every import of a project module."""
    out = []
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] in PACKAGES]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub, None, node.lineno) if sub in known else (base, alias.name, node.lineno))
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    edges: dict[str, set[str]] = {name: set() for name in known}
    for name, file in known.items():
        for target, _, _ in imports(name, file, known):
            while target not in known and "." in target:
                target = target.rpartition(".")[0]
            if target in known and target != name and not known[target].name == "__init__.py":
                edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_operators_never_import_pipelines():
    known = modules()
    bad = [f"{name}:{line} imports {target}" for name, file in known.items() if name.startswith("operators")
           for target, _, line in imports(name, file, known) if target.startswith("pipelines")]
    assert not bad, bad


def test_operators_and_pipelines_never_import_benchmarks():
    known = modules()
    bad = [f"{name}:{line} imports {target}" for name, file in known.items() if not name.startswith("benchmarks")
           for target, _, line in imports(name, file, known) if target.split(".")[0] == "benchmarks"]
    assert not bad, bad


def test_benchmarks_import_each_other_through_the_package():
    """`python benchmarks/X.py` puts benchmarks/ first on sys.path: a sibling imported by its bare name (or a
    folder added to sys.path) would load a second copy of a module under another name."""
    known = modules()
    siblings = {name.split(".")[1] for name in known if name.startswith("benchmarks.")}
    bad = []
    for name, file in known.items():
        if not name.startswith("benchmarks"):
            continue
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in siblings]
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
                bad.append(f"{name}:{node.lineno} uses sys.path")
    assert not bad, bad


def test_no_import_circle():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_a_private_name_from_another():
    known = modules()
    bad = [f"{name}:{line} takes {taken} from {target}" for name, file in known.items()
           for target, taken, line in imports(name, file, known)
           if taken and taken.startswith("_") and not taken.startswith("__")]
    assert not bad, "\n".join(bad)


def test_no_module_above_400_lines():
    long = {name: n for name, file in modules().items() if (n := len(file.read_text().splitlines())) > MAX_LINES}
    assert not long, long
