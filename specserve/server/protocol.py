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
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from specserve.engine.sampling_params import MAX_REPETITION_PENALTY, MAX_TOP_LOGPROBS, SamplingParams
from specserve.seeding import SEED_MAX, SEED_MIN
from specserve.structured_output import StructuredOutputsParams, closed
from specserve.errors import InvalidRequestError
from specserve.server.errors import APIError

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for the legacy completions API
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_N = 16  # choices per request: each is a request of its own in the engine
MAX_STOP_STRINGS = 64  # each is searched for after every token: a long list would slow every step
CHAT_ROLES = ("system", "developer", "user", "assistant")

_SURROGATE = re.compile("[\ud800-\udfff]")


def _first(*values):
    return next(v for v in values if v is not None)


def _unset(value) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ""


# Fields of OpenAI's or vLLM's APIs that change the output and that this server does not implement, with
# the values that are harmless (they ask for the default behaviour). Others are refused with a 400.
_COMMON_UNSUPPORTED = {
    "min_p": lambda v: _unset(v) or v == 0, "typical_p": lambda v: _unset(v) or v == 1,
    "length_penalty": lambda v: _unset(v) or v == 1, "use_beam_search": _unset,
    "allowed_token_ids": _unset, "bad_words": _unset, "include_stop_str_in_output": _unset,
    "truncate_prompt_tokens": _unset, "logits_processors": _unset,
}
UNSUPPORTED_FIELDS = {
    "completions": _COMMON_UNSUPPORTED,
    "chat": dict(_COMMON_UNSUPPORTED,
                 functions=_unset,  # the legacy form of tools
                 function_call=lambda v: _unset(v) or v in ("none", "auto"),
                 tool_choice=lambda v: _unset(v) or v in ("none", "auto"),
                 audio=_unset, modalities=lambda v: _unset(v) or v == ["text"], web_search_options=_unset,
                 echo=_unset, continue_final_message=_unset, chat_template=_unset, chat_template_kwargs=_unset,
                 documents=_unset),
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


class _SamplingRequest(_Open):
    _api = "completions"  # which UNSUPPORTED_FIELDS apply
    _structured_field: str | None = None  # the field that set the structured output (for error messages)

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
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions (the benchmark client sends ignore_eos)
    top_k: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = True
    repetition_penalty: float | None = Field(None, gt=0, le=MAX_REPETITION_PENALTY)
    cache_salt: str | None = Field(None, min_length=1)  # only requests with the same salt share cached prefixes
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM's: each prompt token's log-probability
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

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        where = _find_surrogate(data, "")
        if where is not None:
            raise PydanticCustomError("lone_surrogate", "text holds a lone UTF-16 surrogate (such as \\ud800), "
                                      "which is not valid Unicode", {"where": where})
        return data

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {self.n}", "n")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}", "stop")
        harmless = UNSUPPORTED_FIELDS[self._api]
        for name, value in (self.model_extra or {}).items():
            if name in harmless and not harmless[name](value):
                raise APIError(400, f"{name} is not supported by this server (omit it, or send its default)", name)

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
            structured_outputs=self.structured_output(), prompt_logprobs=self.prompt_logprobs)

    @property
    def structured_field(self) -> str | None:
        """The field that set the request's structured output (after sampling_params), for error messages."""
        return self._structured_field

    def structured_output(self) -> StructuredOutputsParams | None:
        """What the output must match, from whichever of the structured-output fields the request sets (at most
        one); raises APIError (a 400) naming the field for a malformed one."""
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
        self._structured_field = name
        try:
            return StructuredOutputsParams(**fields)
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

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported (OpenAI and vLLM deprecated it): send n for several "
                                "choices and pick among them", "best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}", "logprobs")

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1:
                raise APIError(400, f"got {len(p)} prompts; this server takes one prompt per request", "prompt")
            p = p[0]
        if not p:
            raise APIError(400, "the prompt is empty", "prompt")
        return p

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
    add_generation_prompt: bool | None = True  # vLLM's extension

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
                           "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if self.tools:
            raise APIError(400, "tools are not supported", "tools")
        if not self.messages:
            raise APIError(400, "messages must not be empty", "messages")
        for i, m in enumerate(self.messages):
            if m.role in ("tool", "function"):
                raise APIError(400, f"messages with role {m.role!r} are not supported: this server has no tool "
                                    "calling", f"messages.{i}.role")
            if m.role not in CHAT_ROLES:
                raise APIError(400, f"unknown role {m.role!r}; expected one of {', '.join(CHAT_ROLES)}",
                               f"messages.{i}.role")
            for name in ("tool_calls", "function_call"):
                if not _unset((m.model_extra or {}).get(name)):
                    raise APIError(400, f"{name} in messages is not supported: this server has no tool calling",
                                   f"messages.{i}.{name}")

    def template_messages(self) -> list[dict]:
        return [m.as_template_input() for m in self.messages]

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
