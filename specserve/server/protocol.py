"""Request bodies of the OpenAI API (plus vLLM's sampling extensions) and their mapping to SamplingParams.

Unknown fields are accepted and ignored, as the official client and others send fields we have no use
for (user, metadata, store, ...). Fields that would change the output and that we cannot honour are
refused with a 400 naming the field, instead of being silently ignored: our own fields' unsupported
values, and the known fields of OpenAI's and vLLM's APIs listed in UNSUPPORTED_FIELDS. Numbers are held
to what the engine can represent (a 64-bit seed, OpenAI's temperature range), and text must be valid
Unicode: a lone surrogate (JSON allows "\\ud800") cannot be tokenized and is refused with a 400.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from specserve.engine.sampling_params import MAX_REPETITION_PENALTY, MAX_TOP_LOGPROBS, SamplingParams
from specserve.seeding import SEED_MAX, SEED_MIN
from specserve.structured_output.params import StructuredOutputsParams, closed
from specserve.errors import InvalidRequestError
from specserve.server.errors import APIError
from specserve.server.tools import Tools

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for the legacy completions API
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_N = 16  # choices per request: each is a request of its own in the engine
MAX_STOP_STRINGS = 64  # each is searched for after every token: a long list would slow every step
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# chat_template_kwargs that would replace what the server hands the template itself
_TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt")

_SURROGATE = re.compile("[\ud800-\udfff]")


def _first(*values):
    return next(v for v in values if v is not None)


def _unset(value) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ""


# Fields of OpenAI's or vLLM's APIs that change the output and that this server does not implement: the values
# that are harmless (they ask for the default behaviour), and what to do instead. Others are refused with a 400.
_COMMON_UNSUPPORTED = {
    "min_p": (lambda v: _unset(v) or v == 0, "use top_p or top_k"),
    "typical_p": (lambda v: _unset(v) or v == 1, "use top_p or top_k"),
    "length_penalty": (lambda v: _unset(v) or v == 1, "there is no beam search; sample n choices instead"),
    "use_beam_search": (_unset, "there is no beam search; sample n choices instead"),
    "logit_bias": (_unset, "restrict the output with structured_outputs (a choice, regex or grammar) instead"),
    "allowed_token_ids": (_unset, "restrict the output with structured_outputs (a choice, regex or grammar)"),
    "bad_words": (_unset, "restrict the output with structured_outputs (a regex or grammar)"),
    "truncate_prompt_tokens": (_unset, "shorten the prompt yourself (POST /tokenize counts its tokens)"),
    "logits_processors": (_unset, "this server runs no custom logits processors"),
    "priority": (lambda v: _unset(v) or v == 0, "send slo_ttft_ms: the scheduler admits by time-to-first-token "
                                                 "deadline"),
    "spaces_between_special_tokens": (lambda v: v is None or v is True, "omit it"),
    "guided_whitespace_pattern": (_unset, "omit it: JSON whitespace is a space or a newline and up to 20 "
                                          "spaces of indentation"),
    "structural_tag": (_unset, "send structured_outputs.grammar (a Lark grammar) instead"),
    "moderation": (_unset, "this server does not moderate; omit it"),
}
UNSUPPORTED_FIELDS = {
    "completions": dict(_COMMON_UNSUPPORTED,
                        prompt_embeds=(_unset, "send the prompt as text or token ids")),
    "chat": dict(_COMMON_UNSUPPORTED,
                 functions=(_unset, "send tools instead: each function as {\"type\": \"function\", "
                                    "\"function\": {...}}"),
                 function_call=(lambda v: _unset(v) or v in ("none", "auto"), "send tool_choice instead"),
                 audio=(_unset, "this server generates text only"),
                 modalities=(lambda v: _unset(v) or v == ["text"], "this server generates text only"),
                 web_search_options=(_unset, "this server does not search the web; give the model a search "
                                             "function in tools"),
                 echo=(_unset, "use /v1/completions with echo"),
                 chat_template=(_unset, "per-request templates are refused (as vLLM refuses them by default): "
                                        "the model's own template renders the messages"),
                 documents=(_unset, "put the documents in a message's content")),
}


def _find_surrogate(value, path: str) -> str | None:
    """The path of the first string (or key) in a JSON value holding a lone surrogate, else None."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            where = f"{path}.{k}" if path else str(k)
            if isinstance(k, str) and _SURROGATE.search(k):
                return path or "body"
            found = _find_surrogate(v, where)
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _find_surrogate(v, f"{path}.{i}")
            if found:
                return found
    return None


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request that omits a field gets instead of the server's own default (None: no change), e.g.
    the model's generation_config.json (server/generation_config.py finds them)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None  # max_new_tokens: caps the limit of a request that sets none
    repetition_penalty: float | None = None

    def check(self) -> None:
        """Raises InvalidRequestError for a value no request could send."""
        if self.temperature is not None and not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequestError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        for name in ("top_k", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
        SamplingParams(max_tokens=_first(self.max_tokens, 1), temperature=_first(self.temperature, 0),
                       top_p=_first(self.top_p, 1.0), top_k=_first(self.top_k, -1),
                       repetition_penalty=_first(self.repetition_penalty, 1.0))

    def limit(self, api_default: int) -> int:
        return api_default if self.max_tokens is None else min(api_default, self.max_tokens)


SERVER_DEFAULTS = SamplingDefaults()


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    include_usage: bool | None = False


class ContentPart(_Open):
    type: str
    text: str | None = None


class ChatMessage(_Open):
    role: str
    content: str | list[ContentPart] | None = None

    def check(self, i: int) -> None:
        """Raises APIError (400) for a message this server cannot render."""
        if self.role == "function":
            raise APIError(400, "messages with role 'function' (the legacy form) are not supported: send a "
                                "message with role 'tool' and the call's tool_call_id", f"messages.{i}.role")
        if self.role not in CHAT_ROLES:
            raise APIError(400, f"unknown role {self.role!r}; expected one of {', '.join(CHAT_ROLES)}",
                           f"messages.{i}.role")
        extra = self.model_extra or {}
        if not _unset(extra.get("function_call")):
            raise APIError(400, "function_call in messages (the legacy form) is not supported: send tool_calls",
                           f"messages.{i}.function_call")
        calls = extra.get("tool_calls")
        if _unset(calls):
            return
        if self.role != "assistant" or not isinstance(calls, list):
            raise APIError(400, "tool_calls belong in assistant messages, as a list", f"messages.{i}.tool_calls")
        for j, call in enumerate(calls):
            f = call.get("function") if isinstance(call, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not _json_object(f.get("arguments")):
                raise APIError(400, "a tool call is {\"id\", \"type\": \"function\", \"function\": {\"name\", "
                                    "\"arguments\": the text of a JSON object}}", f"messages.{i}.tool_calls.{j}")

    def as_template_input(self) -> dict:
        """The message as a chat template expects it: text content as one string."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"content parts of type {part.type!r} are not supported; send text",
                                   "messages")
                texts.append(part.text)
            content = "\n".join(texts)
        out = {k: v for k, v in (self.model_extra or {}).items() if v is not None}
        out.update(role=self.role, content=content or "")
        return out


def check_messages(messages: list[ChatMessage], add_generation_prompt: bool | None,
                   continue_final_message: bool | None, template_kwargs: dict | None) -> None:
    """Raises APIError (400) for a conversation this server cannot render as asked."""
    for name in _TEMPLATE_VARIABLES:
        if name in (template_kwargs or {}):
            raise APIError(400, f"chat_template_kwargs may not set {name!r}: send the request's own field",
                           "chat_template_kwargs")
    if not messages:
        raise APIError(400, "messages must not be empty", "messages")
    for i, m in enumerate(messages):
        m.check(i)
    if continue_final_message:
        if add_generation_prompt is not False:
            raise APIError(400, "continue_final_message needs add_generation_prompt: false (the reply continues the "
                                "last message instead of starting a new one)", "continue_final_message")
        if messages[-1].role != "assistant":
            raise APIError(400, "continue_final_message continues the last message, which must be the "
                                "assistant's", "continue_final_message")


def _json_object(arguments) -> bool:
    """Whether a tool call's arguments are a JSON object's text (or empty: no arguments)."""
    if arguments in (None, ""):
        return True
    try:
        return isinstance(arguments, str) and isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


class _Body(_Open):
    """A request body: its text must be valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        where = _find_surrogate(data, "")
        if where is not None:
            raise PydanticCustomError("lone_surrogate", "text holds a lone UTF-16 surrogate (such as \\ud800), "
                                      "which is not valid Unicode", {"where": where})
        return data


class Guided(NamedTuple):
    """A request's structured output, and the request field that set it (which a 400 for its grammar names)."""
    field: str
    params: StructuredOutputsParams


class _SamplingRequest(_Body):
    _api = "completions"  # which UNSUPPORTED_FIELDS apply

    model: str | None = None          # omitted: the served model
    max_tokens: int | None = None
    temperature: float | None = Field(None, le=MAX_TEMPERATURE)
    top_p: float | None = None
    n: int | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    # vLLM's extensions (the benchmark client sends ignore_eos)
    top_k: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = True
    repetition_penalty: float | None = Field(None, gt=0, le=MAX_REPETITION_PENALTY)
    cache_salt: str | None = Field(None, min_length=1)  # only requests with the same salt share cached prefixes
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM's: each prompt token's log-probability
    include_stop_str_in_output: bool | None = False  # vLLM's: the stop string that ended the output, kept
    return_tokens_as_token_ids: bool | None = False  # vLLM's: logprobs name tokens as "token_id:{id}"
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # specserve's extensions: this request's objectives in milliseconds (docs/design.md §3.5)
    slo_tpot_ms: float | None = None
    slo_ttft_ms: float | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}", "stop")
        if self.stream_options is not None and (self.stream_options.model_extra or {}).get("continuous_usage_stats"):
            raise APIError(400, "stream_options.continuous_usage_stats is not supported: with include_usage the "
                                "usage comes in the last chunk", "stream_options")
        unsupported = UNSUPPORTED_FIELDS[self._api]
        for name, value in (self.model_extra or {}).items():
            if name in unsupported and not unsupported[name][0](value):
                raise APIError(400, f"{name} is not supported by this server: {unsupported[name][1]}", name)

    def sampling_params(self, max_tokens: int, logprobs: bool, defaults: SamplingDefaults,
                        top_logprobs: int = 0) -> SamplingParams:
        """Raises InvalidRequestError (a 400) for values out of range. A field the request omits takes
        `defaults`' value, else the server's own (OpenAI's)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_first(self.temperature, defaults.temperature, 1.0),
            top_p=_first(self.top_p, defaults.top_p, 1.0),
            top_k=_first(self.top_k, defaults.top_k, -1),
            seed=self.seed, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
            ignore_eos=bool(self.ignore_eos), min_tokens=self.min_tokens or 0, logprobs=logprobs,
            top_logprobs=top_logprobs, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=_first(self.repetition_penalty, defaults.repetition_penalty, 1.0),
            skip_special_tokens=self.skip_special_tokens is not False,
            slo_tpot=None if self.slo_tpot_ms is None else self.slo_tpot_ms / 1000,
            slo_ttft=None if self.slo_ttft_ms is None else self.slo_ttft_ms / 1000, cache_salt=self.cache_salt,
            structured_outputs=guided.params if (guided := self.structured_output()) else None,
            prompt_logprobs=self.prompt_logprobs)

    def structured_output(self) -> Guided | None:
        """What the output must match, from whichever of the structured-output fields the request sets (at most
        one), with that field's name; raises APIError (a 400) naming the field for a malformed one."""
        given = {}
        if (fmt := self.response_format) is not None and fmt.get("type", "text") != "text":
            given["response_format"] = _response_format(fmt)
        if self.structured_outputs:
            fields = {k: v for k, v in self.structured_outputs.items() if v is not None and v is not False}
            unknown = set(fields) - {"json", "json_object", "regex", "choice", "grammar"}
            if unknown:
                raise APIError(400, f"unknown structured_outputs field {sorted(unknown)[0]!r}; expected json, "
                                    "json_object, regex, choice or grammar", "structured_outputs")
            if "json" in fields:
                fields["json"] = _schema_text(fields["json"], "structured_outputs.json")
            if "choice" in fields:
                fields["choice"] = tuple(fields["choice"]) if isinstance(fields["choice"], list) else fields["choice"]
            given["structured_outputs"] = fields
        legacy = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
        for name, key in legacy.items():
            value = getattr(self, name)
            if value is not None:
                value = _schema_text(value, name) if key == "json" else value
                given[name] = {key: tuple(value) if key == "choice" else value}
        if len(given) > 1:
            raise APIError(400, f"send one of {' and '.join(given)}: each sets what the output must match",
                           list(given)[1])
        if not given:
            return None
        (name, fields), = given.items()
        try:
            return Guided(name, StructuredOutputsParams(**fields))
        except (InvalidRequestError, TypeError) as e:
            raise APIError(400, str(e) if isinstance(e, InvalidRequestError) else f"malformed {name}", name) from None


def _schema_text(schema, where: str) -> str:
    """A JSON schema as its text (a request may send the object or its serialization)."""
    if isinstance(schema, dict):
        return json.dumps(schema)
    if isinstance(schema, str):
        try:
            if isinstance(json.loads(schema), dict):
                return schema
        except ValueError:
            pass
    raise APIError(400, f"{where} must be a JSON schema (an object, or its serialization)", where)


def _response_format(fmt: dict) -> dict:
    """OpenAI's response_format as structured-output fields: json_object, or json_schema's schema."""
    kind = fmt.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise APIError(400, "response_format of type json_schema needs json_schema.schema", "response_format")
        schema = _schema_text(spec["schema"], "response_format.json_schema.schema")
        # strict (OpenAI's Structured Outputs): objects hold exactly the properties the schema names
        return {"json": json.dumps(closed(json.loads(schema))) if spec.get("strict") else schema}
    raise APIError(400, f"response_format type must be text, json_object or json_schema, got {kind!r}",
                   "response_format")


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool | None = True  # vLLM's: the tokenizer's BOS (and the like) before a text prompt

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise APIError(400, "suffix (fill-in-the-middle) is not supported: write the prompt in the model's "
                                "own fill-in-the-middle format instead", "suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported (OpenAI and vLLM deprecated it): send n for several "
                                "choices and pick among them", "best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}", "logprobs")

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one text or token-id list, or a list of them (choices i*n to i*n + n - 1 are prompt i's,
        as OpenAI numbers them)."""
        p = self.prompt
        prompts = list(p) if isinstance(p, list) and p and not isinstance(p[0], int) else [p]
        for i, q in enumerate(prompts):
            if not q:
                raise APIError(400, "the prompt is empty" if len(prompts) == 1 else f"prompt {i} is empty", "prompt")
        return prompts

    def to_sampling_params(self, defaults: SamplingDefaults = SERVER_DEFAULTS) -> SamplingParams:
        max_tokens = defaults.limit(COMPLETION_DEFAULT_MAX_TOKENS) if self.max_tokens is None else self.max_tokens
        params = self.sampling_params(max_tokens, self.logprobs is not None, defaults, self.logprobs or 0)
        if self.echo and self.logprobs is not None:  # the echoed prompt's tokens carry logprobs too
            params.prompt_logprobs = max(self.logprobs, params.prompt_logprobs or 0)
        return params


class ChatCompletionRequest(_SamplingRequest):
    _api = "chat"

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None  # reaches the chat template, as in vLLM (templates that read it)
    # vLLM's extensions
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = False  # the template writes BOS and the like itself
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
                           "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        check_messages(self.messages, self.add_generation_prompt, self.continue_final_message,
                       self.chat_template_kwargs)
        self.tool_spec  # raises APIError (a 400) for tools the API refuses

    @property
    def tool_spec(self) -> Tools | None:
        """The request's tools and tool choice; raises APIError (a 400) for what the API refuses."""
        return Tools.from_request(self.tools, self.tool_choice, self.parallel_tool_calls)

    def template_kwargs(self) -> dict:
        """What the chat template gets besides the messages and tools."""
        extra = {"reasoning_effort": self.reasoning_effort} if self.reasoning_effort is not None else {}
        return {**extra, **(self.chat_template_kwargs or {})}

    def structured_output(self) -> Guided | None:
        """The request's own structured output, or for tool_choice "required" or a named function the grammar
        of its tool calls (the two cannot be combined)."""
        own = super().structured_output()
        tools = self.tool_spec
        guide = tools.guide() if tools is not None else None
        if guide is None:
            return own
        if own is not None:
            raise APIError(400, f"{own.field} cannot be combined with tool_choice "
                                f"{tools.choice!r}: the tool call's arguments follow the function's schema",
                           "tool_choice")
        return Guided("tools", guide)

    def to_sampling_params(self, prompt_len: int, max_model_len: int,
                           defaults: SamplingDefaults = SERVER_DEFAULTS) -> SamplingParams:
        """Without a limit a chat reply may use the rest of the context, as in OpenAI's API and vLLM."""
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if limit is None:
            if prompt_len >= max_model_len:
                raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, "
                                    f"your messages resulted in {prompt_len} tokens. Please reduce the length "
                                    "of the messages.", "messages")
            limit = defaults.limit(max_model_len - prompt_len)
        return self.sampling_params(limit, bool(self.logprobs), defaults, self.top_logprobs or 0)


class TokenizeRequest(_Body):
    """vLLM's POST /tokenize: a prompt, or chat messages (with their tools) as the chat template renders them."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (as the APIs do)
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "send either prompt or messages", "prompt")
        if self.messages is not None:
            check_messages(self.messages, self.add_generation_prompt, self.continue_final_message,
                           self.chat_template_kwargs)


class DetokenizeRequest(_Body):
    """vLLM's POST /detokenize."""
    model: str | None = None
    tokens: list[int]
