"""The rich console every table specserve prints goes through, so that no table is ever cut short.

Rich fits output to the console's width, and with stdout piped (`| cat`, `| tee log`, a script) it assumes
80 columns: wide tables then fold their headers and cut cells to "MAP…". Here a terminal keeps its own
width, and anything else gets a width no table reaches, so each table prints at its natural width.
"""
from __future__ import annotations

from typing import IO

from rich.console import Console

# Wider than any table specserve prints. Tables, text and progress bars (a fixed-width bar) are not padded
# out to the console's width, so this costs nothing; what expands to fill it (console.log, rules, a table
# made with expand=True) must stay off a piped console.
UNBOUNDED_WIDTH = 10_000


def console(file: IO[str] | None = None) -> Console:
    """A console on `file` (default stdout): the terminal's width on a terminal, unbounded otherwise."""
    out = Console(file=file)
    if not out.file.isatty():  # not rich's is_terminal, which FORCE_COLOR turns on for a pipe too
        out.width = UNBOUNDED_WIDTH
    return out
