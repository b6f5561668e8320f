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
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specserve.engine.async_engine import AsyncLLMEngine
from specserve.engine.outputs import RequestOutput
from specserve.engine.sequence import SpecStats
from specserve.errors import SpecServeError
from specserve.server import limits
from specserve.server.errors import APIError, error_body, from_exception
from specserve.model.chat_template import reads_variable
from specserve.server.protocol import (SERVER_DEFAULTS, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                       DetokenizeRequest, SamplingDefaults, TokenizeRequest)
from specserve.server.tools import ToolReply, Tools, template_messages
from specserve.structured_output.grammar import InvalidGrammarError


SHUTDOWN_MESSAGE = "the server shut down before this request finished"


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(outs: list[RequestOutput], n: int) -> dict:
    """OpenAI's usage of a response (`n` choices per prompt): each prompt counted once, every choice's tokens."""
    p, c = sum(o.num_prompt_tokens for o in outs[::n]), sum(o.num_output_tokens for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def speculative(finals: list[RequestOutput]) -> dict | None:
    """The response's speculation stats: the request's own, or with several choices their counters summed."""
    if len(finals) == 1 or finals[0].spec is None:
        return finals[0].spec
    counts = {key: sum(f.spec[key] for f in finals)
              for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    positions = [f.spec["accepted_per_position"] for f in finals]
    per_position = [sum(p[j] for p in positions if j < len(p)) for j in range(max(map(len, positions)))]
    merged = SpecStats(**counts, accepted_per_position=per_position).as_dict()
    if "synthetic_acceptance_rates" in finals[0].spec:  # benchmarks only: the acceptance was drawn
        merged["synthetic_acceptance_rates"] = finals[0].spec["synthetic_acceptance_rates"]
    return merged


def choice_params(params, i: int):
    """The sampling parameters of choice i of a request with several: its own seed when the request has one."""
    return params if params.seed is None else replace(params, seed=params.seed ^ i)


@dataclass
class _Format:
    """What differs between the completions and chat APIs: names, where text goes, logprob shape; a
    completion's echoed prompts (each choice's prompt text and token ids); a chat's tool calls (each choice's
    ToolReply); and vLLM's output options."""
    chat: bool
    tokenizer: object
    echo: list[tuple[str, list[int]]] | None = None
    replies: list[ToolReply] | None = None
    include_stop: bool = False   # include_stop_str_in_output
    token_ids_as_text: bool = False  # return_tokens_as_token_ids

    @property
    def prefix(self) -> str:
        return "chatcmpl-" if self.chat else "cmpl-"

    def object(self, chunk: bool) -> str:
        if self.chat:
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"

    def logprobs(self, token_ids: list[int], lps: list[float], offset: int, tops: list | None = None
                 ) -> tuple[dict, int]:
        """The logprobs object of these tokens, and the offset after them. `offset`: characters of the
        tokens' own strings before them (completions' text_offset; a stream continues where it left off).
        `tops`: per token, the most likely (token id, log-probability) at its position."""
        tokens = [self._text(t) for t in token_ids]
        tops = tops or [[] for _ in token_ids]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        if self.chat:
            return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")),
                                 "top_logprobs": [{"token": (a := self._text(t)), "logprob": alp,
                                                   "bytes": list(a.encode("utf-8"))} for t, alp in top]}
                                for s, lp, top in zip(tokens, lps, tops)]}, offset
        # logprobs=N: the N most likely tokens plus the chosen one (OpenAI's "up to N + 1"); an echoed prompt's
        # first token has none (None)
        return {"tokens": tokens, "token_logprobs": lps,
                "top_logprobs": [None if lp is None else {**{self._text(t): alp for t, alp in top}, s: lp}
                                 for s, lp, top in zip(tokens, lps, tops)],
                "text_offset": offsets}, offset

    def echoed(self, i: int, text: str, ids: list[int], lps: list | None, tops: list | None,
               prompt_logprobs: list | None, n: int) -> tuple[str, list[int], list | None, list | None]:
        """The prompt (OpenAI's echo), then the completion's text, tokens and their logprobs and top-n lists
        (None for the prompt's first token), the prompt's from the engine's prompt logprobs (computed when the
        request asked for logprobs; lps stays None when it did not)."""
        echo_text, echo_ids = self.echo[i]
        text, ids = echo_text + text, echo_ids + ids
        if lps is None or prompt_logprobs is None:
            return text, ids, lps, tops
        e_lps = [None if e is None else e[t][0] for t, e in zip(echo_ids, prompt_logprobs)]
        e_tops = [[] if e is None else [(t, lp) for t, (lp, rank) in sorted(e.items(), key=lambda x: x[1][1])
                                        if rank <= n] for e in prompt_logprobs]
        return text, ids, e_lps + lps, e_tops + (tops or [[] for _ in lps])

    def prompt_logprobs(self, entries: list) -> list:
        """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: logprob, rank, text}."""
        return [None if e is None else {str(t): {"logprob": lp, "rank": rank, "decoded_token": self._text(t)}
                                        for t, (lp, rank) in e.items()} for e in entries]

    def _text(self, token_id: int) -> str:
        if self.token_ids_as_text:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def ending(self, out: RequestOutput) -> str:
        """What a finished output's text ends with beyond the engine's: the stop string that ended it, if the
        request keeps it."""
        return out.stop_reason if self.include_stop and isinstance(out.stop_reason, str) else ""

    def choice(self, text: str, logprobs, finish_reason, stop_reason, chunk: bool, index: int = 0) -> dict:
        """Choice `index`: its whole text, or (chunk) the text new since its previous chunk; a chat's tool
        calls taken out of it."""
        c: dict = {"index": index}
        reply = self.replies[index] if self.replies else None
        if self.chat and chunk:
            c["delta"] = reply.delta(text, finish_reason is not None) if reply else ({"content": text} if text else {})
        elif self.chat:
            c["message"] = reply.message(text) if reply else {"role": "assistant", "content": text}
        else:
            c["text"] = text
        if finish_reason == "stop" and reply is not None and (reply.called if chunk else "tool_calls" in c["message"]):
            finish_reason = "tool_calls"
        c.update(logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason)
        return c


async def _first_of(gen, prefilled: asyncio.Event):
    """The first choice's outputs; `prefilled` is set at its first (its prompt is then in the cache) or end."""
    try:
        async with aclosing(gen):
            async for out in gen:
                prefilled.set()
                yield out
    finally:
        prefilled.set()


async def _after(gen, prefilled: asyncio.Event):
    """Another choice's outputs, its request sent once the first choice's prompt is prefilled."""
    async with aclosing(gen):
        await prefilled.wait()
        async for out in gen:
            yield out


def render_chat(tokenizer, messages: list[ChatMessage], tools: Tools | None, add_generation_prompt: bool,
                continue_final_message: bool = False, template_kwargs: dict | None = None) -> str:
    """The chat template's text of a conversation (tools.py: with its tools). It sees only what the client
    sent, so any failure in it is a 400. `continue_final_message`: the text ends where the last message's does,
    so that the reply continues it (transformers' rule)."""
    inputs = [m.as_template_input() for m in messages]
    template = tokenizer.template_for(bool(tools))
    inputs, template_tools = template_messages(inputs, tools, bool(template) and reads_variable(template, "tools"))
    try:
        text = tokenizer.apply_chat_template(inputs, add_generation_prompt, tools=template_tools,
                                             **(template_kwargs or {}))
    except SpecServeError:
        raise
    except Exception as e:
        raise APIError(400, f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                       "messages") from None
    if continue_final_message:
        last = inputs[-1]["content"].strip()
        at = text.rfind(last) if last else -1
        if at < 0:
            raise APIError(400, "continue_final_message: the chat template does not write the last message's text "
                                "as it is", "continue_final_message")
        text = text[:at + len(last)]
    return text


class Serving:
    def __init__(self, engine: AsyncLLMEngine, model_names: list[str], admit, active: set[str],
                 sampling_defaults: SamplingDefaults = SERVER_DEFAULTS, tool_call_parser: str = "auto"):
        self.engine = engine
        self.tool_call_parser = tool_call_parser  # tool_parsers.PARSER_NAMES
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
        prompts = req.prompts()
        self.admit()
        tok, token_ids, echo = self.engine.tokenizer, [], []
        for i, prompt in enumerate(prompts):
            text = prompt if isinstance(prompt, str) else None
            if text is not None:
                self.bound.check(prompt, params.max_tokens, "prompt" if len(prompts) == 1 else f"prompt.{i}")
                prompt = await limits.encode(tok, prompt, add_special_tokens=req.add_special_tokens is not False)
            ids = await self._prepare(req, prompt, params)
            token_ids.append(ids)
            # the prompt as sent, or its token ids' text, before each of its choices
            echo += [(text if text is not None else tok.decode(ids, skip_special_tokens=False), ids)] * (req.n or 1)
        fmt = _Format(False, tok, echo if req.echo else None, include_stop=bool(req.include_stop_str_in_output),
                      token_ids_as_text=bool(req.return_tokens_as_token_ids))
        return await self._run(fmt, req, token_ids, params, raw)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        req.check_supported()
        self.admit()
        tok, tools = self.engine.tokenizer, req.tool_spec
        text = await asyncio.to_thread(render_chat, tok, req.messages, tools, req.add_generation_prompt is not False,
                                       bool(req.continue_final_message), req.template_kwargs())
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        self.bound.check(text, limit, "messages")
        # add_special_tokens (vLLM's) is off by default: the template already writes BOS and the like as text.
        ids = await limits.encode(tok, text, add_special_tokens=bool(req.add_special_tokens))
        params = req.to_sampling_params(len(ids), self.max_model_len, self.sampling_defaults)
        ids = await self._prepare(req, ids, params)
        replies = None
        if tools is not None and tools.choice != "none":
            replies = [tools.reply(self.tool_call_parser, tok.template_for(True)) for _ in range(req.n or 1)]
        fmt = _Format(True, tok, replies=replies, include_stop=bool(req.include_stop_str_in_output),
                      token_ids_as_text=bool(req.return_tokens_as_token_ids))
        return await self._run(fmt, req, [ids], params, raw)

    async def tokenize(self, req: TokenizeRequest) -> dict:
        """vLLM's /tokenize: the prompt's token ids, or the chat template's for the messages."""
        self.check_model(req.model)
        req.check()
        tok = self.engine.tokenizer
        if req.messages is None:
            text, add_special = req.prompt, req.add_special_tokens is not False
        else:
            tools = Tools.from_request(req.tools, None, None)
            text = await asyncio.to_thread(render_chat, tok, req.messages, tools, req.add_generation_prompt is not False,
                                           bool(req.continue_final_message), req.chat_template_kwargs)
            add_special = bool(req.add_special_tokens)
        ids = await limits.encode(tok, text, add_special_tokens=add_special)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": [tok.hf.id_to_token(t) for t in ids] if req.return_token_strs else None}

    def detokenize(self, req: DetokenizeRequest) -> dict:
        self.check_model(req.model)
        vocab = self.engine.tokenizer.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": self.engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    async def _prepare(self, req, prompt, params) -> list[int]:
        """The engine's checks of the request; a grammar is compiled to check it, off the event loop (a large
        schema compiles long enough to stall every other request's stream)."""
        if params.structured_outputs is None:
            return self.engine.prepare(prompt, params)
        try:
            return await asyncio.to_thread(self.engine.prepare, prompt, params)
        except InvalidGrammarError as e:
            raise APIError(400, str(e), req.structured_output().field) from None

    async def _run(self, fmt: _Format, req, prompts: list[list[int]], params, raw: Request) -> Response:
        rid = fmt.prefix + uuid.uuid4().hex
        head = {"id": rid, "object": fmt.object(req.stream), "created": int(time.time()),
                "model": req.model or self.model_names[0]}
        n = req.n or 1
        # One engine request per choice (nothing runs until a generator is first iterated), choice i * n + j
        # being prompt i's j-th; a seeded request's choices of a prompt draw from seeds of their own, so that
        # they differ and each one reproduces.
        gens = []
        for ids in prompts:
            group = [self._generate(ids, params if n == 1 else choice_params(params, j),
                                    rid if n * len(prompts) == 1 else f"{rid}-{len(gens) + j}") for j in range(n)]
            if n > 1:  # the others start once the first has its prompt's KV: they take it from the prefix cache
                prefilled = asyncio.Event()
                group = [_first_of(group[0], prefilled)] + [_after(g, prefilled) for g in group[1:]]
            gens += group
        if req.stream:
            return StreamingResponse(self._stream(fmt, head, gens, n, req.include_usage, params,
                                                  req.prompt_logprobs is not None),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        finals = await self._collect(gens, raw)
        if finals is None:  # the client left; nobody reads this
            return Response(status_code=499)
        if any(f.finish_reason == "abort" for f in finals):
            raise APIError(503, SHUTDOWN_MESSAGE)
        choices = []
        for i, final in enumerate(finals):
            text, ids, lps, tops = final.text + fmt.ending(final), final.token_ids, final.logprobs, final.top_logprobs
            if fmt.echo:
                text, ids, lps, tops = fmt.echoed(i, text, ids, lps, tops, final.prompt_logprobs, params.top_logprobs)
            lp = fmt.logprobs(ids, lps, 0, tops)[0] if params.logprobs else None
            choices.append(fmt.choice(text, lp, final.finish_reason, final.stop_reason, False, i))
            if req.prompt_logprobs is not None:
                choices[-1]["prompt_logprobs"] = fmt.prompt_logprobs(final.prompt_logprobs)
        body = dict(head, choices=choices, usage=usage(finals, n), speculative=speculative(finals))
        return JSONResponse(body)

    async def _generate(self, ids, params, rid: str):
        self.active.add(rid)
        try:
            async with aclosing(self.engine.generate(ids, params, rid, prepared=True)) as gen:
                async for out in gen:
                    yield out
        finally:
            self.active.discard(rid)

    async def _collect(self, gens: list, raw: Request) -> list[RequestOutput] | None:
        """Each choice's final output, or None when the client disconnects first (the requests are then
        aborted)."""
        async def consume(gen):
            final = None
            async with aclosing(gen):
                async for out in gen:
                    final = out
            return final

        async def disconnected():
            while (await raw.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.ensure_future(asyncio.gather(*(consume(g) for g in gens)))
        gone = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()  # raises CancelledError inside the engine iterators, which aborts the requests
        if not work.done():
            return None
        try:
            return work.result()
        except asyncio.CancelledError:
            return None
        except Exception as e:
            raise from_exception(e) from None

    async def _stream(self, fmt: _Format, head: dict, gens: list, n: int, include_usage: bool, params,
                      with_prompt_logprobs: bool):
        def chunk(choices: list, **extra) -> str:
            body = dict(head, choices=choices, **extra)
            if include_usage:
                body.setdefault("usage", None)  # OpenAI: null on every chunk but the last
            return sse(body)

        # The choices' outputs as they come, (index, output), (index, None) when a choice's stream has ended
        outputs: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, gen) -> None:
            try:
                async with aclosing(gen):
                    async for out in gen:
                        await outputs.put((i, out))
            except Exception as e:
                await outputs.put((i, e))
            else:
                await outputs.put((i, None))

        pumps = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        offsets = [0] * len(gens)  # characters of the tokens already sent (for logprobs' text_offset)
        prompt_sent = [fmt.echo is None and not with_prompt_logprobs] * len(gens)  # echo, prompt_logprobs: first chunk
        finals: list[RequestOutput | None] = [None] * len(gens)
        try:
            if fmt.chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(gens))])
            running = len(gens)
            while running:
                i, out = await outputs.get()
                if out is None:
                    running -= 1
                    continue
                if isinstance(out, Exception):
                    raise out
                ids, lps, tops, text, extra = out.delta_token_ids, out.delta_logprobs, out.delta_top_logprobs, \
                    out.delta_text, {}
                if not prompt_sent[i] and (out.delta_token_ids or out.finished):  # the prefill is done
                    prompt_sent[i] = True
                    if fmt.echo:
                        text, ids, lps, tops = fmt.echoed(i, text, ids, (lps or []) if params.logprobs else None,
                                                          tops, out.prompt_logprobs, params.top_logprobs)
                    if with_prompt_logprobs:
                        extra["prompt_logprobs"] = fmt.prompt_logprobs(out.prompt_logprobs)
                lp = None
                if params.logprobs and ids:
                    lp, offsets[i] = fmt.logprobs(ids, lps, offsets[i], tops)
                if out.finish_reason == "abort":  # only a shutdown aborts a request whose client is here
                    yield sse(error_body(503, SHUTDOWN_MESSAGE))
                    break
                if out.finished:
                    text += fmt.ending(out)
                choice = dict(fmt.choice(text, lp, out.finish_reason, out.stop_reason, True, i), **extra)
                if not out.finished:
                    if choice.get("delta") or choice.get("text") or lp or extra:  # else tokens held back (a
                        yield chunk([choice])  # possible stop string or tool call, an incomplete character)
                    continue
                finals[i] = out
                yield chunk([choice], speculative=out.spec)
            else:
                if include_usage:
                    yield chunk([], usage=usage(finals, n), speculative=speculative(finals))
        except Exception as e:  # the status line is already sent: report the failure in the stream
            err = from_exception(e)
            yield sse(error_body(err.status, err.message, err.param, err.code))
        finally:
            for task in pumps:  # a client gone or a shutdown: the engine requests still running are aborted
                task.cancel()
        yield sse("[DONE]")
