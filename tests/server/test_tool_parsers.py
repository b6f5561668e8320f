"""Tool-call parsers: the formats read right, and a stream's answers never taken back (every partial answer a
prefix of the final one), so streamed and whole replies agree."""
import json
import random

import pytest

from specserve.server.tool_parsers import (HermesParser, Llama3JsonParser, NamedParser, RequiredParser,
                                           choose_parser)
from specserve.server.tools import ToolReply

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize("text, content, calls", [
    ("no call here", "no call here", []),
    ("  \n", "  \n", []),
    (f"<tool_call>\n{WEATHER}\n</tool_call>", "", [("get_weather", '{"city": "Paris"}')]),
    (f"Let me look.\n<tool_call>{WEATHER}</tool_call>\n<tool_call>"
     '{"name": "now", "arguments": {}}</tool_call>\n', "Let me look.\n",
     [("get_weather", '{"city": "Paris"}'), ("now", "{}")]),
    (f"<tool_call>{WEATHER}", "", [("get_weather", '{"city": "Paris"}')]),  # cut by a stop string
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    (f"<tool_call>{WEATHER}</tool_call> and done", " and done", [("get_weather", '{"city": "Paris"}')]),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", '{"a": 1}')]),
])
def test_hermes(text, content, calls):
    parsed = HermesParser().parse(text, True)
    assert (parsed.content, parsed.calls) == (content, calls)


@pytest.mark.parametrize("text, content, calls", [
    ("Paris is sunny.", "Paris is sunny.", []),
    ('{"name": "f", "parameters": {"a": 1}}', "", [("f", '{"a": 1}')]),
    ('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"b": "x"}}', "",
     [("f", "{}"), ("g", '{"b": "x"}')]),
    ('{"name": "f", "parameters": {}} trailing', "trailing", [("f", "{}")]),
    ('{"no": "name"}', '{"no": "name"}', []),
])
def test_llama3_json(text, content, calls):
    parsed = Llama3JsonParser().parse(text, True)
    assert (parsed.content, parsed.calls) == (content, calls)


def test_required_and_named_read_the_grammars_output():
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    assert RequiredParser().parse(text, True).calls == [("f", '{"a": 1}'), ("g", "{}")]
    assert RequiredParser().parse(text[:45], False).calls == [("f", '{"a": 1}')]  # cut: the complete calls
    assert NamedParser("f").parse('{"a": ', False).calls == [("f", '{"a": ')]


PIECES = ["<tool_call>", "</tool_call>", "\n", " ", "hi", WEATHER, '{"name": "g", "parameters": {}}', "{", "}", ";",
          "<|python_tag|>", "<tool", "_call>", "[", "]", ",", '"']


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser(), RequiredParser()])
def test_partial_answers_are_prefixes_of_the_final_one(parser):
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 10)))
        final = parser.parse(text, True)
        for cut in range(len(text) + 1):
            part = parser.parse(text[:cut], False)
            assert final.content.startswith(part.content), (text, cut)
            assert final.calls[:len(part.calls)] == part.calls, (text, cut)


def _streamed(reply: ToolReply, pieces: list[str]) -> dict:
    """The message a client assembles from the deltas (as the openai client's stream helpers do)."""
    content, calls = "", {}
    for k, piece in enumerate(pieces):
        delta = reply.delta(piece, k == len(pieces) - 1)
        content += delta.get("content", "")
        for d in delta.get("tool_calls", []):
            call = calls.setdefault(d["index"], {"id": d.get("id"), "name": "", "arguments": ""})
            call["name"] += d.get("function", {}).get("name", "")
            call["arguments"] += d["function"].get("arguments", "")
    return {"content": content, "calls": [(c["name"], c["arguments"]) for c in calls.values()],
            "ids": all(c["id"] for c in calls.values())}


@pytest.mark.parametrize("parser, text", [
    (HermesParser(), f"Sure.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{WEATHER}</tool_call>"),
    (Llama3JsonParser(), '{"name": "f", "parameters": {"x": [1, 2]}}; {"name": "g", "parameters": {}}'),
    (RequiredParser(), '[{"name": "f", "parameters": {"x": 1}}]'),
    (NamedParser("f"), '{"x": {"y": "z"}}'),
    (HermesParser(), "just text, no calls"),
])
def test_streamed_deltas_add_up_to_the_whole_message(parser, text):
    whole = ToolReply(parser, True).message(text)
    rng = random.Random(1)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), 6))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        got = _streamed(ToolReply(parser, True), pieces)
        assert got["content"] == (whole["content"] or "")
        assert got["calls"] == [(c["function"]["name"], c["function"]["arguments"])
                                for c in whole.get("tool_calls", [])]
        assert got["ids"]


def test_without_parallel_calls_only_the_first_is_kept():
    text = f"<tool_call>{WEATHER}</tool_call><tool_call>{WEATHER}</tool_call>"
    assert len(ToolReply(HermesParser(), False).message(text)["tool_calls"]) == 1
    assert len(_streamed(ToolReply(HermesParser(), False), [text[:30], text[30:]])["calls"]) == 1


def test_a_message_with_calls_has_null_content_and_openai_ids():
    message = ToolReply(HermesParser(), True).message(f"<tool_call>{WEATHER}</tool_call>")
    call = message["tool_calls"][0]
    assert message["content"] is None and call["type"] == "function" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_auto_picks_llama3_json_for_llamas_template_and_hermes_otherwise():
    assert isinstance(choose_parser("auto", "{{ '<|python_tag|>' + x }}"), Llama3JsonParser)
    assert isinstance(choose_parser("auto", "{% for m in messages %}{{ m.content }}{% endfor %}"), HermesParser)
    assert isinstance(choose_parser("auto", None), HermesParser)
    assert isinstance(choose_parser("llama3_json", None), Llama3JsonParser)
