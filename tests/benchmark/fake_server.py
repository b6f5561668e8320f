"""A scripted OpenAI-compatible streaming server for the benchmark tests, on 127.0.0.1 and a free port.

Every response waits `ttft_s`, sends its first chunk, then one chunk every `itl_s` with `tokens_per_chunk`
tokens each, then a usage chunk carrying `speculative` stats, then [DONE]. The numbers are known, so the
client's measurements can be checked against them. `llamacpp=True` imitates llama-server instead: no
`max_model_len` in /v1/models, `llamacpp:` metrics (speculation counters with per-position acceptance,
decode calls and busy slots per decode), and per-response `timings.draft_n`/`draft_n_accepted` in place of
`speculative`, every response speculating 3 tokens per verify step whatever it streams per chunk.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


@dataclass
class Script:
    ttft_s: float = 0.05
    itl_s: float = 0.01
    tokens_per_chunk: int = 1
    max_model_len: int = 4096
    reject_marker: str | None = None     # prompts containing this get an HTTP 400
    count_tokens: object = None          # callable(text) -> int; default: whitespace words
    seen: list = field(default_factory=list)   # request bodies received, for assertions
    preemptions: int = 0
    drafts: int = 0
    llamacpp: bool = False
    drafted: int = 0
    accepted: int = 0
    decode_calls: int = 0


def make_app(script: Script) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        if script.llamacpp:
            return {"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": "llamacpp",
                                                "meta": {"n_ctx": script.max_model_len}}]}
        return {"object": "list", "data": [{"id": "fake-model", "object": "model",
                                            "max_model_len": script.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        if script.llamacpp:   # as llama-server --metrics writes them (tools/server/server-task.cpp)
            busy = 2.0 if script.decode_calls else 0.0   # a running average over every decode call
            lines = [f"llamacpp:spec_decode_num_draft_tokens_total {script.drafted}",
                     f"llamacpp:spec_decode_num_accepted_tokens_total {script.accepted}",
                     f"llamacpp:spec_decode_num_drafts_total {script.drafts}",
                     f"llamacpp:n_decode_total {script.decode_calls}",
                     f"llamacpp:n_busy_slots_per_decode {busy}",
                     "llamacpp:requests_deferred 0",
                     f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {script.drafts}',
                     f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="1"}} '
                     f'{script.accepted - script.drafts}']
            return PlainTextResponse("\n".join(lines) + "\n")
        lines = ["# TYPE specserve:num_preemptions_total counter",
                 f'specserve:num_preemptions_total{{model_name="fake-model"}} {script.preemptions}',
                 f'specserve:spec_decode_num_drafts_total{{model_name="fake-model"}} {script.drafts}']
        return PlainTextResponse("\n".join(lines) + "\n")

    async def handle(request: Request, chat: bool):
        body = await request.json()
        script.seen.append(body)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if script.reject_marker and script.reject_marker in prompt:
            return JSONResponse({"error": {"message": "rejected by script", "type": "invalid_request_error"}},
                                status_code=400)
        n_out = int(body.get("max_tokens", 16))
        count = script.count_tokens or (lambda t: len(t.split()))
        n_prompt = count(prompt)

        def chunk(text: str, **extra) -> str:
            choice = ({"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text})
            return "data: " + json.dumps({"id": "x", "choices": [choice] if text else [], **extra}) + "\n\n"

        async def stream():
            if chat:   # a role-only first delta, as OpenAI sends: it carries no generated text
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + "\n\n"
            await asyncio.sleep(script.ttft_s)
            sent = 0
            while sent < n_out:
                if sent:
                    await asyncio.sleep(script.itl_s)
                step = min(script.tokens_per_chunk, n_out - sent)
                yield chunk(" tok" * step)
                sent += step
            if script.llamacpp:
                drafts = -(-n_out // 3)   # 3 tokens per verify step: 2 accepted drafts + 1
                script.drafts += drafts
                script.drafted += 3 * drafts
                script.accepted += n_out - drafts
                script.decode_calls += n_out
                timings = {"predicted_n": n_out, "draft_n": 3 * drafts, "draft_n_accepted": n_out - drafts}
                yield chunk("", usage={"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                       "total_tokens": n_prompt + n_out}, timings=timings)
                yield "data: [DONE]\n\n"
                return
            drafts = -(-n_out // script.tokens_per_chunk)
            script.drafts += drafts
            script.preemptions += 1
            spec = {"num_drafts": drafts, "num_draft_tokens": 3 * drafts, "num_accepted_tokens": n_out - drafts,
                    "accepted_per_position": [drafts, n_out - 2 * drafts, 0],
                    "mean_acceptance_length": n_out / drafts}
            yield chunk("", usage={"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                   "total_tokens": n_prompt + n_out}, speculative=spec)
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


class FakeServer:
    """Runs the app in a background thread; `url` is its base URL."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(make_app(script), log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


if __name__ == "__main__":   # `python fake_server.py PORT`: what a sweep config's `launch` command starts
    import sys

    uvicorn.run(make_app(Script()), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
