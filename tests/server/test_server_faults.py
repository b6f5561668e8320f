"""Faults inside the process (issue 47), on a real app and engine in this process: a request the engine
cannot add, an engine loop that dies or hangs, slow tokenization, a client that leaves mid-stream."""
import asyncio
import json
import random
import threading
import time

import httpx
import pytest

from specserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from specserve.engine.config import EngineConfig
from specserve.engine.sampling_params import SamplingParams
from specserve.errors import InvalidRequestError
from specserve.server.app import build_app

TIMEOUT = 60  # a request that hangs fails the test instead of hanging it


def make_engine(tiny_target, **kw) -> AsyncLLMEngine:
    return AsyncLLMEngine(EngineConfig(model=str(tiny_target), dtype="float32", num_kv_blocks=128,
                                       max_model_len=1024), **kw)


@pytest.fixture
def engine(tiny_target):
    e = make_engine(tiny_target)
    yield e
    e.shutdown()


async def collect(engine, prompt, params, rid=None):
    final = None
    async for out in engine.generate(prompt, params, rid):
        final = out
    return final


async def collect_rest(gen):
    async for _ in gen:
        pass


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                             base_url="http://test", timeout=TIMEOUT)


# ---- failure 1 at its root: an exception while adding one request ----------------------------------------

def test_a_request_the_engine_cannot_add_fails_alone(engine):
    bad = SamplingParams(max_tokens=8, temperature=1.0)
    bad.seed = 2**70  # past validation, as the unchecked seed of issue 47 was: Sequence() raises

    async def main():
        good = asyncio.create_task(collect(engine, "still served", SamplingParams(max_tokens=40, temperature=0,
                                                                                  ignore_eos=True)))
        with pytest.raises(InvalidRequestError, match="seed"):
            await asyncio.wait_for(collect(engine, "bad seed", bad), TIMEOUT)
        done = await asyncio.wait_for(good, TIMEOUT)
        after = await asyncio.wait_for(collect(engine, "and after", SamplingParams(max_tokens=4)), TIMEOUT)
        return done, after

    done, after = asyncio.run(main())
    assert len(done.token_ids) == 40 and after.finished
    assert engine.health_problem() is None and not engine.engine.requests


# ---- the engine loop's liveness is part of /health ---------------------------------------------------------

def test_a_dead_engine_loop_fails_health_its_streams_and_new_requests(engine):
    app = build_app(engine, "tiny")
    engine.start()
    has_unfinished = engine.engine.has_unfinished

    def broken():  # the loop calls it between steps: it breaks right after the stream's first token
        if any(seq.num_output_tokens for seq in engine.engine.requests.values()):
            raise RuntimeError("a bug outside the step guard")
        return has_unfinished()
    engine.engine.has_unfinished = broken

    async def main():
        async with client(app) as http:
            assert (await http.get("/health")).status_code == 200
            stream = asyncio.create_task(http.post("/v1/completions", json={
                "prompt": "in flight", "max_tokens": 1000, "ignore_eos": True, "stream": True}))
            streamed = await asyncio.wait_for(stream, TIMEOUT)
            health = await http.get("/health")
            new = await http.post("/v1/completions", json={"prompt": "too late", "max_tokens": 2})
            return streamed, health, new

    streamed, health, new = asyncio.run(main())
    events = [l[6:] for l in streamed.text.splitlines() if l.startswith("data: ")]
    assert events[-1] == "[DONE]" and "engine loop died" in json.loads(events[-2])["error"]["message"]
    assert health.status_code == 503 and "engine loop died" in health.json()["error"]["message"]
    assert health.headers["retry-after"]
    assert new.status_code == 503 and new.json()["error"]["code"] == "engine_dead" and new.headers["retry-after"]

    async def direct():
        with pytest.raises(EngineDeadError):
            await collect(engine, "x", SamplingParams(max_tokens=2))
    asyncio.run(direct())


def test_a_hung_step_fails_health_until_the_loop_advances(tiny_target):
    engine = make_engine(tiny_target, stall_timeout=0.5)
    app = build_app(engine, "tiny")
    engine.start()
    real_step, hung, release = engine.engine.step, threading.Event(), threading.Event()

    def step():
        if not hung.is_set():
            hung.set()
            release.wait(TIMEOUT)  # one step that hangs until the test has seen /health fail
        return real_step()
    engine.engine.step = step

    async def main():
        async with client(app) as http:
            assert (await http.get("/health")).status_code == 200
            request = asyncio.create_task(http.post("/v1/completions", json={"prompt": "hang", "max_tokens": 4}))
            assert await asyncio.to_thread(hung.wait, TIMEOUT)
            for _ in range(TIMEOUT * 20):  # 0.5 s (stall_timeout) after the loop's last message
                during = await http.get("/health")
                if during.status_code != 200:
                    break
                await asyncio.sleep(0.05)
            release.set()
            done = await request
            after = await http.get("/health")
            return during, done, after

    try:
        during, done, after = asyncio.run(main())
    finally:
        release.set()
        engine.shutdown()
    assert during.status_code == 503 and "has not advanced" in during.json()["error"]["message"]
    assert done.status_code == 200 and after.status_code == 200


# ---- failure 3: tokenization off the event loop -------------------------------------------------------------

def test_tokenization_does_not_block_the_event_loop(engine, monkeypatch):
    app = build_app(engine, "tiny")
    engine.start()
    real_encode = engine.tokenizer.encode
    encoding, release, encoded = threading.Event(), threading.Event(), threading.Event()

    def slow_encode(*args, **kwargs):  # a large prompt: it tokenizes until the test lets it finish
        encoding.set()
        release.wait(TIMEOUT)  # (on the event loop, it would hold /health for all of this, then fail below)
        encoded.set()
        return real_encode(*args, **kwargs)
    monkeypatch.setattr(engine.tokenizer, "encode", slow_encode)

    async def main():
        async with client(app) as http:
            request = asyncio.create_task(http.post("/v1/completions", json={"prompt": "slow", "max_tokens": 2}))
            while not encoding.is_set():
                await asyncio.sleep(0.01)
            health = await http.get("/health")
            answered_while_encoding = not encoded.is_set()
            release.set()
            return await request, health, answered_while_encoding

    try:
        done, health, answered_while_encoding = asyncio.run(main())
    finally:
        release.set()
    assert done.status_code == 200 and health.status_code == 200
    assert answered_while_encoding, "/health waited for the tokenizer"


def test_a_hopeless_prompt_is_refused_before_tokenizing(engine, monkeypatch):
    app = build_app(engine, "tiny")
    calls = []
    real_encode = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: calls.append(len(a[0])) or real_encode(*a, **k))

    async def main():
        async with client(app) as http:
            long = await http.post("/v1/completions", json={"prompt": "z" * 1_000_000, "max_tokens": 4})
            fits = await http.post("/v1/completions", json={"prompt": "z" * 900, "max_tokens": 4})
            return long, fits

    long, fits = asyncio.run(main())
    assert long.status_code == 400 and "at least 250000 tokens" in long.json()["error"]["message"]
    assert calls == [900] and fits.status_code == 200


def test_tokenizer_encode_releases_the_gil(tiny_target):
    from specserve.model.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(tiny_target)
    rng = random.Random(0)
    text = " ".join("".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 9))) for _ in range(60_000))
    result, gaps = {}, []

    def work():
        t = time.perf_counter()
        result["ids"] = tok.encode(text)
        result["s"] = time.perf_counter() - t
    worker = threading.Thread(target=work)
    last = time.perf_counter()
    worker.start()
    while worker.is_alive():
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    assert result["ids"] == tok.hf.encode(text).ids
    # holding the GIL, the tokenizer would stop this thread for all of its run; allow scheduling noise
    assert max(gaps) < max(0.25, 0.5 * result["s"]), (max(gaps), result["s"])


# ---- client faults: a disconnect frees the request's KV within one step --------------------------------------

def test_a_closed_stream_frees_its_kv_within_one_step(engine):
    # Recorded on the engine's thread after each step, before it takes commands: was the request still there?
    # (Counting steps from the asyncio side instead races the engine thread on a busy machine.)
    still_there = []
    engine.step_listeners.append(lambda stats: still_there.append("gone" in engine.engine.requests))

    async def main():
        other = asyncio.create_task(collect(engine, "keeps going", SamplingParams(max_tokens=300, temperature=0,
                                                                                  ignore_eos=True)))
        gen = engine.generate("leaves early", SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0), "gone")
        for _ in range(5):
            await gen.__anext__()
        seq = engine.engine.requests["gone"]
        held = list(seq.block_table)
        await gen.aclose()  # what the server does when the client disconnects: the abort is queued
        closed_at = len(still_there)
        # Queued after the abort, so each of its 8 steps (one token a step) comes after the abort was taken,
        # however far the engine thread ran ahead of this one (the other request may be done by now).
        later = await asyncio.wait_for(collect(engine, "comes later", SamplingParams(max_tokens=8, ignore_eos=True)),
                                       TIMEOUT)
        table_after = list(seq.block_table)
        await asyncio.wait_for(other, TIMEOUT)
        return closed_at, held, table_after, later

    closed_at, held, table_after, later = asyncio.run(main())
    # only the step in progress when the client left may still carry it; the loop takes the abort right after
    assert sum(still_there[closed_at:]) <= 1, still_there
    assert len(later.token_ids) == 8 and len(still_there) >= closed_at + 8  # steps after the abort: it was gone
    assert held and table_after == []  # its blocks went back to the free list


# ---- a step that fails: retried once without its newest request ---------------------------------------------

def test_a_failing_step_fails_only_its_newest_request_and_the_rest_stay_identical(tiny_target):
    """A request whose presence makes the step raise (a numerical fault in its rows, say): it alone fails;
    the others are recomputed and finish with exactly the tokens a clean run gives them."""
    greedy = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    clean = make_engine(tiny_target)

    async def reference():
        return await asyncio.wait_for(asyncio.gather(*(collect(clean, f"p{i}", greedy) for i in range(3))), TIMEOUT)
    try:
        want = asyncio.run(reference())
    finally:
        clean.shutdown()
    engine = make_engine(tiny_target)
    execute, step = engine.engine.executor.execute, engine.engine.step
    all_decoding, poison_sent = threading.Event(), threading.Event()

    def faulty(plan):
        if any(s.seq.request_id == "poison" for s in plan.decodes + plan.prefills):
            raise FloatingPointError("NaN in the rows of one request")
        return execute(plan)
    engine.engine.executor.execute = faulty

    def held_step():
        # The first step after all three have tokens waits until the poisoned request is queued: the loop
        # takes it before its next step, so it arrives while all three still run, on any machine.
        seqs = [engine.engine.requests.get(f"p{i}") for i in range(3)]
        if not poison_sent.is_set() and all(seq is not None and seq.num_output_tokens for seq in seqs):
            all_decoding.set()
            poison_sent.wait(TIMEOUT)
        return step()
    engine.engine.step = held_step

    async def main():
        good = [asyncio.create_task(collect(engine, f"p{i}", greedy, f"p{i}")) for i in range(3)]
        assert await asyncio.to_thread(all_decoding.wait, TIMEOUT)
        poison = asyncio.create_task(collect(engine, "poison", greedy, "poison"))
        await asyncio.sleep(0)  # its first slice queues it (generate() has no await before the queueing)
        assert engine.num_requests == 4
        poison_sent.set()
        with pytest.raises(EngineDeadError, match="NaN"):
            await asyncio.wait_for(poison, TIMEOUT)
        return await asyncio.wait_for(asyncio.gather(*good), TIMEOUT)

    try:
        got = asyncio.run(main())
    finally:
        poison_sent.set()
        engine.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(o.finish_reason == "length" for o in got)
    assert engine.engine.scheduler.num_preemptions >= 3  # they were running, and were recomputed


def test_a_step_that_fails_without_its_suspect_too_fails_everything_in_flight(tiny_target):
    engine = make_engine(tiny_target)
    engine.engine.executor.execute = lambda plan: (_ for _ in ()).throw(RuntimeError("broken kernel"))

    async def main():
        runs = [collect(engine, f"p{i}", SamplingParams(max_tokens=8)) for i in range(3)]
        return await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), TIMEOUT)

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    assert all(isinstance(r, EngineDeadError) and "broken kernel" in str(r) for r in results)
    assert not engine.engine.requests  # none left running (their abort outputs may still be queued)


# ---- the engine in its own process (what `specserve serve` runs) ---------------------------------------------

def test_the_engine_process_gives_what_the_thread_gives_and_its_death_is_seen(tiny_target, monkeypatch):
    import os
    import signal

    from specserve.settings import STEP_PACE_ENV

    config = EngineConfig(model=str(tiny_target), dtype="float32", num_kv_blocks=128, max_model_len=1024)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    pace = 0.02  # the engine process sleeps this long after each step: 1000 tokens take >= 20 s on any machine
    monkeypatch.setenv(STEP_PACE_ENV, str(pace))
    away = AsyncLLMEngine(config, process=True)  # spawned with the pace in its environment
    monkeypatch.delenv(STEP_PACE_ENV)
    here = AsyncLLMEngine(config)

    async def run(engine, n=3):
        return await asyncio.wait_for(asyncio.gather(*(collect(engine, f"p{i}", greedy) for i in range(n))), TIMEOUT)

    async def killed():
        long = away.generate("long", SamplingParams(max_tokens=1000, ignore_eos=True))
        first = await asyncio.wait_for(long.__anext__(), TIMEOUT)  # it runs, with >= 999 * pace s to go
        assert not first.finished
        os.kill(away._process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited"):
            await asyncio.wait_for(collect_rest(long), TIMEOUT)

    try:
        assert [o.token_ids for o in asyncio.run(run(away))] == [o.token_ids for o in asyncio.run(run(here))]
        assert away.max_model_len == 1024 and away.engine is None
        asyncio.run(killed())
        assert "exited" in away.health_problem()
    finally:
        here.shutdown()
        away.shutdown()
