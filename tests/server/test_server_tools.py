"""Tool calling through the official client, on the speculating server (a draft, k = 3) and on one without
speculation: the calls of tool_choice "required" and named functions always parse and match their schema (or
say they were cut), greedy replies are the same with and without speculation, streams add up to the whole
reply, and a conversation carrying calls and results is rendered and answered."""
import json

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL, ServerProcess, tiny_args

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"offset": {"type": "integer", "minimum": -12,
                                                                                  "maximum": 14}},
                                       "required": ["offset"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def plain_client(tiny_target, tmp_path_factory):
    """The same model without speculation."""
    server = ServerProcess(tiny_args(tiny_target, "--speculative-config", "none", "--served-model-name", MODEL),
                           tmp_path_factory.mktemp("server") / "plain.log")
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c
    server.stop()


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def streamed(client, **kw) -> tuple[str | None, list[tuple[str, str]], str]:
    """A streamed reply assembled as OpenAI's deltas say: content, calls (name, arguments), finish reason."""
    content, calls, finish = None, {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.delta.content:
                content = (content or "") + c.delta.content
            for d in c.delta.tool_calls or []:
                if d.id:  # the first delta of a call: its id, type and name
                    assert d.type == "function" and d.index not in calls
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def check_calls(choice, named: bool) -> None:
    """A reply's calls parse and match their function's schema, unless it was cut (finish_reason length): then
    a named call's arguments are cut too, and "required" lists the calls completed before the cut."""
    assert choice.finish_reason in ("tool_calls", "length"), choice
    assert choice.message.content is None
    if choice.finish_reason == "length" and named:
        return
    assert choice.message.tool_calls or choice.finish_reason == "length"
    for name, arguments in calls_of(choice.message):
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_greedy_calls_are_the_same_with_and_without_speculation_and_streamed(client, plain_client, tool_choice):
    kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=80, temperature=0)
    r = client.chat.completions.create(**kw)
    plain = plain_client.chat.completions.create(**kw)
    assert r.model_extra["speculative"]["num_drafts"] > 0
    assert calls_of(r.choices[0].message) == calls_of(plain.choices[0].message)
    assert r.choices[0].finish_reason == plain.choices[0].finish_reason
    check_calls(r.choices[0], tool_choice == NAMED)
    if tool_choice == NAMED:
        assert [name for name, _ in calls_of(r.choices[0].message)] == ["get_weather"]
    assert streamed(client, **kw) == (None, calls_of(r.choices[0].message), r.choices[0].finish_reason)


@pytest.mark.parametrize("tool_choice, parallel, finished", [
    (NAMED, True, 150), ("required", False, 150),
    ("required", True, 0),  # this random-weight model rarely closes the array of calls within max_tokens
])
def test_200_sampled_replies_parse_and_match_their_schema(client, tool_choice, parallel, finished):
    """T = 0.8: every reply's calls parse and validate, or it says it was cut by max_tokens."""
    choices = []
    for seed in range(13):  # 12 x 16 + 8 = 200 replies
        choices += client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                                  parallel_tool_calls=parallel, max_tokens=90, temperature=0.8,
                                                  seed=seed, n=16 if seed < 12 else 8).choices
    assert len(choices) == 200
    for choice in choices:
        check_calls(choice, tool_choice == NAMED)
    assert sum(c.finish_reason == "tool_calls" for c in choices) >= finished
    assert sum(len(c.message.tool_calls or []) for c in choices) >= 150


HERMES_REPLY = r'Ok\.\n<tool_call>\{"name": "get_time", "arguments": \{"offset": [1-9]\}\}</tool_call>'


def test_auto_reads_the_calls_out_of_the_models_reply(client, plain_client):
    """tool_choice auto: the Hermes parser takes calls out of the text (here the text is forced into the format
    by a regex, which a random-weight model would not write by itself)."""
    kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=90, temperature=0,
              extra_body={"guided_regex": HERMES_REPLY})
    r = client.chat.completions.create(**kw)
    (name, arguments), = calls_of(r.choices[0].message)
    assert name == "get_time" and 1 <= json.loads(arguments)["offset"] <= 9
    assert r.choices[0].message.content == "Ok.\n" and r.choices[0].finish_reason == "tool_calls"
    assert calls_of(plain_client.chat.completions.create(**kw).choices[0].message) == [(name, arguments)]
    assert streamed(client, **kw) == ("Ok.\n", [(name, arguments)], "tool_calls")
    none = client.chat.completions.create(**dict(kw, tool_choice="none"))  # the text stays text
    assert none.choices[0].message.tool_calls is None and "<tool_call>" in none.choices[0].message.content
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=20, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")


def test_a_conversation_with_calls_and_results_is_rendered_and_answered(client, spec_server):
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice=NAMED,
                                           max_tokens=80, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = MESSAGES + [first.choices[0].message,  # the reply as the client returned it
                           {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    as_json = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]
    counted = httpx.post(spec_server.root + "/tokenize", json={"model": MODEL, "messages": as_json, "tools": [WEATHER]})
    assert counted.json()["count"] == r.usage.prompt_tokens
    shown = httpx.post(spec_server.root + "/detokenize", json={"tokens": counted.json()["tokens"]}).json()["prompt"]
    made = json.dumps({"name": call.function.name, "arguments": json.loads(call.function.arguments)},
                      ensure_ascii=False)
    assert shown.index(json.dumps(WEATHER)) < shown.index(made) < shown.index("<tool_response>\nsunny, 21 C\n")


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools.0"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"messages": MESSAGES + [{"role": "function", "name": "f", "content": "1"}]}, "messages.1.role"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                         "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages.0.tool_calls.0"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra})
    assert e.value.body["param"] == param
