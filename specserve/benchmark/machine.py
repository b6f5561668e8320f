"""What a benchmark ran on and from: the CPU's name and instruction set, and the checkout's commit.

Every published number names its CPU (kernels dispatch on AVX-512 / AVX2 at run time) and its commit;
the bench/ scripts take both from here.
"""
from __future__ import annotations

import platform
import subprocess
from pathlib import Path

from specserve.settings import settings

REPO = Path(__file__).resolve().parents[2]


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_model() -> str:
    """The CPU's marketing name ("AMD EPYC ..."), or what `platform` knows where /proc/cpuinfo is absent."""
    return next((line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines()
                 if line.startswith("model name")), platform.processor() or "?")


def cpu_flags() -> set[str]:
    line = next((line for line in _cpuinfo().splitlines() if line.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def cpu_name() -> str:
    """The CPU's name and its widest vector instruction set: "AMD EPYC ..., AVX-512"."""
    flags = cpu_flags()
    isa = "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "no AVX2")
    return f"{cpu_model()}, {isa}"


def git_commit(default: str = "") -> str:
    """This checkout's short commit hash; $SPECSERVE_COMMIT where set (a lent device's copy of the tree has no
    .git, or a stale one); `default` outside a git checkout."""
    if settings.commit:
        return settings.commit
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    except OSError:
        return default
    return out.stdout.strip() or default
