"""Process-level behaviour: SIGTERM drains and exits 0, the default speculative choice, the real model."""
import asyncio
import json
import signal

import httpx
import openai
import pytest

from specserve.server.serving import SHUTDOWN_MESSAGE
from specserve.spec_decode.config import speculative_choice
from tests.server.conftest import (PACED, EngineFreeze, ServerProcess, all_in_server, long_body, read_stream,
                                   tiny_args)


def test_sigterm_drains_in_flight_requests_refuses_new_ones_and_exits_0(tiny_target, tmp_path):
    # The engine is frozen from before the requests come until the checks are done: both are in flight
    # during the drain on any machine; then it serves them, one at a time, to their last token.
    server = ServerProcess(tiny_args(tiny_target, "--speculative-config", "none", "--max-num-seqs", "1"),
                           tmp_path / "drain.log")
    url = server.base_url + "/completions"

    async def main():
        with EngineFreeze(server):
            streams = [asyncio.create_task(read_stream(url, long_body(100))) for _ in range(2)]
            await all_in_server(server, 2, running=0)
            server.proc.send_signal(signal.SIGTERM)
            async with httpx.AsyncClient(timeout=10) as http:
                for _ in range(200):  # the signal lands soon (a hang guard, not a speed)
                    refused = await http.post(url, json={"prompt": "late", "max_tokens": 2})
                    if refused.status_code == 503:
                        break
                    await asyncio.sleep(0.05)
                assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
                assert int(refused.headers["retry-after"]) >= 1
                assert (await http.get(server.root + "/health")).status_code == 503
        return await asyncio.gather(*streams)

    try:
        results = asyncio.run(main())
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
    for r in results:
        assert r["done"] and r["usage"]["completion_tokens"] == 100 and "error" not in r
    assert "draining: 2 request(s) in flight" in server.log
    assert "CRITICAL" not in server.log  # the engine's end was asked for: no "engine died" alarm


def test_drain_timeout_aborts_what_is_left_and_still_exits_0(tiny_target, tmp_path):
    # A paced engine (no speculation: one token a step): the running request needs >= 1000 * PACE_S (20 s)
    # on any machine, far more than the 0.5 s drain, and the engine still takes the aborts as they come.
    server = ServerProcess(tiny_args(tiny_target, "--speculative-config", "none", "--max-num-seqs", "1",
                                     "--drain-timeout", "0.5"), tmp_path / "timeout.log", env=PACED)
    url = server.base_url + "/completions"

    async def main():
        streams = [asyncio.create_task(read_stream(url, long_body(1000))) for _ in range(3)]
        await all_in_server(server, 3, running=1)
        server.proc.send_signal(signal.SIGTERM)
        return await asyncio.gather(*streams)

    try:
        results = asyncio.run(main())
        assert server.proc.wait(30) == 0
    finally:
        server.stop()
    # every stream, running or queued, ends properly and says why
    assert [(r["done"], r.get("error")) for r in results] == [(True, SHUTDOWN_MESSAGE)] * 3, (results, server.log)
    assert "drain timeout: aborting 3 request(s)" in server.log and "Traceback" not in server.log


def test_a_taken_port_is_a_one_line_error(tiny_target, spec_server):
    import subprocess
    import sys
    port = spec_server.root.rsplit(":", 1)[1]
    p = subprocess.run([sys.executable, "-m", "specserve", "serve", "--model", str(tiny_target), "--port", port],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("error: cannot listen on 127.0.0.1:") and "Traceback" not in p.stderr


def _choice(model="smollm2-135m", spec=None):
    return speculative_choice(spec, model)


def test_default_speculative_config(monkeypatch, tmp_path):
    import specserve.spec_decode.drafts as drafts
    monkeypatch.setattr(drafts, "shipped_draft_dir", lambda name: tmp_path / name)
    assert _choice()[0] is None  # no shipped draft yet: plain decoding
    (tmp_path / "chat").mkdir()
    (tmp_path / "chat" / "config.json").write_text("{}")
    assert _choice()[0] is None  # "default" routes between both: both needed
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "config.json").write_text("{}")
    assert json.loads(_choice()[0]) == {"model": "default", "num_speculative_tokens": 4, "ngram_first": True,
                                        "quantization": "q8_0", "policy": "adaptive"}
    assert _choice(model="/some/other/model")[0] is None  # vocabularies differ
    assert _choice(spec="none")[0] is None
    given = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert _choice(spec=given)[0] == given


@pytest.mark.slow
def test_real_default_model_chat_completion(smollm2_dir, tmp_path):
    from specserve import LLM, SamplingParams
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = LLM(model="smollm2-135m", max_model_len=512, num_kv_blocks=64).chat(
        messages, SamplingParams(max_tokens=16, temperature=0))[0]
    # the first start on a machine profiles the step cost for the adaptive policy (then it is cached)
    server = ServerProcess(["--model", "smollm2-135m", "--max-model-len", "512"], tmp_path / "real.log",
                           startup_timeout=300)
    try:
        with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120) as c:
            r = c.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=16, temperature=0)
    finally:
        assert server.stop() == 0
    assert r.choices[0].message.content == want.text and want.text.strip()
    assert r.usage.completion_tokens == len(want.token_ids)
    assert "speculative decoding" in server.log

