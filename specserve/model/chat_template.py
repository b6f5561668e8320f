"""Chat templates rendered the way transformers renders them (sandboxed jinja2, same globals/filters)."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2 import meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specserve.errors import InvalidRequestError


def _raise_exception(message):
    raise InvalidRequestError(f"chat template rejected the conversation: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers overrides jinja's tojson so that non-ASCII text and HTML characters pass unescaped.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=1)
def _env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    return _env().from_string(template)


@lru_cache(maxsize=16)
def reads_variable(template: str, name: str) -> bool:
    """Whether the template reads `name` from what it is given (e.g. "tools": it renders tool definitions)."""
    try:
        return name in meta.find_undeclared_variables(_env().parse(template))
    except jinja2.TemplateSyntaxError:
        return False


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True,
                special_tokens: dict[str, str] | None = None, **kwargs) -> str:
    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidRequestError(f"chat template has a syntax error: {e}") from None
    try:
        return compiled.render({**(special_tokens or {}), **kwargs, "messages": messages,
                                "add_generation_prompt": add_generation_prompt})
    except jinja2.TemplateError as e:
        raise InvalidRequestError(f"chat template failed: {e}") from None
