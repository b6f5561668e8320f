"""`specserve --help` and every subcommand's help say what the command is for and show an example."""
import pytest

from specserve.cli import build_parser


def _subparsers(parser):
    return next(a for a in parser._actions if a.dest == "command").choices


def test_top_level_help_lists_examples():
    text = build_parser().format_help()
    assert "examples:" in text
    for command in ("serve", "generate", "bench", "latency", "distill", "models"):
        assert f"specserve {command} " in text, command


@pytest.mark.parametrize("command", ["serve", "generate", "bench", "latency", "distill", "models"])
def test_subcommand_help_has_a_description_and_an_example(command):
    sub = _subparsers(build_parser())[command]
    assert sub.description and sub.description.strip()
    assert f"specserve {command} " in (sub.epilog or "")
