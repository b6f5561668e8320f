"""`specserve models fetch|list`."""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "models", help="fetch and list cached models",
        description="Download a model by alias into the local cache, or list what is cached.",
        epilog="example: specserve models fetch smollm2-135m && specserve models list")
    sub = p.add_subparsers(dest="models_command", required=True)
    fetch = sub.add_parser("fetch", help="download and convert a model alias into the cache")
    fetch.add_argument("alias", help="model alias, e.g. smollm2-135m")
    fetch.set_defaults(func=_fetch)
    ls = sub.add_parser("list", help="show cached models and known aliases")
    ls.set_defaults(func=_list)


def _fetch(args) -> int:
    from specserve.model.registry import fetch
    print(fetch(args.alias))
    return 0


def _list(args) -> int:
    from specserve.cache import cache_dir
    from specserve.model.registry import ALIASES, cached_models
    print(f"cache: {cache_dir()}")
    cached = cached_models()
    for alias, path in cached:
        print(f"  {alias:<16} {path}")
    if not cached:
        print("  (nothing cached yet)")
    print("aliases:")
    for alias, src in ALIASES.items():
        print(f"  {alias:<16} {src.description}")
    return 0
