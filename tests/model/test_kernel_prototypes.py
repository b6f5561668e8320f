"""The ctypes declarations of the C kernels (kernels.PROTOTYPES) against the C sources' own prototypes.

ctypes trusts its argtypes: a parameter added, removed or retyped in a .c file and not in Python passes
wrong values silently. So the prototypes are read from the sources' text (no compiler): comments removed,
the DEFINE_* macros that make the per-dtype variants expanded, function bodies skipped, and every
non-static declaration or definition compared with its declaration in Python: the same functions, the
same parameters in the same order, named alike, of the same ctypes type, and the same return type.
decoder.c's own declarations of the other files' functions are compared too (the C compiler does not
check those across files).
"""
from __future__ import annotations

import ctypes
import re
from dataclasses import replace
from typing import NamedTuple

import pytest

from specserve.model import kernels

SCALARS = {"int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "float": ctypes.c_float,
           "double": ctypes.c_double, "void": None}


def read_sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in kernels.SOURCES + kernels.HEADERS}


def _strip(text: str) -> str:
    """Comments out, preprocessor lines joined across backslash-newlines."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return text.replace("\\\n", " ")


def _expand(text: str) -> str:
    """Each top-level `NAME(args)` line of a function-like macro defined in `text` replaced by its body."""
    macros = {m[1]: ([p.strip() for p in m[2].split(",")], m[3])
              for m in re.finditer(r"^#define\s+(\w+)\(([^)]*)\)(.*)$", text, flags=re.M)}

    def expand(call: re.Match) -> str:
        params, body = macros[call[1]]
        args = dict(zip(params, (a.strip() for a in call[2].split(","))))
        return re.sub(r"\s*##\s*", "", re.sub(r"\b\w+\b", lambda w: args.get(w[0], w[0]), body))

    if not macros:
        return text
    return re.sub(rf"^({'|'.join(macros)})\(([^)]*)\)\s*;?\s*$", expand, text, flags=re.M)


def _top_level(text: str) -> list[tuple[str, bool]]:
    """The declarations at file scope, each with whether a body follows it (a definition): preprocessor
    lines dropped, brace bodies cut out."""
    text = re.sub(r"^\s*#.*$", "", text, flags=re.M)
    parts, depth, current = [], 0, []
    for ch in text:
        if depth == 0 and ch in "{;":
            parts.append(("".join(current), ch == "{"))
            current = []
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0 and ch != ";":
            current.append(ch)
    return [(" ".join(p.split()), body) for p, body in parts if p.strip()]


def _ctype(decl: str) -> object:
    """`const float *` -> c_void_p, `int64_t` -> c_int64 ...; a type it does not know raises."""
    if "*" in decl:
        return ctypes.c_void_p
    base = " ".join(w for w in decl.split() if w not in ("const", "extern"))
    if base not in SCALARS:
        raise ValueError(f"unknown C type {decl!r}")
    return SCALARS[base]


class CPrototype(NamedTuple):
    file: str
    name: str
    restype: object  # a ctypes type, None for void
    params: list[tuple[str, object]]
    defined: bool  # a definition (else a declaration of a function defined elsewhere)


def c_prototypes(sources: dict[str, str]) -> list[CPrototype]:
    """Every non-static function prototype in the sources."""
    found = []
    for file, text in sorted(sources.items()):
        for decl, defined in _top_level(_expand(_strip(text))):
            m = re.fullmatch(r"([\w\s*]+?)\s*\b(\w+)\s*\(([^()]*)\)", decl)
            if m is None or re.search(r"\b(static|typedef)\b", m[1]):
                continue
            params = []
            for p in m[3].split(","):
                if p.strip() in ("", "void"):
                    continue
                pm = re.fullmatch(r"\s*(.*?)\s*\b(\w+)\s*", p)
                params.append((pm[2], _ctype(pm[1])))
            found.append(CPrototype(file, m[2], _ctype(m[1]), params, defined))
    return found


def _type_name(t: object) -> str:
    return {None: "void", ctypes.c_void_p: "a pointer", ctypes.c_int32: "int32_t", ctypes.c_int64: "int64_t",
            ctypes.c_float: "float", ctypes.c_double: "double"}[t]


def check(sources: dict[str, str], prototypes=kernels.PROTOTYPES) -> list[str]:
    """Every difference between the C prototypes in `sources` and the Python declarations, in words."""
    declared = {name: p for p in prototypes for name in p.c_names()}
    problems, defined = [], set()
    for file, name, restype, params, is_definition in c_prototypes(sources):
        if is_definition:
            defined.add(name)
        where = f"{file}: {name}"
        if name not in declared:
            problems.append(f"{where}: not declared in kernels.PROTOTYPES")
            continue
        proto = declared[name]
        if restype is not proto.restype:
            problems.append(f"{where}: returns {_type_name(restype)}, declared {_type_name(proto.restype)}")
        py = list(proto.params.items())
        if len(params) != len(py):
            problems.append(f"{where}: {len(params)} parameters, declared {len(py)}")
        for i, ((c_name, c_type), (py_name, py_type)) in enumerate(zip(params, py)):
            if c_name != py_name:
                problems.append(f"{where}: parameter {i} is {c_name}, declared {py_name}")
            if c_type is not py_type:
                problems.append(f"{where}: parameter {i} ({c_name}) is {_type_name(c_type)}, "
                                f"declared {_type_name(py_type)}")
    problems += [f"{name}: declared in kernels.PROTOTYPES, defined in no C source"
                 for name in sorted(set(declared) - defined)]
    return problems


def test_python_declarations_match_c_prototypes():
    problems = check(read_sources())
    assert not problems, "\n".join(problems)


def test_every_export_is_found():
    """The parser sees each declared function (decoder.c's and draft_chain.c's declarations of the others as
    well)."""
    found = c_prototypes(read_sources())
    exports = {n for p in kernels.PROTOTYPES for n in p.c_names()}
    assert sorted(c.name for c in found if c.defined) == sorted(exports)
    assert {c.name for c in found if not c.defined} == {"kv_write", *(
        f"{name}_{s}" for name in ("rms_norm", "rope", "linear", "paged_attention_short", "decoder_layers")
        for s in ("bf16", "f32"))}


def _edit(file: str, old: str, new: str) -> dict[str, str]:
    sources = read_sources()
    assert sources[file].count(old) == 1, old
    sources[file] = sources[file].replace(old, new)
    return sources


@pytest.mark.parametrize("file, old, new, expected", [
    ("rms_norm.c", "int64_t x_stride, const T *w", "int32_t x_stride, const T *w",
     ["rms_norm.c: rms_norm_bf16: parameter 1 (x_stride) is int32_t, declared int64_t"]),
    ("rms_norm.c", "float eps,", "",
     ["rms_norm.c: rms_norm_f32: 7 parameters, declared 8",
      "rms_norm.c: rms_norm_f32: parameter 6 is num_threads, declared eps"]),
    ("rope.c", "int32_t heads,", "int32_t num_heads,",
     ["rope.c: rope_bf16: parameter 7 is num_heads, declared heads"]),
    ("argmax.c", "void argmax_rows_f32(", "int argmax_rows_f32(",
     ["argmax.c: argmax_rows_f32: returns int32_t, declared void"]),
    # decoder.c's own declaration of linear_*, which no compiler compares with linear.c's definition
    ("decoder.c", "int32_t mode, int32_t num_threads);", "int32_t num_threads);",
     ["decoder.c: linear_bf16: 13 parameters, declared 14"]),
    # decoder.c still declares it, but nothing defines it
    ("paged_attention.c", "DEFINE_KERNEL(paged_attention_short_f32, float, f32, 0)\n", "",
     ["paged_attention_short_f32: declared in kernels.PROTOTYPES, defined in no C source"]),
    ("argmax.c", "void argmax_rows_f32(", "void argmax_rows_f64(double y, ",
     ["argmax.c: argmax_rows_f64: not declared in kernels.PROTOTYPES",
      "argmax_rows_f32: declared in kernels.PROTOTYPES, defined in no C source"]),
])
def test_an_edited_prototype_is_reported(file, old, new, expected):
    problems = check(_edit(file, old, new))
    assert all(e in problems for e in expected), problems


def test_an_edited_declaration_is_reported():
    """The other direction: the C unchanged, a Python declaration wrong."""
    protos = [replace(p, params={**p.params, "elem_size": ctypes.c_int64}) if p.name == "kv_write" else p
              for p in kernels.PROTOTYPES]
    problems = check(read_sources(), protos)
    assert problems == ["decoder.c: kv_write: parameter 11 (elem_size) is int32_t, declared int64_t",
                        "paged_attention.c: kv_write: parameter 11 (elem_size) is int32_t, declared int64_t"]
