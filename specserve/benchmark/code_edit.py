"""Multi-turn code editing, as coding agents work (`specserve bench --dataset code-edit --turns N`).

A session opens with a Python function from the standard library that ships with this Python (its held-out
files, as the code benchmarks use) and an edit to make, asking for the whole updated function back; each
later turn asks for another edit of the same function, carrying the history (the model's own replies
included). So each reply mostly re-emits code that is already in its prompt, and the prompts grow by the
replies: what model-free drafting (prompt lookup, suffix decoding) and prefix caching are for.

The edits are templates filled with the function's own names (rename it, rename a parameter, add a
docstring, type hints, logging, an assertion), drawn per session from a seeded generator.
"""
from __future__ import annotations

import ast
import zlib

import numpy as np

from specserve.benchmark.stdlib import stdlib_files, stdlib_root
from specserve.errors import SpecServeError

DATASET = "code-edit"
MIN_LINES, MAX_LINES = 6, 30  # functions short enough that a session of a few turns fits a 4K context
EDITS = [
    "Rename the function `{name}` to `{name}_v2`.",
    "Rename the parameter `{param}` to `{param}_value` everywhere in the function.",
    "Add a one-line docstring to the function.",
    "Add type hints to the parameters of the function.",
    "Add a `print` call at the start of the function that shows `{param}`.",
    "Add an assertion at the start of the function that `{param}` is not None.",
]
ASK = "Reply with the whole updated function in a Python code block."


def _held_out(path: str) -> bool:
    # the split the code benchmarks and draft training use (distill/corpus.py)
    return zlib.crc32(path.encode()) % 20 == 0


def stdlib_functions(limit: int = 400) -> list[tuple[str, str, list[str]]]:
    """(source, name, parameter names) of top-level functions of MIN_LINES..MAX_LINES lines in the held-out
    files of this Python's standard library, in file order."""
    root = stdlib_root()
    out = []
    for path in stdlib_files():
        if not _held_out(path.relative_to(root).as_posix()):
            continue
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = text.splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and MIN_LINES <= node.end_lineno - node.lineno + 1 <= MAX_LINES:
                params = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
                out.append(("\n".join(lines[node.lineno - 1:node.end_lineno]), node.name, params))
                if len(out) >= limit:
                    return out
    return out


def build_sessions(n: int, turns: int, seed: int = 0) -> list[list[str]]:
    """n sessions of `turns` user messages each: the first carries the function, every one asks an edit."""
    functions = [f for f in stdlib_functions() if f[2]]
    if not functions:
        raise SpecServeError("no Python standard library functions found for the code-edit workload")
    rng = np.random.default_rng([seed, 7])
    sessions = []
    for i in rng.integers(0, len(functions), n):
        source, name, params = functions[i]
        edits = [EDITS[j] for j in rng.permutation(len(EDITS))][:turns]
        edits += [EDITS[j] for j in rng.integers(0, len(EDITS), max(0, turns - len(edits)))]
        messages = []
        for t, edit in enumerate(edits):
            ask = edit.format(name=name, param=params[int(rng.integers(len(params)))]) + " " + ASK
            messages.append(f"Here is a Python function:\n```python\n{source}\n```\n{ask}" if t == 0 else ask)
        sessions.append(messages)
    return sessions
