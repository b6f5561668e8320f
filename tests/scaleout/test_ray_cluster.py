"""`specserve serve --replicas 2` on a local Ray cluster, driven by the official openai client.

One cluster per HTTP front, for the module (tests/scaleout/conftest.py); the replica-killing test runs last.
"""
import asyncio
import os
import signal
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPLICA_HEADER = "x-specserve-replica"


def wait_for(predicate, timeout: float, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=120)


def both_ready(cluster) -> dict | None:
    h = cluster.health()
    return h if h["ready_replicas"] == 2 else None


def test_health_reports_each_replica(cluster):
    h = wait_for(lambda: both_ready(cluster), 60)
    assert h and h["status"] == "ok" and h["router"] == "latency", h
    for r in h["replicas"].values():
        assert r["problem"] is None and r["latency_model"].endswith("model.json") and r["chars_per_token"] > 0


def test_openai_client_completions_and_chat_unmodified(client):
    r = client.completions.create(model="tiny", prompt="Hello there", max_tokens=12, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length" and r.choices[0].text
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert c.choices[0].message.role == "assistant" and c.usage.completion_tokens <= 8
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_streaming_is_preserved(client):
    chunks = list(client.completions.create(model="tiny", prompt="count", max_tokens=40, stream=True,
                                            extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True}))
    assert len(chunks) > 2  # arrives in pieces, not one body
    assert chunks[-1].usage.completion_tokens == 40
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go"}],
                                            max_tokens=20, stream=True)
    deltas = [ch.choices[0].delta for ch in stream if ch.choices]
    assert deltas[0].role == "assistant" and len(deltas) > 2


def test_vllms_tokenizer_routes_reach_a_replica(cluster):
    root = cluster.base_url.removesuffix("/v1")
    ids = httpx.post(root + "/tokenize", json={"prompt": "Hello"}, timeout=60).json()["tokens"]
    assert httpx.post(root + "/detokenize", json={"tokens": ids}, timeout=60).json() == {"prompt": "Hello"}
    assert httpx.get(root + "/version", timeout=60).json()["version"]


def test_errors_keep_their_status_through_the_ingress(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"best_of": 3})


def test_a_body_over_the_limit_is_refused_by_the_ingress(cluster):
    r = httpx.post(cluster.base_url + "/completions", content=b"x" * ((4 << 20) + 1),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_concurrent_requests_use_both_replicas_and_metrics_label_them(cluster):
    async def burst():
        c = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=120)
        rs = await asyncio.gather(*(c.completions.with_raw_response.create(
            model="tiny", prompt=f"request {i}", max_tokens=300, extra_body={"ignore_eos": True}) for i in range(8)))
        return [r.headers[REPLICA_HEADER] for r in rs]

    served = asyncio.run(burst())
    assert len(set(served)) == 2, (served, cluster.health())  # the latency router spreads in-flight work
    text = httpx.get(cluster.root + "/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    running = {s.labels["replica"] for s in families["specserve:num_requests_running"].samples}
    assert running == set(served)
    routed = {s.labels["replica"]: s.value for s in families["specserve:scaleout_requests_routed"].samples
              if s.name.endswith("_total")}
    assert set(routed) == set(served) and sum(routed.values()) >= 8


def test_a_session_stays_on_one_replica(client, cluster):
    replicas = {client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": f"turn {i}"}], max_tokens=4, user="alice",
    ).headers[REPLICA_HEADER] for i in range(4)}
    assert len(replicas) == 1, (replicas, cluster.health())


def test_killing_a_replica_mid_load_retries_or_fails_cleanly(cluster):
    """SIGKILL one replica while both serve: the non-streamed requests it held are retried on the other
    replica and succeed; its streams end with an error event (openai raises APIError); nothing hangs."""
    h = wait_for(lambda: both_ready(cluster), 60)
    assert h, cluster.health()

    async def one(c, i):
        kw = dict(model="tiny", prompt=f"long {i}", max_tokens=900, extra_body={"ignore_eos": True})
        try:
            if i % 2:
                n = 0
                async for _ in await c.completions.create(stream=True, **kw):
                    n += 1
                return "stream", "ok"
            r = await c.completions.create(**kw)
            assert r.usage.completion_tokens == 900
            return "plain", "ok"
        except openai.APIError as e:
            return ("stream" if i % 2 else "plain"), f"error: {e}"

    async def scenario():
        c = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=120)
        tasks = [asyncio.create_task(one(c, i)) for i in range(8)]
        victim = None
        for _ in range(200):  # kill once the victim is busy (the paced engines keep its requests running)
            await asyncio.sleep(0.05)
            loads = (await asyncio.to_thread(cluster.health))["replicas"].values()
            busy = [r for r in loads if r.get("running", 0) >= 2]
            if busy:
                victim = busy[0]
                break
        assert victim is not None, "no replica ever had two requests running"
        os.kill(victim["pid"], signal.SIGKILL)
        return victim, await asyncio.wait_for(asyncio.gather(*tasks), 120)

    started = time.monotonic()
    victim, outcomes = asyncio.run(scenario())
    elapsed = time.monotonic() - started
    assert elapsed < 120, elapsed
    assert all(o == "ok" for kind, o in outcomes if kind == "plain"), outcomes  # retried elsewhere
    for kind, o in outcomes:
        assert o == "ok" or "replica serving this stream stopped" in o, o
    text = httpx.get(cluster.root + "/metrics", timeout=30).text
    retried = sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                  if f.name in ("specserve:scaleout_retries", "specserve:scaleout_broken_streams")
                  and s.name.endswith("_total"))
    assert retried >= 1, "the killed replica held no request?"
    # The service goes on, and Ray puts a new replica in the dead one's place.
    r = httpx.post(cluster.base_url + "/completions", json={"model": "tiny", "prompt": "after", "max_tokens": 4},
                   timeout=60)
    assert r.status_code == 200, r.text
    h = wait_for(lambda: both_ready(cluster), 90, interval=1.0)
    assert h and victim["replica"] not in h["replicas"], cluster.health()
