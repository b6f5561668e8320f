"""Every environment variable specserve reads, read once, when this module is first imported: one default
each, and what it does. The rest of the package reads `settings`; a test that needs another value sets the
attribute (`monkeypatch.setattr(settings, "int8_dot", False)`), and a process started with a variable in its
environment (a server under test, a spawned engine process) reads it at its own import.

Left where they are, because they are set for a library, not read as a setting: `OMP_WAIT_POLICY` and
`GOMP_SPINCOUNT` (`specserve/__init__.py` sets the spin count for OpenMP before torch loads it) and the
environment `scaleout/process.py` hands to the Ray server it starts. The test suite's own knobs
(`SPECSERVE_TEST_THREADS`, `SPECSERVE_FUZZ_SEED`) are read in tests/.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

API_KEY_ENV = "SPECSERVE_API_KEY"
DEFAULT_DRAFT_ENV = "SPECSERVE_DEFAULT_DRAFT"
STEP_PACE_ENV = "SPECSERVE_TEST_STEP_PACE_S"


@dataclass(slots=True)
class Settings:
    # SPECSERVE_CACHE: where converted models, compiled kernels and step-cost profiles go.
    cache: Path
    # SPECSERVE_CPU_KERNELS=0: no C kernels at all (torch ops; quantized models load their dequantized values).
    cpu_kernels: bool
    # SPECSERVE_CPU_KERNELS_MARCH: the -march the C kernels are built for (x86-64: the portable code).
    cpu_kernels_march: str
    # SPECSERVE_INT8_DOT=0: GGUF blocks on the exact path (expanded to float32) instead of integer dot products.
    int8_dot: bool
    # SPECSERVE_BATCH_INVARIANT: 1 everywhere, 0 nowhere; unset (None): attention always, and the linear
    # layers of every dtype but float32 (model/attention.py, model/cpu_linear.py; docs/cpu-kernels.md).
    batch_invariant: bool | None
    # SPECSERVE_GPU_ATTENTION=torch: torch's ops instead of the Triton kernel for short queries on a GPU.
    gpu_attention: str
    # SPECSERVE_GPU_FUSED=0: torch's ops instead of the fused Triton decoder layer on a GPU.
    gpu_fused: bool
    # SPECSERVE_GRAPH_PREFILL=0: prefill chunks past 32 tokens run eagerly, outside the CUDA graphs.
    graph_prefill: bool
    # SPECSERVE_DEFAULT_DRAFT=code|chat: the one shipped draft "default" names (unset: both, routed).
    default_draft: str | None
    # SPECSERVE_API_KEY: the key `specserve serve` requires where --api-key is not given.
    api_key: str | None
    # SPECSERVE_COMMIT: the commit bench records name, where the tree has no (or a stale) .git.
    commit: str | None
    # SPECSERVE_TEST_STEP_PACE_S, tests only: the engine loop sleeps this long after every step, so that a
    # request of n tokens provably runs for a while (tests start paced servers with it in their environment).
    test_step_pace_s: float
    # CC: the C compiler for the kernels (as make reads it; unset: cc, else gcc).
    cc: str | None
    # OPENAI_API_KEY: `specserve bench`'s --api-key default, as OpenAI's clients read it.
    openai_api_key: str | None


def read(env: Mapping[str, str]) -> Settings:
    batch_invariant = env.get("SPECSERVE_BATCH_INVARIANT", "")
    return Settings(
        cache=Path(env.get("SPECSERVE_CACHE") or Path.home() / ".cache" / "specserve"),
        cpu_kernels=env.get("SPECSERVE_CPU_KERNELS", "1") != "0",
        cpu_kernels_march=env.get("SPECSERVE_CPU_KERNELS_MARCH", "native"),
        int8_dot=env.get("SPECSERVE_INT8_DOT", "1") != "0",
        batch_invariant={"1": True, "0": False}.get(batch_invariant),
        gpu_attention=env.get("SPECSERVE_GPU_ATTENTION", "triton"),
        gpu_fused=env.get("SPECSERVE_GPU_FUSED") != "0",
        graph_prefill=env.get("SPECSERVE_GRAPH_PREFILL") != "0",
        default_draft=env.get(DEFAULT_DRAFT_ENV),
        api_key=env.get(API_KEY_ENV),
        commit=env.get("SPECSERVE_COMMIT") or None,
        test_step_pace_s=float(env.get(STEP_PACE_ENV) or 0),
        cc=env.get("CC") or None,
        openai_api_key=env.get("OPENAI_API_KEY"),
    )


settings = read(os.environ)
