"""A server under synthetic acceptance (benchmarks only) says so in every response's speculation stats, a
request with several choices too. In-process: a real app and engine."""
import asyncio

import httpx
import pytest

RATES = [0.8, 0.4]


@pytest.fixture(scope="module")
def app(tiny_target, tiny_draft):
    from specserve.engine.async_engine import AsyncLLMEngine
    from specserve.engine.config import EngineConfig
    from specserve.server.app import build_app

    spec = {"model": str(tiny_draft), "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": RATES}
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_target), dtype="float32", num_kv_blocks=128,
                                         speculative_config=spec))
    engine.start()
    yield build_app(engine, "tiny")
    engine.shutdown()


@pytest.mark.parametrize("n", [1, 2])
def test_responses_say_the_acceptance_was_synthetic(app, n):
    async def post():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            return await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 12, "n": n,
                                                            "temperature": 0.8, "ignore_eos": True})
    r = asyncio.run(post())
    assert r.status_code == 200, r.text
    spec = r.json()["speculative"]
    assert spec["synthetic_acceptance_rates"] == RATES and spec["num_drafts"] > 0
