"""From a model's reply to OpenAI tool calls: the formats models are trained to call tools in (vLLM's
--tool-call-parser names), and the JSON the grammar forces for tool_choice "required" or a named function.

Every parser answers `parse(text, final)`: the reply's content and its tool calls (name, arguments as JSON
text). With final=False the text is a reply still being generated, and the answer holds only what no
continuation can change: its content is a prefix of the final content, its calls the final calls' first
ones (only the last may still grow its arguments). A stream sends the difference between two answers
(tool_stream.py), so streamed and whole replies agree.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

PARSER_NAMES = ("auto", "hermes", "llama3_json")


@dataclass(slots=True)
class Parsed:
    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (function name, arguments JSON)


def _call(obj, arguments_key: str) -> tuple[str, str] | None:
    """{"name": ..., "arguments" (or "parameters"): {...}} as a call, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("parameters" if arguments_key == "arguments" else "arguments", {}))
    if isinstance(args, str):  # some models write the arguments' JSON as a string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _held(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could begin `marker`: held back until the next token says."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


_DECODER = json.JSONDecoder()


def _values(text: str, pos: int, separators: str) -> list[tuple[object, int]]:
    """The JSON values at text[pos:] separated by whitespace or one of `separators`, up to the first that
    does not parse (or the end): each with where the text after it (and its separators) begins."""
    values = []
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            return values
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        values.append((value, pos))


class HermesParser:
    """Hermes-2-Pro, Qwen2.5/3 and specserve's default: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
    one block per call, after any text. A block that is not such a call stays in the content, and so does
    text after the last block; content that is only whitespace around the calls is dropped."""
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        start = text.find(self.OPEN)
        if start < 0:
            if final:
                return Parsed(text)
            head = text[:len(text) - _held(text, self.OPEN)]
            return Parsed(head if head.strip() else "")  # leading whitespace waits: it goes if a call comes
        out = Parsed(text[:start] if text[:start].strip() else "")
        pos = start
        while True:  # at an OPEN
            end = text.find(self.CLOSE, pos)
            body = text[pos + len(self.OPEN):] if end < 0 else text[pos + len(self.OPEN):end]
            if end < 0 and not final:
                return out
            call = self._block(body)
            stop = len(text) if end < 0 else end + len(self.CLOSE)
            if call:
                out.calls.append(call)
            else:
                out.content += text[pos:stop]
            nxt = text.find(self.OPEN, stop)
            between = text[stop:] if nxt < 0 else text[stop:nxt]
            if nxt < 0 and not final:
                return out
            if between.strip():
                out.content += between
            if nxt < 0:
                return out
            pos = nxt

    @staticmethod
    def _block(body: str) -> tuple[str, str] | None:
        try:
            return _call(json.loads(body), "arguments")
        except ValueError:
            return None


class Llama3JsonParser:
    """Llama 3.1/3.2's JSON tool calls (vLLM's llama3_json): a reply that starts with `{` (after Llama's
    `<|python_tag|>`, when special tokens are kept) is `{"name": ..., "parameters": {...}}` objects separated
    by `;`; any other reply is content. What follows the last call that parses is content."""
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].lstrip()
        if not body or (self.TAG.startswith(body) and not final):
            return Parsed(text if final else "")
        if not body.startswith("{"):
            return Parsed(text)
        calls, after = [], 0
        for obj, end in _values(body, 0, ";"):
            call = _call(obj, "parameters")
            if call is None:
                break
            calls.append(call)
            after = end
        if not final:
            return Parsed("", calls)
        if not calls:
            return Parsed(text)
        rest = body[after:]
        return Parsed(rest if rest.strip() else "", calls)


class NamedParser:
    """tool_choice naming a function: the grammar made the whole reply that function's arguments."""

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed("", [(self.name, text)])


class RequiredParser:
    """tool_choice "required": the grammar made the reply a JSON array of {"name", "parameters"} (vLLM's
    form), one element per call. A reply cut short keeps the calls completed before the cut."""

    def parse(self, text: str, final: bool) -> Parsed:
        start = text.find("[")
        if start < 0:
            return Parsed()
        return Parsed("", [c for c in (_call(v, "parameters") for v, _ in _values(text, start + 1, ",")) if c])


def choose_parser(name: str, template: str | None):
    """The parser `--tool-call-parser` names; `auto`: Llama 3's where the chat template writes Llama's
    tool-call tag, else Hermes' (the format of Qwen's templates and of specserve's default tool prompt)."""
    if name == "auto":
        name = "llama3_json" if template and Llama3JsonParser.TAG in template else "hermes"
    return {"hermes": HermesParser, "llama3_json": Llama3JsonParser}[name]()
