"""`specserve --help` and every subcommand's help say what the command is for, show an example, and name
every option's default."""
import argparse
import subprocess
import sys

import pytest

from specserve.cli import build_parser, show_defaults


def _subparsers(parser):
    return next(a for a in parser._actions if a.dest == "command").choices


def _options(parser, name="specserve"):
    """(command, action, its help as printed) of every option of every (sub)command that takes a value."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _options(sub, f"{name} {sub_name}")
        elif action.option_strings and action.nargs != 0 and not action.required:
            yield name, action, parser._get_formatter()._expand_help(action) if action.help else ""


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


def test_every_option_shows_its_default():
    missing = [f"{cmd} {a.option_strings[-1]}" for cmd, a, text in _options(build_parser())
               if "default" not in text.lower()]
    assert not missing, f"options whose --help names no default: {missing}"


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_written_default_is_the_real_one(command):
    """Where serve's or generate's help states a number or a word as the default, it is the value argparse
    uses (a help written as "(default 30)" goes stale when the default changes)."""
    stale = []
    for cmd, a, text in _options(_subparsers(build_parser())[command], command):
        d = a.default
        if d is None or isinstance(d, (bool, list)):
            continue
        forms = {str(d)} | ({f"{d:g}"} if isinstance(d, (int, float)) else set())
        if not any(f in text.split("default")[-1] for f in forms):
            stale.append(f"{cmd} {a.option_strings[-1]}: default {d!r}, help says {text!r}")
    assert not stale, stale


def test_a_new_option_without_a_default_in_its_help_gets_one():
    p = argparse.ArgumentParser()
    p.add_argument("--new", type=float, default=0.5, help="something new")
    p.add_argument("--bare", default=None)
    p.add_argument("--flag", action="store_true")
    show_defaults(p)
    text = " ".join(p.format_help().split())
    assert "something new (default: 0.5)" in text and "--bare BARE (default: none)" in text
    assert "--flag" in text and text.count("(default:") == 2


def test_the_commands_load_without_torch_or_ray():
    """Building the parser (every `specserve ... --help`, and `specserve serve` before it starts) reads the
    scale-out flags only: Ray and the rest of scaleout/ load when `serve --replicas` runs."""
    code = "import sys; from specserve.cli import build_parser; build_parser(); print(' '.join(sys.modules))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(run.stdout.split())
    assert "specserve.server.cli" in loaded and not {"torch", "ray"} & loaded
    scaleout = {m for m in loaded if m.startswith("specserve.scaleout")}
    assert scaleout == {"specserve.scaleout", "specserve.scaleout.args"}
