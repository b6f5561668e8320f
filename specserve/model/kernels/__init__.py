"""CPU kernels in plain C, compiled on first use with the system's C compiler and loaded with ctypes.

Kernels: attention of short queries over the paged KV cache and the cache writes (`paged_attention.c`),
RMSNorm (`rms_norm.c`), rotary embedding (`rope.c`), the greedy argmax of logit rows (`argmax.c`),
linear layers on float32, bf16 and GGUF-quantized weights (`linear.c`), and all of a step's decoder layers in one call (`decoder.c`). They are optimisations only:
without a compiler, on other devices or dtypes, with autograd recording, or with
SPECSERVE_CPU_KERNELS=0, torch ops run instead (`model/attention.py`'s gather path, F.rms_norm,
`rope.apply_rope`'s ops, torch.argmax, F.linear on dequantized weights; same results up to float
rounding). `model/cpu_forward.py` calls them directly for whole decoder layers.

All go into one library, built for this CPU (-march=native) into the cache directory and named by a
hash of the sources, the flags and the CPU, so an edited source or another machine sharing the cache
rebuilds.
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
from pathlib import Path

import torch

from specserve.cache import cache_dir

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
    march = "-march=" + os.environ.get("SPECSERVE_CPU_KERNELS_MARCH", "native")
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


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("SPECSERVE_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: attention, RMSNorm, rope and argmax run on torch ops (slower steps)")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("CPU kernels unavailable, using torch ops: %s", detail.strip()[:300])
        return None
    for suffix in DTYPES.values():
        fn = getattr(lib, f"paged_attention_short_{suffix}")
        fn.restype = ctypes.c_int
        fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 7 + [ctypes.c_int32] * 6
                       + [ctypes.c_float] + [ctypes.c_int32] * 2)
        fn = getattr(lib, f"rms_norm_{suffix}")
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int32] * 2 + [
            ctypes.c_float, ctypes.c_int32]
        fn = getattr(lib, f"rope_{suffix}")
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_void_p] + [
            ctypes.c_int32] * 4
        fn = getattr(lib, f"linear_{suffix}")
        fn.restype = ctypes.c_int
        fn.argtypes = ([ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64] + [ctypes.c_int32] * 3
                       + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p,
                          ctypes.c_int64, ctypes.c_int32, ctypes.c_int32])
        fn = getattr(lib, f"decoder_layers_{suffix}")
        fn.restype = ctypes.c_int
        fn.argtypes = ([ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p] + [ctypes.c_int32] * 2
                       + [ctypes.c_void_p] * 5 + [ctypes.c_int32] * 4 + [ctypes.c_void_p] * 2
                       + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32,
                          ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p] + [ctypes.c_int32] * 3)
    lib.kv_write.restype = None
    lib.kv_write.argtypes = ([ctypes.c_void_p, ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3
                             + [ctypes.c_int32] * 5)
    lib.dequantize_rows.restype = None
    lib.dequantize_rows.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_int32,
                                    ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32]
    lib.argmax_rows_f32.restype = None
    lib.argmax_rows_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32,
                                    ctypes.c_void_p, ctypes.c_int32]
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
    fn = getattr(_library(), f"paged_attention_short_{DTYPES[q.dtype]}")
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
        getattr(_library(), f"rms_norm_{DTYPES[x.dtype]}")(
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
        getattr(_library(), f"rope_{DTYPES[x.dtype]}")(
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
        _library().argmax_rows_f32(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1],
                                   out.data_ptr(), torch.get_num_threads())
    return out


# Weight formats of `linear` (codes of linear.c) and, for the GGUF ones, (weights per block, bytes per block).
WEIGHT_FORMATS = {"f32": 0, "bf16": 1, "q8_0": 2, "q4_0": 3, "q4_1": 4, "q4_k": 5}
GGUF_BLOCKS = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q4_k": (256, 144)}
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
        status = getattr(_library(), f"linear_{DTYPES[x.dtype]}")(
            weight.data_ptr(), WEIGHT_FORMATS[fmt], weight.stride(0) * weight.element_size(), n, in_features,
            padded, x.data_ptr(), x.stride(0), rows, None if bias is None else bias.data_ptr(), out.data_ptr(),
            out.stride(0), LINEAR_MODES[mode], torch.get_num_threads())
    if status != 0:
        raise MemoryError("linear kernel: out of memory for its scratch buffer")
    return out


def dequantize(weight: torch.Tensor, fmt: str, in_features: int) -> torch.Tensor:
    """The float32 matrix [N, in_features] that `weight` (rows in `fmt`) holds, exactly."""
    out = torch.empty(weight.shape[0], in_features, dtype=torch.float32)
    _library().dequantize_rows(weight.data_ptr(), WEIGHT_FORMATS[fmt], weight.stride(0) * weight.element_size(),
                               weight.shape[0], in_features, out.data_ptr(), torch.get_num_threads())
    return out
