"""The package's modules import one another without a circle: every import counts, a deferred one inside a
function too (it hides the circle from Python, not from the reader). Parsed from the source, nothing imported."""
import ast
from pathlib import Path

import specserve

ROOT = Path(specserve.__file__).parent


def module_name(path: Path) -> str:
    parts = ("specserve",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports (`from a import b` names module a.b when there is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m in modules}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    return {m: imports_of(p, set(paths)) - {m} for m, p in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert cycles(import_graph()) == []


def test_the_check_finds_a_circle():
    graph = import_graph()
    graph["specserve.spec_decode.config"].add("specserve.server.cli")  # what scale-out once did
    assert any("specserve.server.cli" in c for c in cycles(graph))
