"""Limits that keep one request from costing the server more than it may: body size, body read time,
and a prompt-length bound that refuses a hopeless prompt before tokenizing it.

Tokenizing holds the event loop if done on it (a 2.6 MB prompt took 4 s with SmolLM2's tokenizer), so
prompts are tokenized in a worker thread (`Tokenizer.encode` lets go of the GIL meanwhile). Before
that, `PromptBound` answers the cheap question: can this text possibly fit? Each token of a lossless
tokenizer covers at most `max_chars_per_token` characters of the input (its longest vocabulary entry),
so a text of n characters has at least n // max_chars_per_token tokens; when that alone exceeds the
context, the request is refused at once.
"""
from __future__ import annotations

import asyncio
import json
import time

from specserve.errors import InvalidRequestError

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # 4 MiB: ~100x the JSON of a 4,096-token prompt of plain text
DEFAULT_TIMEOUT_READ_S = 15.0

# Pre-tokenizers and normalizers that keep every character of the input (they split, map bytes to
# symbols, or insert): with them each input character ends up inside some token.
_LOSSLESS_PRE = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "Sequence", "UnicodeScripts"}
_LOSSLESS_NORMALIZERS = {"Prepend", "Replace", "Sequence"}


def _lossless_part(part, allowed: set[str]) -> bool:
    if part is None:
        return True
    kind = part.get("type")
    if kind not in allowed or str(part.get("behavior", "")).lower() == "removed":
        return False
    if kind == "Replace":  # a literal that grows or keeps its length; a regex pattern may delete anything
        pattern, content = part.get("pattern", {}), part.get("content", "")
        if "String" not in pattern or len(content) < len(pattern["String"]):
            return False
    children = part.get("pretokenizers") or part.get("normalizers") or []
    return all(_lossless_part(c, allowed) for c in children)


def max_chars_per_token(hf_tokenizer) -> int | None:
    """The most input characters one token can stand for, or None where that is not bounded (a
    normalizer or pre-tokenizer that may drop text, a model that may drop unknown characters)."""
    try:
        spec = json.loads(hf_tokenizer.to_str())
    except Exception:
        return None
    model = spec.get("model") or {}
    pre = spec.get("pre_tokenizer")
    byte_level = "ByteLevel" in json.dumps(pre)
    if model.get("type") != "BPE" or not (byte_level or model.get("byte_fallback")):
        return None  # unknown characters might be dropped or fused into one token
    if not (_lossless_part(spec.get("normalizer"), _LOSSLESS_NORMALIZERS) and _lossless_part(pre, _LOSSLESS_PRE)):
        return None
    # Vocabulary entries are written in the pre-tokenizer's alphabet: one symbol per byte (ByteLevel) or per
    # character, so an entry's length bounds the characters it covers. Added tokens match their content.
    return max(len(t) for t in hf_tokenizer.get_vocab(with_added_tokens=True)) or None


class PromptBound:
    def __init__(self, hf_tokenizer, max_model_len: int):
        self.chars_per_token = max_chars_per_token(hf_tokenizer)
        self.max_model_len = max_model_len

    def min_tokens(self, text: str) -> int:
        return len(text) // self.chars_per_token if self.chars_per_token else 0

    def check(self, text: str, max_tokens: int | None, what: str) -> None:
        """InvalidRequestError when `text` (a prompt, or a rendered chat) cannot fit with `max_tokens` more
        (None: a chat reply without a limit, which needs at least one token)."""
        if not self.chars_per_token or len(text) // self.chars_per_token + (max_tokens or 1) <= self.max_model_len:
            return
        least = self.min_tokens(text)
        asked = f", {max_tokens} for the completion" if max_tokens is not None else ""
        raise InvalidRequestError(
            f"This model's maximum context length is {self.max_model_len} tokens. However, your {what} "
            f"alone is at least {least} tokens long ({len(text)} characters{asked}). Please reduce the length "
            f"of the {what}" + (" or max_tokens." if max_tokens is not None else "."))


async def encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """`tokenizer.encode` in a worker thread (it releases the GIL while the tokenizer works)."""
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens)


class BodyTooLarge(Exception):
    pass


class BodyTimeout(Exception):
    pass


class ClientGone(Exception):
    pass


async def read_body(receive, max_bytes: int, timeout: float) -> bytes:
    """The whole request body, or BodyTooLarge past `max_bytes`, BodyTimeout when it has not all arrived
    `timeout` seconds after the headers (a slow-body attack), ClientGone on a disconnect."""
    chunks, size = [], 0
    deadline = time.monotonic() + timeout
    while True:
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise BodyTimeout from None
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive):
    """An ASGI receive that yields `body` once, then whatever the connection sends (a disconnect)."""
    sent = False

    async def receive_again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return receive_again
