"""specserve/settings.py: the environment is read there, once, with one default per variable."""
import ast
from pathlib import Path

import specserve
from specserve.settings import read

ROOT = Path(specserve.__file__).parent
# Modules that touch the environment without reading a setting: __init__ sets OpenMP's spin count before
# torch loads, scaleout/process.py hands the environment to the Ray server it starts.
NOT_SETTINGS = {"__init__.py", "scaleout/process.py"}
ENVIRON = {"environ", "getenv"}


def _is_environ(node: ast.AST) -> bool:
    return ((isinstance(node, ast.Attribute) and node.attr in ENVIRON)
            or (isinstance(node, ast.Name) and node.id in ENVIRON))


def environment_uses(tree: ast.AST) -> list[int]:
    """Lines that name os.environ or os.getenv (or import them from os)."""
    return sorted({n.lineno for n in ast.walk(tree) if _is_environ(n)
                   or (isinstance(n, ast.ImportFrom) and n.module == "os" and ENVIRON & {a.name for a in n.names})})


def specserve_reads(tree: ast.AST) -> list[int]:
    """Lines that read a SPECSERVE_ variable by its literal name: os.getenv(name), os.environ.get(name),
    os.environ[name], name in os.environ."""
    def named(node):
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("SPECSERVE_")
    lines = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and n.args and named(n.args[0]) and (
                _is_environ(n.func) or (isinstance(n.func, ast.Attribute) and _is_environ(n.func.value))):
            lines.add(n.lineno)
        elif isinstance(n, ast.Subscript) and _is_environ(n.value) and named(n.slice):
            lines.add(n.lineno)
        elif isinstance(n, ast.Compare) and named(n.left) and any(_is_environ(c) for c in n.comparators):
            lines.add(n.lineno)
    return sorted(lines)


def test_only_the_settings_module_reads_the_environment():
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(), name)
        if name == "settings.py":
            continue
        lines = specserve_reads(tree) if name in NOT_SETTINGS else environment_uses(tree)
        if lines:
            found[name] = lines
    assert not found, f"read the environment outside specserve/settings.py (module: lines): {found}"


def test_no_test_sets_a_variable_its_own_process_has_read():
    """specserve read the environment at import: monkeypatch.setenv("SPECSERVE_...") in a test would change
    nothing there (a test sets the settings attribute, or the environment of a process it starts)."""
    found = []
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        for n in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("setenv", "delenv")
                    and n.args and isinstance(n.args[0], ast.Constant)
                    and str(n.args[0].value).startswith("SPECSERVE_")):
                found.append(f"{path.name}:{n.lineno}")
    assert not found


def test_the_check_sees_each_way_of_reading():
    code = ("import os\nos.getenv('SPECSERVE_A')\nos.environ.get('SPECSERVE_B')\nos.environ['SPECSERVE_C']\n"
            "'SPECSERVE_D' in os.environ\nos.environ.get('HOME')\n")
    assert specserve_reads(ast.parse(code)) == [2, 3, 4, 5]
    assert environment_uses(ast.parse(code)) == [2, 3, 4, 5, 6]


def test_one_default_each():
    defaults = read({})
    assert defaults.cache == Path.home() / ".cache" / "specserve"
    assert defaults.cpu_kernels and defaults.int8_dot and defaults.gpu_fused and defaults.graph_prefill
    assert defaults.batch_invariant is None  # attention invariant, linears all but float32
    assert (defaults.cpu_kernels_march, defaults.gpu_attention, defaults.test_step_pace_s) == ("native", "triton", 0)
    assert defaults.default_draft is defaults.api_key is defaults.commit is defaults.cc is None


def test_the_variables_set_them():
    s = read({"SPECSERVE_CACHE": "/tmp/c", "SPECSERVE_CPU_KERNELS": "0", "SPECSERVE_INT8_DOT": "0",
              "SPECSERVE_BATCH_INVARIANT": "0", "SPECSERVE_GPU_FUSED": "0", "SPECSERVE_GRAPH_PREFILL": "0",
              "SPECSERVE_TEST_STEP_PACE_S": "0.02", "SPECSERVE_DEFAULT_DRAFT": "chat", "SPECSERVE_COMMIT": "abc"})
    assert s.cache == Path("/tmp/c") and s.test_step_pace_s == 0.02 and (s.default_draft, s.commit) == ("chat", "abc")
    assert not (s.cpu_kernels or s.int8_dot or s.gpu_fused or s.graph_prefill) and s.batch_invariant is False
    assert read({"SPECSERVE_BATCH_INVARIANT": "1"}).batch_invariant is True
    assert read({"SPECSERVE_CACHE": "", "SPECSERVE_COMMIT": ""}) == read({})  # empty: as unset
