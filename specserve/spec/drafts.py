"""Draft models shipped with specserve (see specserve/drafts/) and how `"model"` names resolve.

`"model": "code"` or `"model": "chat"` picks a shipped draft explicitly. `"model": "default"` picks the
one named by the environment variable SPECSERVE_DEFAULT_DRAFT (code or chat), else DEFAULT_DRAFT: one
draft serves all requests of an engine, so the choice is per deployment, not per request; the default is
the draft that measured best on both workloads together (docs/distill.md, bench/draft_acceptance.py).
"""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from specserve.errors import SpecServeError

SHIPPED = ("code", "chat")
DEFAULT_DRAFT = "code"
DEFAULT_ENV = "SPECSERVE_DEFAULT_DRAFT"


def shipped_draft_dir(name: str) -> Path:
    return Path(str(resources.files("specserve") / "drafts" / name))


def default_draft() -> str:
    name = os.environ.get(DEFAULT_ENV) or DEFAULT_DRAFT
    if name not in SHIPPED:
        raise SpecServeError(f"{DEFAULT_ENV}={name!r}: choose one of {', '.join(SHIPPED)}")
    return name


def resolve_draft(name: str) -> str:
    """`default`, `code` or `chat` name a shipped draft; anything else is a path or a model alias."""
    if name == "default":
        name = default_draft()
    if name in SHIPPED and (shipped_draft_dir(name) / "config.json").exists():
        return str(shipped_draft_dir(name))
    return name
