"""Draft models shipped with specserve (see specserve/drafts/) and how `"model"` names resolve."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

SHIPPED = ("code", "chat")


def shipped_draft_dir(name: str) -> Path:
    return Path(str(resources.files("specserve") / "drafts" / name))


def resolve_draft(name: str) -> str:
    """`default`, `code` or `chat` name a shipped draft; anything else is a path or a model alias."""
    if name == "default":
        name = "chat"
    if name in SHIPPED and (shipped_draft_dir(name) / "config.json").exists():
        return str(shipped_draft_dir(name))
    return name
