"""Progress bar for distillation: loss, tokens/s, held-out top-1 agreement, ETA. When stdout is not a
terminal (a background run writing a log) it prints one plain line every 30 s instead, and log messages as
plain timestamped lines (rich would fold them to 80 columns)."""
from __future__ import annotations

import sys
import time

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from specserve.console import console


class ProgressBar:
    def __init__(self):
        self.interactive = sys.stdout.isatty()
        self.progress = Progress(TextColumn("distill"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                                 TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                 TimeRemainingColumn(), console=console()) if self.interactive else None
        self.task = None
        self.last_line = 0.0

    def __enter__(self):
        if self.progress:
            self.progress.start()
            self.task = self.progress.add_task("distill", total=1.0, stats="")
        return self

    def __exit__(self, *exc):
        if self.progress:
            self.progress.stop()

    def log(self, message: str) -> None:
        if self.progress:
            self.progress.console.log(message)
        else:
            print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    def update(self, progress: float, step: int, loss: float, agreement: float | None, tokens_per_s: float,
               elapsed: float) -> None:
        agree = "-" if agreement is None else f"{agreement:.1%}"
        stats = f"step {step}  loss {loss:.3f}  {tokens_per_s:,.0f} tok/s  held-out top-1 {agree}"
        if self.progress:
            self.progress.update(self.task, completed=progress, stats=stats)
        elif time.monotonic() - self.last_line > 30:
            self.last_line = time.monotonic()
            eta = elapsed / max(progress, 1e-9) - elapsed
            print(f"[{elapsed / 60:5.1f} min, {progress:4.0%}, ETA {eta / 60:4.1f} min] {stats}", flush=True)
