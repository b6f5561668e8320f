"""Draft models shipped with specserve (see specserve/drafts/) and how `"model"` names resolve.

`"model": "code"` or `"model": "chat"` picks a shipped draft. `"model": "default"` loads both and drafts
each request with the one whose vocabulary covers its prompt best (spec_decode/router.py), so one server serves
code completion and chat each with its own draft; the environment variable SPECSERVE_DEFAULT_DRAFT (code
or chat) pins "default" to one of them instead. A list of names or directories routes between those.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from specserve.errors import SpecServeError
from specserve.settings import DEFAULT_DRAFT_ENV, settings

SHIPPED = ("code", "chat")  # routing breaks ties in this order


def shipped_draft_dir(name: str) -> Path:
    return Path(str(resources.files("specserve") / "drafts" / name))


def resolve_draft(name: str) -> str:
    """`code` or `chat` name a shipped draft; anything else is a path or a model alias."""
    if name in SHIPPED and (shipped_draft_dir(name) / "config.json").exists():
        return str(shipped_draft_dir(name))
    return name


def resolve_drafts(model: str | list[str]) -> list[str]:
    """The draft(s) a speculative config's "model" names: several are routed per request."""
    if isinstance(model, list):
        return [resolve_draft(name) for name in model]
    if model != "default":
        return [resolve_draft(model)]
    pinned = settings.default_draft
    if pinned is not None:
        if pinned not in SHIPPED:
            raise SpecServeError(f"{DEFAULT_DRAFT_ENV}={pinned!r}: choose one of {', '.join(SHIPPED)}")
        return [resolve_draft(pinned)]
    return [resolve_draft(name) for name in SHIPPED]
