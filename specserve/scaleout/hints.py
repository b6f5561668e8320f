"""What the router learns about a request before sending it: a key, its lengths and its chat session.

The ingress reads these from the JSON body without a tokenizer (it loads no model): the prompt's size in
characters, which each replica converts to tokens with its own tokenizer's characters per token, or its
token count where the prompt is token ids. They travel as the first argument of every replica call,
where Ray's request router can read them (`PendingRequest.args[0]`).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, replace

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# server/protocol.py COMPLETION_DEFAULT_MAX_TOKENS, not imported: that module pulls in torch, the ingress must not.
COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class RouteHints:
    key: str
    prompt_chars: int = 0
    prompt_ids: int = 0  # prompt tokens given as ids (completions with a token-id prompt)
    output_tokens: int | None = None  # max_tokens; None: the replica's fitted reference length
    session: str | None = None
    pin: str | None = None  # send to exactly this replica (fan-out of /health and /metrics)
    avoid: tuple[str, ...] = ()  # replicas that already failed this request

    def retry(self, failed: str | None) -> "RouteHints":
        return self if failed is None else replace(self, avoid=self.avoid + (failed,))

    def prompt_tokens(self, chars_per_token: float) -> float:
        return self.prompt_ids + self.prompt_chars / max(chars_per_token, 1e-6)


def new_key() -> str:
    return uuid.uuid4().hex


def pinned(replica: str) -> RouteHints:
    return RouteHints(key=new_key(), pin=replica)


def _text_size(content) -> tuple[int, int]:
    """(characters, token ids) of a prompt or message content in any OpenAI form."""
    if isinstance(content, str):
        return len(content), 0
    if isinstance(content, list):
        if content and all(isinstance(t, int) for t in content):
            return 0, len(content)
        chars = ids = 0
        for part in content:
            if isinstance(part, dict):  # chat content parts: {"type": "text", "text": ...}
                c, i = _text_size(part.get("text", ""))
            else:
                c, i = _text_size(part)
            chars, ids = chars + c, ids + i
        return chars, ids
    return 0, 0


def hints_from_body(path: str, body: bytes, session_fields: tuple[str, ...]) -> RouteHints:
    """Hints for a generation request; a body that is not a JSON object gets bare hints (the replica
    answers it with the proper 400)."""
    key = new_key()
    if path not in GENERATION_PATHS:
        return RouteHints(key)
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return RouteHints(key)
    if not isinstance(req, dict):
        return RouteHints(key)
    if path.endswith("/chat/completions"):
        messages = req.get("messages") if isinstance(req.get("messages"), list) else []
        sizes = [_text_size(m.get("content")) for m in messages if isinstance(m, dict)]
        chars, ids = sum(s[0] for s in sizes), sum(s[1] for s in sizes)
        out = req.get("max_completion_tokens", req.get("max_tokens"))
    else:
        chars, ids = _text_size(req.get("prompt", ""))
        out = req.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
    session = next((str(req[f]) for f in session_fields if req.get(f) not in (None, "")), None)
    return RouteHints(key, chars, ids, out if isinstance(out, int) and out > 0 else None, session)
