"""Sampling defaults from the model (`--generation-config`, specserve/server/generation_config.py): a
request that omits temperature, top_p, top_k or its length limit gets the model's; one that sets them
keeps its own. In-process: a real app and engine, with the engine's generate wrapped to see the params."""
import asyncio
import json
import logging
import subprocess
import sys

import httpx
import pytest

from specserve.errors import SpecServeError
from specserve.model.registry import ALIASES, DEFAULT_MODEL
from specserve.server.generation_config import resolve
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingDefaults

FILE = {"temperature": 0.3, "top_p": 0.8, "top_k": 5, "max_new_tokens": 6, "bos_token_id": 258,
        "repetition_penalty": 1.1, "min_p": 0.05}


@pytest.fixture(scope="module")
def model_dir(tiny_target, tmp_path_factory):
    """The tiny target (its files linked, not copied) with a generation_config.json."""
    d = tmp_path_factory.mktemp("genconf") / "model"
    d.mkdir()
    for f in tiny_target.iterdir():
        (d / f.name).symlink_to(f)
    (d / "generation_config.json").write_text(json.dumps(FILE))
    return d


@pytest.fixture(scope="module")
def engine(model_dir):
    from specserve.engine.async_engine import AsyncLLMEngine
    from specserve.engine.config import EngineConfig

    e = AsyncLLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64))
    e.seen = []  # the SamplingParams of every request, as the engine receives them
    real_generate = e.generate

    async def generate(prompt, params, request_id=None, **kwargs):
        e.seen.append(params)
        async for out in real_generate(prompt, params, request_id, **kwargs):
            yield out

    e.generate = generate
    e.start()
    yield e
    e.shutdown()


def post_all(app, bodies: list[tuple[str, dict]]) -> list[dict]:
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            out = []
            for path, body in bodies:
                r = await http.post(path, json=body)
                assert r.status_code == 200, r.text
                out.append(r.json())
            return out
    return asyncio.run(run())


def test_the_files_values_fill_in_what_a_request_omits(engine, model_dir):
    from specserve.server.app import build_app

    defaults, why = resolve("auto", str(model_dir))
    assert defaults == SamplingDefaults(temperature=0.3, top_p=0.8, top_k=5, max_tokens=6, repetition_penalty=1.1)
    assert str(model_dir / "generation_config.json") in why and "min_p=0.05" in why  # not applied
    app = build_app(engine, "tiny", sampling_defaults=defaults)
    engine.seen.clear()
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    outs = post_all(app, [
        ("/v1/completions", {"prompt": "hello"}),
        ("/v1/chat/completions", chat),
        ("/v1/completions", {"prompt": "hello", "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 9,
                             "ignore_eos": True}),
        ("/v1/chat/completions", dict(chat, temperature=0, max_tokens=8, ignore_eos=True)),
    ])
    got = [(p.temperature, p.top_p, p.top_k, p.max_tokens) for p in engine.seen]
    assert got[0] == (0.3, 0.8, 5, 6) and got[1] == (0.3, 0.8, 5, 6)  # max_new_tokens caps the omitted limit
    assert got[2] == (1.0, 1.0, -1, 9) and got[3] == (0.0, 0.8, 5, 8)  # what the request sets wins
    assert [p.repetition_penalty for p in engine.seen] == [1.1] * 4  # applied, as vLLM does
    assert outs[2]["usage"]["completion_tokens"] == 9 and outs[3]["usage"]["completion_tokens"] == 8


def test_vllm_switches_them_off_and_an_app_without_them_reads_the_models(engine, model_dir, caplog):
    from specserve.server.app import build_app

    defaults, why = resolve("vllm", str(model_dir))
    assert defaults == SamplingDefaults() and "--generation-config vllm" in why
    engine.seen.clear()
    post_all(build_app(engine, "tiny", sampling_defaults=defaults), [("/v1/completions", {"prompt": "hello"})])
    with caplog.at_level(logging.INFO, logger="specserve.server"):
        app = build_app(engine, "tiny")  # no defaults given (as a scale-out replica builds it): auto
    assert "temperature=0.3" in caplog.text
    post_all(app, [("/v1/completions", {"prompt": "hello"})])
    got = [(p.temperature, p.top_p, p.top_k, p.max_tokens) for p in engine.seen]
    assert got == [(1.0, 1.0, -1, 16), (0.3, 0.8, 5, 6)]


def test_a_folder_path_reads_that_folders_file(model_dir, tiny_target, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
    assert resolve(str(tmp_path), str(model_dir))[0] == SamplingDefaults(temperature=0.7)
    assert resolve("auto", str(tiny_target))[0] == SamplingDefaults()  # no file: the server's own
    with pytest.raises(SpecServeError, match="auto, vllm or a folder"):
        resolve(str(tmp_path / "nowhere"), str(model_dir))
    for bad in ({"temperature": 3}, {"top_p": 0}, {"top_k": 2.5}, {"max_new_tokens": 0}, {"temperature": "hot"}):
        (tmp_path / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(SpecServeError, match="unusable sampling defaults"):
            resolve(str(tmp_path), str(model_dir))


def test_the_default_alias_carries_its_model_cards_values():
    assert ALIASES[DEFAULT_MODEL].generation_config == {"temperature": 0.2, "top_p": 0.9}
    defaults, why = resolve("auto", DEFAULT_MODEL)
    assert defaults == SamplingDefaults(temperature=0.2, top_p=0.9) and "model card" in why


def test_requests_map_to_params_with_and_without_defaults():
    d = SamplingDefaults(temperature=0.2, top_p=0.9)
    p = CompletionRequest(prompt="x").to_sampling_params(d)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.2, 0.9, -1, 16)
    p = CompletionRequest(prompt="x", top_p=0.5).to_sampling_params()
    assert (p.temperature, p.top_p) == (1.0, 0.5)  # OpenAI's defaults without any
    p = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], temperature=1.5).to_sampling_params(
        10, 100, d)
    assert (p.temperature, p.top_p, p.max_tokens) == (1.5, 0.9, 90)


def test_serve_refuses_a_folder_without_the_file_before_loading_or_starting_replicas(tmp_path):
    def serve(*args):  # a process of its own: `serve` sets process-wide logging and metrics options
        proc = subprocess.run([sys.executable, "-m", "specserve", "serve", "--port", "0", *args],
                              capture_output=True, text=True, timeout=120)
        return proc.returncode, proc.stderr

    code, err = serve("--model", str(tmp_path), "--generation-config", str(tmp_path))
    assert code == 2 and "has none" in err and "generation_config.json" in err
    code, err = serve("--replicas", "2", "--generation-config", str(tmp_path))  # before Ray starts
    assert code == 2 and "has none" in err
