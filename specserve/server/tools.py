"""Tool calling in /v1/chat/completions: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.

The prompt: a chat template that reads `tools` (Qwen's, Llama 3.1's, Hermes' "tool_use" one) renders the
tools and the conversation's calls and results itself, given them as transformers gives them (arguments as
objects). For a template that does not (SmolLM2's), the conversation is rewritten in the Hermes format before
its template sees it (`hermes_messages`): the tools described in the system message, each earlier call as a
`<tool_call>` block in its assistant message, tool results as `<tool_response>` blocks in a user message.

The reply: tool_choice "auto" reads calls out of the model's own format with the server's tool-call parser
(tool_parsers.py); "required" and a named function constrain the reply with a grammar (structured output, so
speculation stays exact) to a JSON array of calls, or to the named function's arguments, each matching the
function's parameter schema; "none" leaves the reply as text. `ToolReply` turns the reply, whole or as it
streams, into the message's content and tool_calls.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from specserve.server.errors import APIError
from specserve.server.tool_parsers import NamedParser, RequiredParser, choose_parser
from specserve.structured_output.params import StructuredOutputsParams, closed

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
# Calls are written as json.dumps writes JSON, the form tool calls take in models' training data: no
# whitespace left to the model (with the server's flexible default, a small model at temperature 0.8 spends its
# tokens on it). An empty pattern replaces the default one, which a schema's options would otherwise inherit.
CALL_JSON = {"whitespace_flexible": False, "whitespace_pattern": "", "item_separator": ", ", "key_separator": ": "}

DEFAULT_TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to answer the user.\n"
    "The functions are described in JSON within <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, write a JSON object with its name and arguments within <tool_call></tool_call> tags, "
    "one block per call:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <arguments-json-object>}}\n"
    "</tool_call>")


@dataclass(frozen=True, slots=True)
class Tools:
    """A request's tools (each tool's `function` object) and what it asks of them."""
    functions: tuple[dict, ...]
    choice: str = "auto"   # none | auto | required | named
    name: str | None = None  # the named function
    parallel: bool = True

    @classmethod
    def from_request(cls, tools: list | None, tool_choice, parallel: bool | None) -> "Tools | None":
        """Raises APIError (400) for what OpenAI's API would refuse or specserve cannot serve."""
        if not tools:
            if tool_choice not in (None, "none", "auto"):  # (auto: nothing to call, as frameworks send it)
                raise APIError(400, f"tool_choice {tool_choice!r} needs tools", "tool_choice")
            return None
        functions = []
        for i, tool in enumerate(tools):
            f = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(f, dict):
                raise APIError(400, "only tools of type function are supported ({\"type\": \"function\", "
                                    "\"function\": {\"name\", \"parameters\"}})", f"tools.{i}")
            if not isinstance(f.get("name"), str) or not NAME.match(f["name"]):
                raise APIError(400, "a function name is 1 to 64 letters, digits, _ or -", f"tools.{i}.function.name")
            if not isinstance(f.get("parameters", {}), dict):
                raise APIError(400, "parameters must be a JSON schema object", f"tools.{i}.function.parameters")
            if f["name"] in (g["name"] for g in functions):
                raise APIError(400, f"two tools are named {f['name']!r}", f"tools.{i}.function.name")
            functions.append(f)
        name = None
        if tool_choice is None:
            tool_choice = "auto"
        elif isinstance(tool_choice, dict):
            if tool_choice.get("type") == "allowed_tools":
                raise APIError(400, "tool_choice allowed_tools is not supported: send only the allowed functions as "
                                    "tools, with tool_choice auto or required", "tool_choice")
            name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
            if name is None:
                raise APIError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", "
                                    "\"function\": {\"name\": ...}}", "tool_choice")
            if name not in (f["name"] for f in functions):
                raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
            tool_choice = "named"
        elif tool_choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice must be none, auto, required or a named function, got {tool_choice!r}",
                           "tool_choice")
        return cls(tuple(functions), tool_choice, name, parallel is not False)

    def template_tools(self) -> list[dict]:
        """The tools as transformers hands them to a chat template."""
        return [{"type": "function", "function": f} for f in self.functions]

    def guide(self) -> StructuredOutputsParams | None:
        """What the reply must match for "required" and named choices; None for the others."""
        if self.choice == "named":
            return _guide(_parameters(self._function(self.name)))
        if self.choice != "required":
            return None
        items, defs = [], {}
        for i, f in enumerate(self.functions):
            params, own = _hoisted(_parameters(f), f"tool{i}_")
            defs.update(own)
            items.append({"type": "object", "properties": {"name": {"enum": [f["name"]]}, "parameters": params},
                          "required": ["name", "parameters"], "additionalProperties": False})
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return _guide(schema)

    def reply(self, parser_name: str, template: str | None) -> "ToolReply":
        """A choice's reader of calls (not for tool_choice none): the grammar's form, or the model's own
        format as `--tool-call-parser` reads it, given the chat template."""
        if self.choice == "named":
            parser = NamedParser(self.name)
        elif self.choice == "required":
            parser = RequiredParser()
        else:
            parser = choose_parser(parser_name, template)
        return ToolReply(parser, self.parallel)

    def _function(self, name: str) -> dict:
        return next(f for f in self.functions if f["name"] == name)


def _guide(schema: dict) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=json.dumps({"x-guidance": CALL_JSON, **schema}))  # (a schema's own wins)


def _parameters(f: dict) -> dict:
    """A function's parameter schema; with OpenAI's `strict`, objects closed to the properties they name."""
    params = f.get("parameters") or EMPTY_PARAMETERS
    return closed(params) if f.get("strict") else params


def _hoisted(schema: dict, prefix: str) -> tuple[dict, dict]:
    """The schema without its $defs (or definitions), and those renamed with `prefix`, its references to
    them rewritten: several tools' schemas become one, each definition under a name of its own."""
    defs = {prefix + k: v for key in ("$defs", "definitions") for k, v in (schema.get(key) or {}).items()}

    def rewrite(node):
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items()}
            ref = out.get("$ref")
            if isinstance(ref, str):
                for key in ("$defs", "definitions"):
                    if ref.startswith(f"#/{key}/"):
                        out["$ref"] = f"#/$defs/{prefix}{ref[len(key) + 3:]}"
            return out
        return [rewrite(v) for v in node] if isinstance(node, list) else node

    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    return rewrite(body), {k: rewrite(v) for k, v in defs.items()}


def template_messages(messages: list[dict], tools: Tools | None, template_reads_tools: bool
                      ) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools for the chat template: the model's own when it reads tools, else the
    conversation in the Hermes format (and no tools: the system message describes them)."""
    if template_reads_tools:
        return [_arguments_as_objects(m) for m in messages], tools.template_tools() if tools else None
    return hermes_messages(messages, tools), None


def _arguments_as_objects(message: dict) -> dict:
    """An assistant message whose tool calls' arguments (JSON text in OpenAI's API) are objects, as chat
    templates write them (`arguments | tojson`)."""
    if not message.get("tool_calls"):
        return message
    calls = [dict(c, function=dict(c["function"], arguments=_arguments(c))) for c in message["tool_calls"]]
    return dict(message, tool_calls=calls)


def _arguments(call: dict):
    args = call["function"].get("arguments")
    return json.loads(args) if isinstance(args, str) and args.strip() else (args or {})


def hermes_messages(messages: list[dict], tools: Tools | None) -> list[dict]:
    """The conversation in the Hermes format, for a template that renders only roles and text (above)."""
    out, results = [], False  # results: out[-1] holds tool results (as a user message)
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if results:  # consecutive results: one user message
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            results = True
            continue
        results = False
        text = m["content"]
        for call in m.get("tool_calls") or []:
            block = json.dumps({"name": call["function"]["name"], "arguments": _arguments(call)}, ensure_ascii=False)
            text += f"{chr(10) if text else ''}<tool_call>\n{block}\n</tool_call>"
        out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")} | {"content": text})
    if tools:
        prompt = DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False)
                                                           for t in tools.template_tools()))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt)
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


class ToolReply:
    """A reply's content and tool calls, from its whole text (`message`) or as it streams (`delta`: what
    is new since the previous call, OpenAI's delta of content and tool_calls). Without parallel tool calls
    only the first call is kept."""

    def __init__(self, parser, parallel: bool):
        self.parser, self.parallel = parser, parallel
        self.text, self.content_sent, self.calls_sent = "", 0, []  # calls_sent: (id, arguments sent)

    def _parse(self, text: str, final: bool):
        parsed = self.parser.parse(text, final)
        return parsed.content, parsed.calls if self.parallel else parsed.calls[:1]

    def message(self, text: str) -> dict:
        content, calls = self._parse(text, True)
        if not calls:
            return {"role": "assistant", "content": content}
        return {"role": "assistant", "content": content or None,
                "tool_calls": [_call(_call_id(), name, args) for name, args in calls]}

    def delta(self, text: str, final: bool) -> dict:
        self.text += text
        content, calls = self._parse(self.text, final)
        out = {}
        if len(content) > self.content_sent:
            out["content"] = content[self.content_sent:]
            self.content_sent = len(content)
        deltas = []
        for i, (name, args) in enumerate(calls):
            if i == len(self.calls_sent):
                self.calls_sent.append((_call_id(), 0))
                deltas.append(dict(_call(self.calls_sent[i][0], name, ""), index=i))
            call_id, sent = self.calls_sent[i]
            if len(args) > sent:
                if deltas and deltas[-1]["index"] == i:
                    deltas[-1]["function"]["arguments"] = args[sent:]
                else:
                    deltas.append({"index": i, "function": {"arguments": args[sent:]}})
                self.calls_sent[i] = (call_id, len(args))
        if deltas:
            out["tool_calls"] = deltas
        return out

    @property
    def called(self) -> bool:
        """Whether the stream has sent a tool call."""
        return bool(self.calls_sent)


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
