"""Running one completion or chat request on the engine: a JSON body, or an SSE stream of chunks.

Everything that can be refused (unknown model, unsupported field, full queue, prompt too long) is checked
before the stream starts, so those failures get a real HTTP status; the cheap checks come first, and
the prompt is tokenized last, in a worker thread (limits.py), so the event loop never waits on it.
Closing the engine's iterator aborts the request and frees its KV blocks; that happens when the client
disconnects, mid-stream or while waiting.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specserve.engine.async_engine import AsyncLLMEngine
from specserve.engine.outputs import RequestOutput
from specserve.errors import SpecServeError
from specserve.server import limits
from specserve.server.errors import APIError, error_body, from_exception
from specserve.server.protocol import SERVER_DEFAULTS, ChatCompletionRequest, CompletionRequest, SamplingDefaults


SHUTDOWN_MESSAGE = "the server shut down before this request finished"


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(out: RequestOutput) -> dict:
    p, c = out.num_prompt_tokens, out.num_output_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


@dataclass
class _Format:
    """What differs between the completions and chat APIs: names, where text goes, logprob shape."""
    chat: bool
    tokenizer: object

    @property
    def prefix(self) -> str:
        return "chatcmpl-" if self.chat else "cmpl-"

    def object(self, chunk: bool) -> str:
        if self.chat:
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"

    def logprobs(self, token_ids: list[int], lps: list[float], offset: int) -> tuple[dict, int]:
        """The logprobs object of these tokens, and the offset after them. `offset`: characters of the
        tokens' own strings before them (completions' text_offset; a stream continues where it left off)."""
        tokens = [self.tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        if self.chat:
            return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")), "top_logprobs": []}
                                for s, lp in zip(tokens, lps)]}, offset
        # logprobs=0 asks for "the chosen token plus 0 alternatives": each top list holds the chosen token.
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": [{s: lp} for s, lp in zip(tokens, lps)],
                "text_offset": offsets}, offset

    def choice(self, text: str, logprobs, finish_reason, stop_reason, chunk: bool) -> dict:
        c: dict = {"index": 0}
        if self.chat and chunk:
            c["delta"] = {"content": text} if text else {}
        elif self.chat:
            c["message"] = {"role": "assistant", "content": text}
        else:
            c["text"] = text
        c.update(logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason)
        return c


def _render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    """The chat template's text. It sees only what the client sent, so any failure in it is a 400."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt)
    except SpecServeError:
        raise
    except Exception as e:
        raise APIError(400, f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                       "messages") from None


class Serving:
    def __init__(self, engine: AsyncLLMEngine, model_names: list[str], admit, active: set[str],
                 sampling_defaults: SamplingDefaults = SERVER_DEFAULTS):
        self.engine = engine
        self.sampling_defaults = sampling_defaults  # for fields a request omits (generation_config.py)
        self.model_names = model_names
        self.admit = admit  # raises APIError(429) when the queue is full
        self.active = active  # ids of requests in the engine, for a shutdown that has to abort them
        self.max_model_len = engine.max_model_len
        self.bound = limits.PromptBound(engine.tokenizer.hf, self.max_model_len)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist. This server serves "
                                f"{', '.join(repr(n) for n in self.model_names)}.", "model", "model_not_found")

    async def completion(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        req.check_supported()
        params = req.to_sampling_params(self.sampling_defaults)
        prompt = req.single_prompt()
        self.admit()
        if isinstance(prompt, str):
            self.bound.check(prompt, params.max_tokens, "prompt")
            prompt = await limits.encode(self.engine.tokenizer, prompt, add_special_tokens=True)
        ids = self.engine.prepare(prompt, params)
        return await self._run(_Format(False, self.engine.tokenizer), req, ids, params, raw)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        req.check_supported()
        self.admit()
        tok = self.engine.tokenizer
        # The template already writes BOS and special tokens as text (Tokenizer.encode_chat).
        text = await asyncio.to_thread(_render_chat, tok, req.template_messages(), req.add_generation_prompt is not False)
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        self.bound.check(text, limit, "messages")
        ids = await limits.encode(tok, text, add_special_tokens=False)
        params = req.to_sampling_params(len(ids), self.max_model_len, self.sampling_defaults)
        ids = self.engine.prepare(ids, params)
        return await self._run(_Format(True, tok), req, ids, params, raw)

    async def _run(self, fmt: _Format, req, ids, params, raw: Request) -> Response:
        rid = fmt.prefix + uuid.uuid4().hex
        head = {"id": rid, "object": fmt.object(req.stream), "created": int(time.time()),
                "model": req.model or self.model_names[0]}
        gen = self._generate(ids, params, rid)  # nothing runs until it is first iterated
        if req.stream:
            return StreamingResponse(self._stream(fmt, head, gen, req.include_usage, params.logprobs),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        final = await self._collect(gen, raw)
        if final is None:  # the client left; nobody reads this
            return Response(status_code=499)
        if final.finish_reason == "abort":
            raise APIError(503, SHUTDOWN_MESSAGE)
        lp = fmt.logprobs(final.token_ids, final.logprobs, 0)[0] if params.logprobs else None
        body = dict(head, choices=[fmt.choice(final.text, lp, final.finish_reason, final.stop_reason, False)],
                    usage=usage(final), speculative=final.spec)
        return JSONResponse(body)

    async def _generate(self, ids, params, rid: str):
        self.active.add(rid)
        try:
            async with aclosing(self.engine.generate(ids, params, rid)) as gen:
                async for out in gen:
                    yield out
        finally:
            self.active.discard(rid)

    async def _collect(self, gen, raw: Request) -> RequestOutput | None:
        """The final output, or None when the client disconnects first (the request is then aborted)."""
        async def consume():
            final = None
            async with aclosing(gen):
                async for out in gen:
                    final = out
            return final

        async def disconnected():
            while (await raw.receive())["type"] != "http.disconnect":
                pass

        work, gone = asyncio.ensure_future(consume()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()  # raises CancelledError inside the engine iterator, which aborts the request
        if not work.done():
            return None
        try:
            return work.result()
        except asyncio.CancelledError:
            return None
        except Exception as e:
            raise from_exception(e) from None

    async def _stream(self, fmt: _Format, head: dict, gen, include_usage: bool, logprobs: bool):
        def chunk(choices: list, **extra) -> str:
            body = dict(head, choices=choices, **extra)
            if include_usage:
                body.setdefault("usage", None)  # OpenAI: null on every chunk but the last
            return sse(body)

        offset = 0  # characters of the tokens already sent (for logprobs' text_offset)
        try:
            async with aclosing(gen):
                if fmt.chat:
                    yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
                async for out in gen:
                    lp = None
                    if logprobs and out.delta_token_ids:
                        lp, offset = fmt.logprobs(out.delta_token_ids, out.delta_logprobs, offset)
                    if not (out.delta_text or lp or out.finished):
                        continue  # tokens held back (a possible stop string, an incomplete character)
                    if not out.finished:
                        yield chunk([fmt.choice(out.delta_text, lp, None, None, True)])
                        continue
                    if out.finish_reason == "abort":  # only a shutdown aborts a request whose client is here
                        yield sse(error_body(503, SHUTDOWN_MESSAGE))
                        break
                    yield chunk([fmt.choice(out.delta_text, lp, out.finish_reason, out.stop_reason, True)],
                                speculative=out.spec)
                    if include_usage:
                        yield chunk([], usage=usage(out), speculative=out.spec)
        except Exception as e:  # the status line is already sent: report the failure in the stream
            err = from_exception(e)
            yield sse(error_body(err.status, err.message, err.param, err.code))
        yield sse("[DONE]")
