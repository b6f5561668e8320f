"""One HTTP request run through an ASGI app in-process, its response handed back piece by piece.

Each replica runs the unchanged specserve app (server/app.py): the ingress forwards the client's method,
path, headers and body, and this yields the response start, then the body as it is produced (all pieces
ready at that moment joined into one, so a fast stream does not cost one Ray message per token). Closing
the iterator before the end tells the app its client disconnected, which aborts the engine request.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


def _scope(method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]]) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
            "root_path": "", "headers": headers, "client": ("ray-serve", 0), "server": ("specserve-replica", 0)}


async def call_asgi(app, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                    body: bytes) -> AsyncIterator[dict]:
    """Yields {"status": int, "headers": [(name, value)]} once, then {"body": bytes} until the response ends."""
    messages: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()  # the app listens for this to abort a request whose client left
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    task = asyncio.ensure_future(app(_scope(method, path, query, headers), receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    started = False
    try:
        while True:
            message = await messages.get()
            if message is None:  # the app returned (or raised) without finishing its response
                if task.exception() is not None:
                    raise task.exception()
                if not started:
                    raise RuntimeError(f"the app sent no response to {method} {path}")
                return
            if message["type"] == "http.response.start":
                started = True
                yield {"status": message["status"],
                       "headers": [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]}
                continue
            if message["type"] != "http.response.body":
                continue
            chunks, more = [message.get("body", b"")], message.get("more_body", False)
            while more and not messages.empty():  # join what is already there
                nxt = messages.get_nowait()
                if nxt is None:  # the app's end marker is always last: leave it for the loop
                    messages.put_nowait(None)
                    break
                if nxt["type"] != "http.response.body":
                    continue
                chunks.append(nxt.get("body", b""))
                more = nxt.get("more_body", False)
            data = b"".join(chunks)
            if data:
                yield {"body": data}
            if not more:
                return
    finally:
        disconnected.set()
        if not task.done():
            # The app sees the disconnect and aborts its engine request; cancel in case it does not listen.
            asyncio.get_running_loop().call_later(5.0, task.cancel)
