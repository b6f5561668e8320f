"""The package's modules import one another without a circle, and never up the layers (docs/design.md §5):
every import counts, a deferred one inside a function too (it hides the dependency from Python, not from the
reader). Parsed from the source, nothing imported."""
import ast
from pathlib import Path

import specserve

ROOT = Path(specserve.__file__).parent

# Bottom first: a module imports modules of its own layer and the layers below, never one above.
LAYERS = [
    ("foundation", {"specserve.errors", "specserve.settings", "specserve.seeding", "specserve.sampling_ops",
                    "specserve.device_sync", "specserve.cache", "specserve.console", "specserve.step_types"}),
    # Independent of one another; latency/ is here because spec_decode's planned policy reads its fits.
    ("model and measurement", {"specserve.model", "specserve.latency", "specserve.benchmark"}),
    # What a request asks (params), its compiled grammar, and the step's masks and draft cuts under it
    ("structured output", {"specserve.structured_output"}),
    ("speculation", {"specserve.spec_decode"}),
    ("engine", {"specserve.engine", "specserve"}),  # the package itself re-exports the engine's LLM
    ("applications", {"specserve.server", "specserve.distill"}),
    ("scale-out", {"specserve.scaleout"}),  # N copies of the server's app on Ray Serve
    # And every package's cli.py: a command may reach any layer (`serve --replicas` the scale-out).
    ("commands", {"specserve.cli", "specserve.__main__"}),
]
# Imports under `if TYPE_CHECKING:` that name a higher layer's type for the reader; Python never runs them.
TYPE_ONLY_UPWARD = {("specserve.step_types", "specserve.engine.sequence")}  # a step schedules requests


def module_name(path: Path) -> str:
    parts = ("specserve",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """The import statements under `if TYPE_CHECKING:`."""
    return {node for block in ast.walk(tree) if isinstance(block, ast.If) and ast.unparse(block.test)
            in ("TYPE_CHECKING", "typing.TYPE_CHECKING") for stmt in block.body for node in ast.walk(stmt)}


def imports_of(path: Path, modules: set[str], type_checking: bool = True) -> set[str]:
    """The package's modules that `path` imports (`from a import b` names module a.b when there is one);
    with type_checking false, not those imported for type checkers only."""
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    skipped = set() if type_checking else _type_checking_only(tree)
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m in modules}


def import_graph(type_checking: bool = True) -> dict[str, set[str]]:
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    return {m: imports_of(p, set(paths), type_checking) - {m} for m, p in paths.items()}


def layer_of(module: str) -> int:
    if module.endswith(".cli"):
        return len(LAYERS) - 1
    for i, (_, members) in enumerate(LAYERS):
        if any(module == m or (m != "specserve" and module.startswith(m + ".")) for m in members):
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS (tests/test_import_graph.py) and to "
                         "docs/design.md §5")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
            for m in sorted(graph) for d in sorted(graph[m]) if layer_of(d) > layer_of(m)]


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


def test_no_import_up_the_layers():
    upward = upward_imports(import_graph(type_checking=False))
    assert not upward, "imports from a lower layer into a higher one:\n  " + "\n  ".join(upward)


def test_type_only_imports_up_the_layers_are_the_known_ones():
    full, runtime = import_graph(), import_graph(type_checking=False)
    type_only = {(m, d) for m in full for d in full[m] - runtime[m] if layer_of(d) > layer_of(m)}
    assert type_only == TYPE_ONLY_UPWARD


def test_the_check_finds_an_upward_import():
    graph = import_graph(type_checking=False)
    graph["specserve.step_types"].add("specserve.engine.sequence")  # what the step types once did
    graph["specserve.structured_output.drafts"].add("specserve.spec_decode.config")  # naming the lookup proposers
    assert upward_imports(graph) == [
        "specserve.step_types (foundation) imports specserve.engine.sequence (engine)",
        "specserve.structured_output.drafts (structured output) imports specserve.spec_decode.config (speculation)"]
