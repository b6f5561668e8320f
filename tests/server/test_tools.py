"""Tool calling's request side: what is refused, the grammars of "required" and named choices, and how the
conversation reaches the chat template (the model's own that reads tools, or the Hermes-style default)."""
import json
import shutil

import jsonschema
import pytest

from specserve.model.tokenizer import Tokenizer
from specserve.server.errors import APIError
from specserve.server.protocol import ChatCompletionRequest, ChatMessage, Guided
from specserve.server.serving import render_chat
from specserve.server.tools import CALL_JSON, Tools, hermes_messages
from specserve.structured_output.grammar import GrammarCompiler
from specserve.structured_output.params import StructuredOutputsParams

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
# A pydantic-style schema: nested models under $defs, referenced from the properties
ORDER = {"type": "function", "function": {"name": "order", "parameters": {
    "$defs": {"Item": {"type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                       "required": ["sku", "qty"]}},
    "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}},
    "required": ["items"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]

# A chat template of the Qwen kind, written for these tests: it renders the tools and the calls itself.
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{"name": "{{ c.function.name }}", "arguments": \
{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.mark.parametrize("tools, choice, param", [
    (None, "required", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER], {"type": "allowed_tools", "allowed_tools": {}}, "tool_choice"),
    ([{"type": "custom", "custom": {"name": "x"}}], None, "tools.0"),
    ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], None, "tools.0.function.parameters"),
    ([WEATHER, WEATHER], None, "tools.1.function.name"),
])
def test_what_is_refused(tools, choice, param):
    with pytest.raises(APIError) as e:
        Tools.from_request(tools, choice, None)
    assert e.value.status == 400 and e.value.param == param


def test_choices():
    assert Tools.from_request(None, "none", None) is None
    assert Tools.from_request([WEATHER], None, None).choice == "auto"  # OpenAI's default with tools
    named = Tools.from_request([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, False)
    assert (named.choice, named.name, named.parallel) == ("named", "get_weather", False)
    assert Tools.from_request([WEATHER], "auto", None).guide() is None


def test_a_requests_structured_output_names_the_field_that_set_it():
    """Read from the request as parsed, with no other call first: the field that set the guide (a 400 for its
    grammar names it), the tool calls' grammar for tool_choice "required", and a 400 for both at once."""
    messages = [{"role": "user", "content": "hi"}]
    own = ChatCompletionRequest(messages=messages, response_format={"type": "json_object"})
    assert own.structured_output() == Guided("response_format", StructuredOutputsParams(json_object=True))
    tools = ChatCompletionRequest(messages=messages, tools=[WEATHER], tool_choice="required")
    assert tools.structured_output() == Guided("tools", tools.tool_spec.guide())
    assert ChatCompletionRequest(messages=messages, tools=[WEATHER]).structured_output() is None  # auto
    both = ChatCompletionRequest(messages=messages, tools=[WEATHER], tool_choice="required", guided_regex="a+")
    with pytest.raises(APIError, match="guided_regex cannot be combined") as e:
        both.structured_output()
    assert e.value.param == "tool_choice"


@pytest.fixture(scope="module")
def compiler(tiny_target):
    tok = Tokenizer.from_dir(tiny_target)
    return GrammarCompiler(tok, tok.vocab_size)


def _matches(compiler, guide, text: str) -> bool:
    """Whether the grammar allows the whole text and may end after it."""
    grammar = compiler.matcher(guide)
    ids = compiler.tokenizer.encode(text, add_special_tokens=False)
    if grammar.valid_prefix(ids) != len(ids):
        return False
    grammar.advance(ids)
    return grammar.matcher.is_accepting()


def test_required_grammar_is_an_array_of_calls_each_matching_its_function(compiler):
    tools = Tools.from_request([WEATHER, ORDER], "required", None)
    guide = tools.guide()
    schema = json.loads(guide.json)
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}},
            {"name": "order", "parameters": {"items": [{"sku": "a1", "qty": 2}]}}]
    jsonschema.validate(good, schema)  # the $defs of each tool were hoisted and their references followed
    for bad in ([], [{"name": "get_weather", "parameters": {"days": 1}}],
                [{"name": "order", "parameters": {"items": [{"sku": "a1"}]}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert _matches(compiler, guide, json.dumps(good))
    assert not _matches(compiler, guide, json.dumps(good, indent=1))  # written as json.dumps writes it
    assert not _matches(compiler, guide, json.dumps(good[:1] + [{"name": "other", "parameters": {}}]))
    single = json.loads(Tools.from_request([WEATHER], "required", False).guide().json)
    assert single["maxItems"] == 1  # parallel_tool_calls: false


def test_named_grammar_is_the_functions_parameters_closed_when_strict(compiler):
    strict = {"type": "function", "function": dict(WEATHER["function"], strict=True)}
    choice = {"type": "function", "function": {"name": "get_weather"}}
    named = json.loads(Tools.from_request([WEATHER], choice, None).guide().json)
    assert named == {"x-guidance": CALL_JSON, **WEATHER["function"]["parameters"]}
    closed = json.loads(Tools.from_request([strict], choice, None).guide().json)
    assert closed["additionalProperties"] is False
    assert _matches(compiler, Tools.from_request([strict], choice, None).guide(), '{"city": "Rome", "days": 3}')
    no_params = {"type": "function", "function": {"name": "now"}}
    assert _matches(compiler, Tools.from_request([no_params], {"type": "function", "function": {"name": "now"}},
                                                 None).guide(), "{}")


def test_default_hermes_rewrite_describes_tools_and_turns_calls_and_results_into_text():
    tools = Tools.from_request([WEATHER], None, None)
    messages = [dict(m, content=m["content"] or "") for m in CONVERSATION + [
        {"role": "tool", "tool_call_id": "call_2", "content": "windy"}]]
    out = hermes_messages([{"role": "system", "content": "Be brief."}] + messages, tools)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and json.dumps(WEATHER) in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\nsunny, 21 C\n</tool_response>\n<tool_response>\nwindy\n</tool_response>"
    assert all("tool_calls" not in m and "tool_call_id" not in m for m in out)
    assert hermes_messages(messages[:1], None) == messages[:1]  # no tools, no calls: unchanged


def _tokenizer(tiny_target, tmp_path, template: str) -> Tokenizer:
    model = tmp_path / "model"
    shutil.copytree(tiny_target, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template=template)))
    return Tokenizer.from_dir(model)


def test_a_template_that_reads_tools_renders_them_itself_with_arguments_as_objects(tiny_target, tmp_path):
    tok = _tokenizer(tiny_target, tmp_path, TOOL_TEMPLATE)
    text = render_chat(tok, [ChatMessage(**m) for m in CONVERSATION], Tools.from_request([WEATHER], None, None), True)
    assert text.startswith("<|im_start|>system\n# Tools\n<tools>\n" + json.dumps(WEATHER))
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<tool_response>sunny, 21 C</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


def test_the_default_template_gets_the_hermes_rewrite(tiny_target):
    tok = Tokenizer.from_dir(tiny_target)  # "<s>{role}: {content}" for each message: no tools
    text = render_chat(tok, [ChatMessage(**m) for m in CONVERSATION], Tools.from_request([WEATHER], None, None), True)
    assert text.startswith("<s>system: # Tools") and "<s>user: <tool_response>\nsunny, 21 C\n" in text
    assert '<s>assistant: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text


def test_named_tool_use_template_serves_requests_with_tools(tiny_target, tmp_path):
    """Hermes-2-Pro ships a default template and a "tool_use" one."""
    tok = _tokenizer(tiny_target, tmp_path, [{"name": "default", "template": "plain {{ messages[0].content }}"},
                                             {"name": "tool_use", "template": TOOL_TEMPLATE}])
    messages = [ChatMessage(role="user", content="hi")]
    assert render_chat(tok, messages, None, False) == "plain hi"
    assert "# Tools" in render_chat(tok, messages, Tools.from_request([WEATHER], None, None), False)


def test_continue_final_message_and_template_kwargs(tiny_target, tmp_path):
    tok = _tokenizer(tiny_target, tmp_path, "{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ '' if "
                                            "quiet else '!' }}\n{% endfor %}")
    messages = [ChatMessage(role="user", content="Count"), ChatMessage(role="assistant", content="One, two,")]
    assert render_chat(tok, messages, None, False, True, {"quiet": True}) == "[user] Count\n[assistant] One, two,"
    assert render_chat(tok, messages, None, False, False, {"quiet": False}).endswith("two,!\n")
    with pytest.raises(APIError):  # the last message must be written as it is
        render_chat(tok, messages[:1] + [ChatMessage(role="assistant", content="")], None, False, True)
