"""One HTTP request run through an ASGI app in-process (specserve/scaleout/bridge.py)."""
import asyncio

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from specserve.scaleout.bridge import call_asgi


def make_app(events: list):
    app = FastAPI()

    @app.post("/echo")
    async def echo(req: Request):
        return {"got": (await req.body()).decode(), "q": req.url.query, "h": req.headers.get("x-a")}

    @app.get("/stream")
    async def stream():
        async def gen():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.001)
            finally:
                events.append("stream closed")
        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.get("/boom")
    async def boom():
        raise RuntimeError("boom")

    return app


async def collect(gen, limit=None):
    items = []
    async for item in gen:
        items.append(item)
        if limit and len(items) >= limit:
            break
    return items


def test_a_json_request_round_trips():
    items = asyncio.run(collect(call_asgi(make_app([]), "POST", "/echo", b"x=1", [(b"x-a", b"b")], b"hello")))
    assert items[0]["status"] == 200 and (b"content-type", b"application/json") in items[0]["headers"]
    assert b"".join(i["body"] for i in items[1:]) == b'{"got":"hello","q":"x=1","h":"b"}'


def test_a_stream_arrives_whole_and_in_order():
    items = asyncio.run(collect(call_asgi(make_app([]), "GET", "/stream", b"", [], b"")))
    text = b"".join(i["body"] for i in items[1:]).decode()
    assert text == "".join(f"data: {i}\n\n" for i in range(1000))
    assert len(items) - 1 <= 1000  # pieces ready together travel together


def test_closing_early_tells_the_app_its_client_left():
    events = []

    async def run():
        gen = call_asgi(make_app(events), "GET", "/stream", b"", [], b"")
        await collect(gen, limit=3)
        await gen.aclose()
        for _ in range(200):
            if events:
                return
            await asyncio.sleep(0.01)

    asyncio.run(run())
    assert events == ["stream closed"]


def test_an_app_error_becomes_its_500_response():
    items = asyncio.run(collect(call_asgi(make_app([]), "GET", "/boom", b"", [], b"")))
    assert items[0]["status"] == 500


def test_an_app_that_answers_nothing_raises():
    async def silent(scope, receive, send):
        return None

    with pytest.raises(RuntimeError, match="no response"):
        asyncio.run(collect(call_asgi(silent, "GET", "/", b"", [], b"")))
