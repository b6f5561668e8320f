"""Where specserve keeps what it downloads and builds: converted models and compiled CPU kernels."""
from __future__ import annotations

from pathlib import Path

from specserve.settings import settings


def cache_dir() -> Path:
    return settings.cache
