"""`specserve` command line. Each subcommand lives beside the code it drives and registers itself here.

A subcommand module exposes `register(subparsers)`; it must import only argparse-level code at module
import so that `specserve --help` stays fast, and do the heavy imports inside its handler.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from specserve.errors import SpecServeError

DESCRIPTION = ("specserve: an LLM inference server with speculative decoding (OpenAI-compatible API)\n"
               "and an interpretable latency model of speculative decoding under load.")
EPILOG = """examples:
  specserve models fetch smollm2-135m         # download the default target once
  specserve serve                             # serve it on http://127.0.0.1:8000/v1 with the shipped drafts
  specserve generate --prompt "def fib(n):"   # offline generation
  specserve bench --base-url http://127.0.0.1:8000 --request-rate 2 --max-requests 50
  specserve latency fit bench/results/latency20/fixed.jsonl -o model.json
  specserve distill --target smollm2-135m --out my-draft --corpus code --method eagle --minutes 60

Run `specserve COMMAND --help` for a command's options; docs: README.md and docs/."""

# (module, description) in the order `specserve --help` lists them.
SUBCOMMAND_MODULES = [
    "specserve.model.cli",      # models fetch / list
    "specserve.engine.cli",     # generate
    "specserve.server.cli",     # serve
    "specserve.benchmark.cli",  # bench
    "specserve.latency.cli",    # latency fit / predict / plan / explain / plot
    "specserve.distill.cli",    # distill
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # that subcommand is not built yet
                continue
            raise
        module.register(subparsers)
    show_defaults(parser)
    return parser


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Make every option's help name its default: help that does not say "default" gets "(default: X)"
    appended, in every subcommand, so that a new option cannot forget it. Flags (on or off) are off."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                show_defaults(sub)
        elif (action.option_strings and action.nargs != 0 and not action.required
              and action.default is not argparse.SUPPRESS and "default" not in (action.help or "").lower()):
            shown = _shown(action.default).replace("%", "%%")  # help is a %-format string
            action.help = f"{action.help or ''} (default: {shown})".lstrip()


def _shown(value) -> str:
    if value is None or value == [] or value == ():
        return "none"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value))
    return str(value)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SpecServeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
