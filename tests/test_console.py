"""specserve.console: tables are never cut short, on a terminal or piped."""
import io

from rich.table import Table

from specserve.console import UNBOUNDED_WIDTH, console


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_piped_tables_print_at_their_full_width():
    out = io.StringIO()
    table = Table(title="a title longer than eighty columns " * 3)
    for i in range(12):
        table.add_column(f"a long column header {i}")
    table.add_row(*(f"a long cell, repeated {i}" for i in range(12)))
    console(out).print(table)
    text = out.getvalue()
    assert "…" not in text and len(text.splitlines()) == 6  # title, three rules, one header line, one row
    assert all(f"a long column header {i}" in text and f"a long cell, repeated {i}" in text for i in range(12))
    assert max(len(line) for line in text.splitlines()) > 80
    # Nothing is padded out to the unbounded width.
    assert max(len(line) for line in text.splitlines()) < 400


def test_a_terminal_keeps_its_own_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert console(_Terminal()).width == 100
    assert console(io.StringIO()).width == UNBOUNDED_WIDTH
    monkeypatch.setenv("FORCE_COLOR", "1")  # colours in a pipe, still a pipe's width
    assert console(io.StringIO()).width == UNBOUNDED_WIDTH
