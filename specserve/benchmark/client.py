"""Streaming client for OpenAI-compatible servers: times every streamed chunk of one request.

A failed request (HTTP error, broken stream, timeout, error object in the stream) is recorded on its
result and never raised: one bad request must not end a benchmark run.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

ENDPOINTS = {"completions": "/completions", "chat": "/chat/completions"}
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def api_root(base_url: str) -> str:
    """`http://h:8000` and `http://h:8000/v1` both name the server; the API lives under /v1."""
    url = base_url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def server_root(base_url: str) -> str:
    """Where /metrics lives: the API root without /v1."""
    return api_root(base_url)[: -len("/v1")]


def make_http_client(base_url: str, timeout_s: float) -> httpx.AsyncClient:
    # No connection limit: a pooled request waiting for a free connection would count pool time as TTFT.
    # Proxies from the environment are skipped for loopback servers, which a proxy cannot reach.
    host = urlsplit(base_url).hostname or ""
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=min(30.0, timeout_s)),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                             trust_env=host not in _LOOPBACK)


@dataclass
class RequestResult:
    id: int
    arrival_s: float                      # scheduled arrival, from the run's start
    measured: bool = True                 # False for requests in the discarded transient
    target_prompt_tokens: int | None = None
    est_prompt_tokens: int | None = None  # our own count of the prompt sent
    max_tokens: int = 0
    sent_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)   # arrival time of every non-empty chunk
    prompt_tokens: int | None = None      # from the server's usage when it sends one
    output_tokens: int | None = None
    output_tokens_source: str = "usage"   # "usage" or "chunks" (one token per chunk assumed)
    spec: dict | None = None              # the server's per-response `speculative` stats
    error: str | None = None
    turn: int | None = None               # multi-turn runs: the turn's index in its conversation (0 first)
    text: str | None = None               # the streamed text, kept when this starts as "" (not None)

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token_s is not None and self.end_s is not None

    @property
    def done(self) -> bool:
        return self.sent_s is not None and self.end_s is not None

    @property
    def ttft_s(self) -> float | None:
        return self.first_token_s - self.sent_s if self.ok else None

    @property
    def e2e_s(self) -> float | None:
        return self.end_s - self.sent_s if self.ok else None

    @property
    def itl_s(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])] if self.ok else []


def _chunk_text(choice: dict, chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    # Reasoning models stream their thoughts in a separate field; those are generated tokens too.
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""


class StreamingClient:
    def __init__(self, http: httpx.AsyncClient, base_url: str, model: str, endpoint: str = "completions",
                 api_key: str | None = None, ignore_eos: bool = True, temperature: float = 0.0,
                 extra_body: dict | None = None, timeout_s: float = 600.0) -> None:
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {list(ENDPOINTS)}")
        self.http = http
        self.url = api_root(base_url) + ENDPOINTS[endpoint]
        self.chat = endpoint == "chat"
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.ignore_eos = ignore_eos
        self.temperature = temperature
        self.extra_body = extra_body or {}
        self.timeout_s = timeout_s

    def body(self, prompt: str, max_tokens: int, messages: list[dict] | None = None, session: str | None = None
             ) -> dict:
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": self.temperature,
                "stream": True, "stream_options": {"include_usage": True}}
        if self.chat:
            body["messages"] = messages or [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if self.ignore_eos:
            # vLLM, SGLang, llama.cpp and specserve all accept this extension; it forces max_tokens tokens.
            body["ignore_eos"] = True
        if session is not None:
            # OpenAI's end-user field: every server accepts it, and a session-affine router (ours reads
            # `session_id`, then `user`) keeps a conversation on the replica that holds its prefix.
            body["user"] = session
        body.update(self.extra_body)
        return body

    async def send(self, result: RequestResult, prompt: str, clock, messages: list[dict] | None = None,
                   session: str | None = None) -> RequestResult:
        """Stream one request; `clock()` gives seconds since the run's start. Fills in `result`. `messages`:
        a whole chat history to send instead of `prompt` (chat endpoint); `session`: the conversation it
        belongs to (sent as `user`)."""
        body = self.body(prompt, result.max_tokens, messages, session)
        result.sent_s = clock()
        try:
            # httpx's timeout bounds each read; this bounds the whole request, so a stalled server
            # cannot hold a run open forever.
            await asyncio.wait_for(self._post(body, result, clock), self.timeout_s)
        except asyncio.TimeoutError:
            result.error = f"timed out after {self.timeout_s:g}s"
        except httpx.HTTPError as e:
            result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        except Exception as e:  # a malformed stream is the server's failure, not the run's
            result.error = f"{type(e).__name__}: {e}"
        if result.end_s is None:   # failed: still record when it left the system, for in-flight counts
            result.end_s = clock()
        if result.error is None:
            if result.first_token_s is None:
                result.error = "stream ended without any generated text"
            elif result.output_tokens is None:
                result.output_tokens = len(result.chunk_times)
                result.output_tokens_source = "chunks"
        return result

    async def _post(self, body: dict, result: RequestResult, clock) -> None:
        async with self.http.stream("POST", self.url, json=body, headers=self.headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {resp.status_code}: {_error_message(text)}"
            else:
                await self._read_stream(resp, result, clock)

    async def _read_stream(self, resp: httpx.Response, result: RequestResult, clock) -> None:
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue   # SSE comments, event names and the blank separators
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            now = clock()
            chunk = json.loads(payload)
            if chunk.get("error"):
                result.error = f"stream error: {_error_message(json.dumps(chunk))}"
                return
            for choice in chunk.get("choices") or []:
                if text := _chunk_text(choice, self.chat):
                    if result.first_token_s is None:
                        result.first_token_s = now
                    result.chunk_times.append(now)
                    if result.text is not None:
                        result.text += text
                    break
            usage = chunk.get("usage")
            if usage:
                result.prompt_tokens = usage.get("prompt_tokens")
                result.output_tokens = usage.get("completion_tokens")
            if chunk.get("speculative"):
                result.spec = chunk["speculative"]
            elif (chunk.get("timings") or {}).get("draft_n") is not None:
                # llama-server's last chunk: tokens drafted and accepted for this response, but not how
                # many drafts (verify steps) they came in; /metrics has that (summary._spec).
                t = chunk["timings"]
                result.spec = {"num_draft_tokens": int(t["draft_n"]),
                               "num_accepted_tokens": int(t.get("draft_n_accepted") or 0)}
        result.end_s = clock()


def _error_message(text: str) -> str:
    """The message of an OpenAI-shaped error body, or the body itself (shortened)."""
    try:
        err = json.loads(text)
        err = err.get("error", err) if isinstance(err, dict) else err
        msg = err.get("message", err) if isinstance(err, dict) else err
        return str(msg)[:300]
    except (json.JSONDecodeError, AttributeError):
        return text.strip()[:300]


async def list_models(http: httpx.AsyncClient, base_url: str, api_key: str | None = None) -> list[dict]:
    """The server's /v1/models entries; empty when the server does not answer it."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = await http.get(api_root(base_url) + "/models", headers=headers)
        return resp.json().get("data", []) if resp.status_code == 200 else []
    except (httpx.HTTPError, ValueError, AttributeError):
        return []


def monotonic_clock():
    """A clock reading seconds since this call (perf_counter: monotonic and high resolution)."""
    t0 = time.perf_counter()
    return lambda: time.perf_counter() - t0
