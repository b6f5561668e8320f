"""Where specserve keeps what it downloads and builds: converted models and compiled CPU kernels."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("SPECSERVE_CACHE") or Path.home() / ".cache" / "specserve")
