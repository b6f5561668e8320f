"""CPU kernels in plain C, compiled on first use with the system's C compiler and loaded with ctypes.

Kernels: attention of short queries over the paged KV cache and the cache writes (`paged_attention.c`),
RMSNorm (`rms_norm.c`), rotary embedding (`rope.c`), the greedy argmax of logit rows (`argmax.c`),
linear layers on float32, bf16 and GGUF-quantized weights (`linear.c`), all of a step's decoder layers in one call
(`decoder.c`), and a draft model's whole chain of greedy draft steps in one call (`draft_chain.c`). They are optimisations only:
without a compiler, on other devices or dtypes, with autograd recording, or with
SPECSERVE_CPU_KERNELS=0, torch ops run instead (`model/attention.py`'s gather path, F.rms_norm,
`rope.apply_rope`'s ops, torch.argmax, F.linear on dequantized weights; same results up to float
rounding). `model/cpu_forward.py` calls them directly for whole decoder layers.

All go into one library, built for this CPU (-march=native) into the cache directory and named by a
hash of the sources, the flags and the CPU, so an edited source or another machine sharing the cache
rebuilds. Each exported C function is declared once in PROTOTYPES (parameter names and ctypes types, as
in the C source), which sets the ctypes argtypes and which tests/model/test_kernel_prototypes.py
checks against the C prototypes; `function` hands them out.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from contextlib import nullcontext
from ctypes import c_float, c_int, c_int32, c_int64, c_void_p
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.cache import cache_dir
from specserve.settings import settings

log = logging.getLogger("specserve.kernels")

SOURCES = sorted(Path(__file__).parent.glob("*.c"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
# -ffast-math lets gcc vectorise the reductions and call glibc's vector expf (libmvec). It is given to
# the compile step only: linked with it, gcc adds a constructor that turns on flush-to-zero for the
# whole process on load, which would change torch's own arithmetic.
COMPILE = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c"]
# Sources whose floating-point order is their contract (batch invariance: linear.c): no -ffast-math,
# which would let gcc reassociate their sums, and no contraction of a * b + c beyond the written FMAs.
PRECISE = {"linear": ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-c"]}
LINK = ["-shared", "-fopenmp", "-lmvec", "-lm"]
DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}
PROFILER_PREFIX = "specserve::"


def _cpu_id() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _flags(src: Path) -> list[str]:
    """Compile flags of one source; SPECSERVE_CPU_KERNELS_MARCH (e.g. x86-64) builds for another CPU
    than this one (the tests build the portable code paths so)."""
    march = "-march=" + settings.cpu_kernels_march
    return [march if f == "-march=native" else f for f in PRECISE.get(src.stem, COMPILE)]


def _build(compiler: str) -> Path:
    key = hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES + HEADERS)
                         + " ".join([compiler, *(f for src in SOURCES for f in _flags(src)), *LINK,
                                     _cpu_id()]).encode())
    target = cache_dir() / "kernels" / f"specserve-kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # atomic: concurrent builds race safely
        objects = [str(Path(tmp) / f"{src.stem}.o") for src in SOURCES]
        for src, obj in zip(SOURCES, objects):
            subprocess.run([compiler, *_flags(src), "-o", obj, str(src)], check=True, capture_output=True, text=True)
        built = Path(tmp) / target.name
        subprocess.run([compiler, "-o", str(built), *objects, *LINK], check=True, capture_output=True, text=True)
        os.replace(built, target)
    return target


def library_id() -> str:
    """Which build of the kernels this process runs ("none" without them): a hash of their sources, flags
    and CPU, for caches of anything measured on them (the step cost profile)."""
    lib = _library()
    return Path(lib._name).stem if lib is not None else "none"


@dataclass(frozen=True)
class Prototype:
    """One exported C function: its return type (None: void) and its parameters in order, named as in
    the C source. Pointers of any type are c_void_p (the callers pass data_ptr() integers). per_dtype: one
    function for each of DTYPES, named name_<suffix> (the C sources define them from one macro)."""
    name: str
    restype: type | None
    params: dict[str, type]
    per_dtype: bool = False

    def c_names(self) -> list[str]:
        return [_c_name(self.name, s) for s in DTYPES.values()] if self.per_dtype else [self.name]


def _c_name(name: str, suffix: str) -> str:
    return f"{name}_{suffix}"


# tests/model/test_kernel_prototypes.py parses the C sources and checks them against these.
PROTOTYPES = (
    Prototype("paged_attention_short", c_int, dict(
        q=c_void_p, q_stride=c_int64, kc=c_void_p, vc=c_void_p, out=c_void_p, seq_start=c_void_p,
        seq_qlen=c_void_p, seq_ctx=c_void_p, tables=c_void_p, table_stride=c_int32, num_seqs=c_int32,
        H=c_int32, Hkv=c_int32, D=c_int32, block_size=c_int32, scale=c_float, window=c_int32,
        num_threads=c_int32), per_dtype=True),
    Prototype("rms_norm", None, dict(
        x=c_void_p, x_stride=c_int64, w=c_void_p, out=c_void_p, rows=c_int32, dim=c_int32, eps=c_float,
        num_threads=c_int32), per_dtype=True),
    Prototype("rope", None, dict(
        x=c_void_p, x_stride=c_int64, cos=c_void_p, sin=c_void_p, cs_stride=c_int64, out=c_void_p,
        tokens=c_int32, heads=c_int32, D=c_int32, num_threads=c_int32), per_dtype=True),
    Prototype("linear", c_int, dict(
        w=c_void_p, fmt=c_int32, w_row_bytes=c_int64, N=c_int32, K=c_int32, Kp=c_int32, x=c_void_p,
        x_stride=c_int64, rows=c_int32, bias=c_void_p, out=c_void_p, out_stride=c_int64, mode=c_int32,
        num_threads=c_int32), per_dtype=True),
    Prototype("decoder_layers", c_int, dict(
        layers=c_void_p, num_layers=c_int32, x=c_void_p, tokens=c_int32, hidden=c_int32, h=c_void_p,
        qkv=c_void_p, qk=c_void_p, attn=c_void_p, act=c_void_p, H=c_int32, Hkv=c_int32, D=c_int32,
        inter=c_int32, cos=c_void_p, sin=c_void_p, cs_stride=c_int64, kv_base=c_void_p, cache_bytes=c_int64,
        slots=c_void_p, block_size=c_int32, seqs=c_void_p, num_seqs=c_int32, tables=c_void_p,
        table_stride=c_int32, window=c_int32, threads=c_int32), per_dtype=True),
    Prototype("draft_chain", c_int, dict(
        m=c_void_p, rows=c_int32, ids=c_void_p, feats=c_void_p, positions=c_void_p, slots=c_void_p,
        num_pieces=c_int32, pieces=c_void_p, piece_tables=c_void_p, piece_stride=c_int32, num_seqs=c_int32,
        last_rows=c_void_p, tables=c_void_p, table_stride=c_int32, steps=c_void_p, max_steps=c_int32,
        out=c_void_p, threads=c_int32), per_dtype=True),
    Prototype("kv_write", None, dict(
        k=c_void_p, k_stride=c_int64, v=c_void_p, v_stride=c_int64, kc=c_void_p, vc=c_void_p, slots=c_void_p,
        tokens=c_int32, Hkv=c_int32, D=c_int32, block_size=c_int32, elem_size=c_int32)),
    Prototype("int8_layout", c_int64, dict(to=c_int32, K=c_int32, Kp=c_void_p)),
    Prototype("pack_int8_rows", c_int, dict(
        w=c_void_p, fmt=c_int32, w_row_bytes=c_int64, N=c_int32, K=c_int32, Kp=c_int32, to=c_int32, out=c_void_p,
        out_row_bytes=c_int64, num_threads=c_int32)),
    Prototype("dequantize_rows", None, dict(
        w=c_void_p, fmt=c_int32, w_row_bytes=c_int64, N=c_int32, K=c_int32, out=c_void_p,
        num_threads=c_int32)),
    Prototype("argmax_rows_f32", None, dict(
        x=c_void_p, row_stride=c_int64, rows=c_int32, cols=c_int32, out=c_void_p, num_threads=c_int32)),
)


@functools.cache
def _library() -> ctypes.CDLL | None:
    if not settings.cpu_kernels:
        return None
    compiler = settings.cc or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: attention, RMSNorm, rope and argmax run on torch ops (slower steps)")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("CPU kernels unavailable, using torch ops: %s", detail.strip()[:300])
        return None
    for proto in PROTOTYPES:
        for name in proto.c_names():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = proto.restype, list(proto.params.values())
    return lib


def _profiler_range(name: str):
    """Names a kernel call in torch.profiler's tables, but only while it records (~7 us a call otherwise)."""
    return torch.profiler.record_function(PROFILER_PREFIX + name) if torch.autograd._profiler_enabled() else nullcontext()


def short_attention_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `short_attention` can run tensors of this dtype and device (else use the torch ops path)."""
    return device.type == "cpu" and dtype in DTYPES and _library() is not None


def short_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    seqs: torch.Tensor, block_tables: torch.Tensor, scale: float,
                    sliding_window: int | None) -> None:
    """Writes the attention output of every listed sequence's query rows into `out`.

    q: [T, H, D] (rows contiguous inside: stride(1) == D, stride(2) == 1); k_cache, v_cache:
    [num_blocks, Hkv, block_size, D] contiguous; out: [T, H * D] contiguous; seqs: [3, S] int32 (each
    sequence's first query row, number of queries, context length incl. them); block_tables:
    [S, max_blocks] int32."""
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim and out.is_contiguous() and k_cache.is_contiguous()
    assert v_cache.is_contiguous() and seqs.is_contiguous() and block_tables.is_contiguous()
    fn = function("paged_attention_short", q.dtype)
    with _profiler_range("short_attention"):
        status = fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                    seqs[0].data_ptr(), seqs[1].data_ptr(), seqs[2].data_ptr(), block_tables.data_ptr(),
                    block_tables.shape[1], seqs.shape[1], q.shape[1], num_kv_heads, head_dim, block_size,
                    scale, sliding_window or 0, torch.get_num_threads())
    if status != 0:
        raise MemoryError("attention kernel: out of memory for its scratch buffers")


def available() -> bool:
    """Whether the C kernels are built (or build now) and enabled."""
    return _library() is not None


def function(name: str, dtype: torch.dtype | None = None):
    """The ctypes function `name` of PROTOTYPES, its argument and return types set (a per-dtype one: its
    variant for `dtype`); call only when `available()`."""
    return getattr(_library(), name if dtype is None else _c_name(name, DTYPES[dtype]))


def _inference_cpu(*tensors: torch.Tensor) -> bool:
    """CPU tensors of one supported dtype, nothing for autograd to record, and the library built."""
    dtype = tensors[0].dtype
    return (all(t.device.type == "cpu" and t.dtype == dtype for t in tensors) and dtype in DTYPES
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and _library() is not None)


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` can run: rows with unit stride, a contiguous weight, `_inference_cpu`."""
    return x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous() and _inference_cpu(x, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [N, dim] (unit stride along dim); weight: [dim]. Returns weight * dtype(x / rms(x)), [N, dim]."""
    out = torch.empty(x.shape, dtype=x.dtype)
    with _profiler_range("rms_norm"):
        function("rms_norm", x.dtype)(
            x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
            torch.get_num_threads())
    return out


def rope_supported(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rope` can run: x [T, heads, D] with heads contiguous inside a token, cos and sin
    [T, 1, D/2] float32 with unit stride inside a token, `_inference_cpu`."""
    return (x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
            and cos.shape == sin.shape == (x.shape[0], 1, x.shape[2] // 2) and cos.dtype == torch.float32
            and cos.stride(-1) == sin.stride(-1) == 1 and cos.stride(0) == sin.stride(0)
            and _inference_cpu(x) and _inference_cpu(cos, sin))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope of x [T, heads, D] with cos, sin [T, 1, D/2]: a new contiguous [T, heads, D]."""
    out = torch.empty(x.shape, dtype=x.dtype)
    with _profiler_range("rope"):
        function("rope", x.dtype)(
            x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0), out.data_ptr(),
            x.shape[0], x.shape[1], x.shape[2], torch.get_num_threads())
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits: [N, V] -> [N] int64, the first index of each row's maximum (torch.argmax where the kernel
    cannot run: not float32 on the CPU, or no library)."""
    if not (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and logits.shape[1] > 0 and _library() is not None):
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.long)
    with _profiler_range("argmax"):
        function("argmax_rows_f32")(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1],
                                    out.data_ptr(), torch.get_num_threads())
    return out


# Weight formats of `linear` (codes of linear.c) and, for the GGUF ones, (weights per block, bytes per block).
# "i4" / "i8" / "i4w" / "i6": 4-bit / 8-bit / Q6_K's 6-bit GGUF weights repacked for integer dot products
# (int8_dot.h), with f16 scales ("i4w": float32 scales, for Q4_K's; "i6": Q6_K's int8 scales and float32 d).
WEIGHT_FORMATS = {"f32": 0, "bf16": 1, "q8_0": 2, "q4_0": 3, "q4_1": 4, "q4_k": 5, "q6_k": 6, "i4": 7, "i8": 8,
                  "i4w": 9, "i6": 10}
INT8_FORMATS = ("i4", "i8", "i4w", "i6")
INT8_FORMAT_OF = {"q8_0": "i8", "q4_0": "i4", "q4_1": "i4", "q4_k": "i4w", "q6_k": "i6"}  # GGUF -> integer path
GGUF_BLOCKS = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q4_k": (256, 144), "q6_k": (256, 210)}
LINEAR_MODES = {"store": 0, "add": 1, "swiglu": 2}


def linear_supported(x: torch.Tensor) -> bool:
    """Whether `linear` can take x: 2-D rows with unit stride, `_inference_cpu`."""
    return x.dim() == 2 and x.stride(1) == 1 and _inference_cpu(x)


def linear(x: torch.Tensor, weight: torch.Tensor, fmt: str, in_features: int, padded: int,
           bias: torch.Tensor | None = None, out: torch.Tensor | None = None, mode: str = "store") -> torch.Tensor:
    """y = x W^T (+ bias) with W held in `weight` as `fmt` rows (linear.c): x [rows, in_features];
    weight [N, row bytes or padded elements]; bias float32 [N]. mode "store" returns a new (or fills
    `out`) [rows, N]; "add" adds the result into `out` (rounded as `out + y` is); "swiglu" returns
    silu(gate) * up [rows, N / 2] from outputs interleaved gate_0, up_0, gate_1, ... ."""
    rows, n = x.shape[0], weight.shape[0]
    if out is None:
        out = torch.empty(rows, n // 2 if mode == "swiglu" else n, dtype=x.dtype)
    assert out.stride(1) == 1 and out.dtype == x.dtype and weight.is_contiguous()
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    with _profiler_range("linear"):
        status = function("linear", x.dtype)(
            weight.data_ptr(), WEIGHT_FORMATS[fmt], weight.stride(0) * weight.element_size(), n, in_features,
            padded, x.data_ptr(), x.stride(0), rows, None if bias is None else bias.data_ptr(), out.data_ptr(),
            out.stride(0), LINEAR_MODES[mode], torch.get_num_threads())
    if status != 0:
        raise MemoryError("linear kernel: out of memory for its scratch buffer")
    return out


def int8_layout(kernel_fmt: str, in_features: int) -> tuple[int, int]:
    """(inputs a row covers, bytes of a row) of an integer-dot format (int8_dot.h's layout: a tail of 1-2
    blocks of 32 padded to 2, 3-4 to 4, 5-7 to a whole group of 8)."""
    padded = ctypes.c_int32()
    nbytes = function("int8_layout")(WEIGHT_FORMATS[kernel_fmt], in_features, ctypes.addressof(padded))
    return padded.value, nbytes


def pack_int8(blocks: torch.Tensor, fmt: str, in_features: int) -> tuple[torch.Tensor, str] | None:
    """GGUF blocks [N, row bytes] of `fmt` -> (rows [N, bytes] uint8 in int8_dot.h's layout, their format,
    INT8_FORMAT_OF[fmt]); None if a scale does not fit its f16 layout (a Q4_0 or Q8_0 scale beyond f16's
    range once multiplied by -8 or -128)."""
    kernel_fmt = INT8_FORMAT_OF[fmt]
    padded, row_bytes = int8_layout(kernel_fmt, in_features)
    blocks = blocks.contiguous()
    out = torch.empty(blocks.shape[0], row_bytes, dtype=torch.uint8)
    misfits = function("pack_int8_rows")(
        blocks.data_ptr(), WEIGHT_FORMATS[fmt], blocks.stride(0), blocks.shape[0], in_features, padded,
        WEIGHT_FORMATS[kernel_fmt], out.data_ptr(), out.stride(0), torch.get_num_threads())
    return None if misfits else (out, kernel_fmt)


def dequantize(weight: torch.Tensor, fmt: str, in_features: int) -> torch.Tensor:
    """The float32 matrix [N, in_features] that `weight` (rows in `fmt`) holds, exactly."""
    out = torch.empty(weight.shape[0], in_features, dtype=torch.float32)
    function("dequantize_rows")(weight.data_ptr(), WEIGHT_FORMATS[fmt], weight.stride(0) * weight.element_size(),
                                weight.shape[0], in_features, out.data_ptr(), torch.get_num_threads())
    return out
