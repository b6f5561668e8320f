"""One writer of request state (docs/design.md §5.3): outside the scheduler and Sequence itself, no module of
the package assigns a Sequence's fields or calls its mutating methods. Parsed from the source: a request is
`seq` (or `<x>.seq`, a ScheduledSeq's) wherever the package handles one, which is what this reads for."""
import ast
from pathlib import Path

import specserve

ROOT = Path(specserve.__file__).parent
OWNERS = {"engine/scheduler.py", "engine/sequence.py"}
MUTATORS = {"append", "add_prompt_logprobs", "record"}  # Sequence's, and its SpecStats' (seq.spec.record)


def is_request(node: ast.AST) -> bool:
    """`seq`, `x.seq`, or anything reached from them (`seq.spec`, `seq.block_table`)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute) and node.attr == "seq":
            return True
        node = node.value
    return isinstance(node, ast.Name) and node.id in ("seq", "sequence")


def writes(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, (ast.Attribute, ast.Subscript)) and is_request(t.value if isinstance(
                        t, ast.Subscript) else t.value):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} assigns {ast.unparse(t)}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
                and is_request(node.func.value) and not ast.unparse(node.func.value).endswith("token_ids")):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} calls {ast.unparse(node.func)}")
    return found


def test_only_the_scheduler_writes_requests():
    others = [w for p in sorted(ROOT.rglob("*.py")) if str(p.relative_to(ROOT)) not in OWNERS for w in writes(p)]
    assert others == [], "request state written outside the scheduler:\n" + "\n".join(others)


def test_the_reader_sees_the_schedulers_writes():
    found = writes(ROOT / "engine" / "scheduler.py")
    assert any("num_computed" in w for w in found) and any("status" in w for w in found)
    assert any("calls seq.append" in w or "calls s.seq.append" in w for w in found)
