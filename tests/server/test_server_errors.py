"""Every error status the server sends, in OpenAI's shape, as the official client sees it."""
import asyncio
import json

import httpx
import openai
import pytest

from tests.server.conftest import accepted_again

MODEL = "tiny"


def assert_openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in resp.text
    return err


@pytest.fixture(scope="module")
def client(spec_server):
    with openai.OpenAI(base_url=spec_server.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_n_out_of_range_and_best_of_are_clear_400s(client):
    for n in (0, 17):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=n)
        assert "n must be in [1, 16]" in e.value.message and e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"best_of": 2})
    assert "deprecated" in e.value.message and e.value.body["param"] == "best_of"


def test_prompt_longer_than_max_model_len_names_both_numbers(client):
    prompt = "x" * 1100  # one token per byte with the tiny tokenizer
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=10)
    assert "1024" in e.value.message and "1110" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # chat without max_tokens: the prompt alone is too long
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True)
    assert "1024" in e.value.message and "11" in e.value.message


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1), None),
    (dict(top_p=0), None),
    (dict(logprobs=21), "logprobs"),
    (dict(extra_body={"presence_penalty": 2.5}), "presence_penalty"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(prompt=["one", ""]), "prompt"),
    (dict(max_tokens="lots"), "max_tokens"),  # a type error: FastAPI's 422, sent as OpenAI's 400
])
def test_invalid_requests_are_400(client, kwargs, param):
    kwargs = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kwargs)
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["param"] == param


def test_malformed_bodies_are_400_in_openai_shape(spec_server):
    url = spec_server.base_url
    r = httpx.post(url + "/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert "not valid JSON" in assert_openai_error(r, 400)["message"]
    err = assert_openai_error(httpx.post(url + "/chat/completions", json={"model": MODEL}), 400)
    assert err["param"] == "messages"
    assert_openai_error(httpx.post(url + "/chat/completions", json={"model": MODEL, "messages": []}), 400)
    bad_part = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    assert_openai_error(httpx.post(url + "/chat/completions", json=bad_part), 400)


def test_unknown_model_and_route_are_404(client, spec_server):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi")
    assert "gpt-4" in e.value.message and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    err = assert_openai_error(httpx.get(spec_server.base_url + "/embeddings"), 404)
    assert "/v1/embeddings" in err["message"]
    assert_openai_error(httpx.get(spec_server.root + "/nope"), 404)
    assert_openai_error(httpx.get(spec_server.base_url + "/completions"), 405)


def test_api_key_required_when_set(keyed_server):
    with openai.OpenAI(base_url=keyed_server.base_url, api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    # no key at all (the official client refuses to send none, so raw)
    err = assert_openai_error(httpx.post(keyed_server.base_url + "/completions", json={"prompt": "hi"}), 401)
    assert err["code"] == "invalid_api_key"
    assert_openai_error(httpx.get(keyed_server.base_url + "/unknown"), 401)  # the key is checked first
    with openai.OpenAI(base_url=keyed_server.base_url, api_key="sekret", max_retries=0) as c:
        assert c.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0).usage.completion_tokens
        assert [m.id for m in c.models.list().data] == ["tiny"]
    # health and metrics stay open for probes and scrapers
    assert httpx.get(keyed_server.root + "/health").status_code == 200
    assert httpx.get(keyed_server.root + "/metrics").status_code == 200


def test_api_key_off_accepts_any_key(client):
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_full_queue_is_429(keyed_server):
    # max_num_seqs 1 and max_queue 0: while one request streams, the next is refused
    body = {"model": MODEL, "prompt": "hold the slot", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    headers = {"Authorization": "Bearer sekret"}
    with httpx.stream("POST", keyed_server.base_url + "/completions", json=body, headers=headers,
                      timeout=30) as resp:
        lines = resp.iter_lines()  # kept: dropping a half-read iterator would close the connection already
        next(l for l in lines if l.startswith("data: "))
        with openai.OpenAI(base_url=keyed_server.base_url, api_key="sekret", max_retries=0) as c:
            with pytest.raises(openai.RateLimitError) as e:
                c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert "queue is full" in e.value.message
    # leaving the stream aborts the slot's request (a paced server: it was still running), and frees the slot
    reply = accepted_again(keyed_server, headers)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


# ---- 500: an engine that fails, in-process (a real app and engine, one method replaced) ------------------

@pytest.fixture(scope="module")
def failing_app(tiny_target):
    from specserve.engine.async_engine import AsyncLLMEngine
    from specserve.engine.config import EngineConfig
    from specserve.server.app import build_app

    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_target), dtype="float32", num_kv_blocks=64))
    real_generate = engine.generate

    async def generate(prompt, params, request_id=None, **kwargs):
        async for out in real_generate(prompt, params, request_id, **kwargs):
            yield out
            raise RuntimeError("secret internal detail")  # after the first output: mid-stream

    engine.generate = generate
    yield build_app(engine, "tiny")
    engine.shutdown()


def test_internal_errors_are_500_without_details(failing_app):
    async def main():
        transport = httpx.ASGITransport(app=failing_app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            raw = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "stream": True,
                                                           "ignore_eos": True})
            events = [l[6:] for l in raw.text.splitlines() if l.startswith("data: ")]
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "internal_server_error"
            assert "secret" not in raw.text
        # the openai client closes the http client it is given, so it comes last
        http = httpx.AsyncClient(transport=transport, base_url="http://test")
        async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0) as c:
            with pytest.raises(openai.InternalServerError) as e:
                await c.completions.create(model=MODEL, prompt="hi", max_tokens=8, extra_body={"ignore_eos": True})
            assert "secret" not in str(e.value.body) and e.value.body["type"] == "internal_server_error"
            # mid-stream the status is already 200: the error arrives as an event, and the client raises
            with pytest.raises(openai.APIError) as e:
                async for _ in await c.completions.create(model=MODEL, prompt="hi", max_tokens=8, stream=True,
                                                          extra_body={"ignore_eos": True}):
                    pass
            assert "internal server error" in e.value.message and "secret" not in e.value.message
    asyncio.run(main())
