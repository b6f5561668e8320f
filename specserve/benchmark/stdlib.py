"""The Python standard library that ships with this Python, as a source of real code for benchmarks."""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path

# Folders that are not the library's own code (tests, third-party packages, the IDE) or are huge.
SKIP = {"test", "tests", "site-packages", "dist-packages", "idlelib", "lib2to3", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The library's .py files outside SKIP, sorted (the order does not depend on the file system)."""
    files = []
    for folder, dirs, names in os.walk(stdlib_root()):
        dirs[:] = [d for d in dirs if d not in SKIP]  # prune: site-packages can be huge
        files += [Path(folder) / n for n in names if n.endswith(".py")]
    return sorted(files)
