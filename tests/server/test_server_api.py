"""The OpenAI API of a real server, driven with the official `openai` client (and httpx for raw checks).

"Correct text" is the offline engine's greedy output on the same model: the server runs speculative
decoding with a draft that accepts about half its tokens, which must not change a greedy output.
"""
import asyncio
import json

import httpx
import openai
import pytest
import torch

from specserve import SamplingParams
from specserve.benchmark.server_metrics import parse_prometheus
from tests.server.conftest import MODEL, greedy, wait_until


def test_startup_line_names_url_model_device_draft_and_kv_capacity(spec_server, tiny_draft):
    line = next(l for l in spec_server.log.splitlines() if "specserve serving" in l)
    assert spec_server.base_url in line and f"draft {tiny_draft} (k=3)" in line
    assert f"| {'cuda' if torch.cuda.is_available() else 'cpu'} float32 |" in line
    assert "model " in line and "KV cache " in line and " tokens (" in line


def test_completion_matches_offline_greedy_and_reports_speculation(client, reference):
    want = greedy(reference, "The quick brown fox", 40, ignore_eos=True)
    r = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=40, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].text == want.text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), 40)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 40
    spec = r.model_extra["speculative"]
    assert spec["num_drafts"] > 0 and 0 < spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"],
                                                           abs=1e-3)
    assert sum(spec["accepted_per_position"]) == spec["num_accepted_tokens"]


def test_token_id_prompt_and_alias_model_name(client, reference):
    ids = [72, 101, 108, 108, 111]
    want = greedy(reference, ids, 12, ignore_eos=True)
    r = client.completions.create(model="tiny-alias", prompt=ids, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text and r.model == "tiny-alias"


def test_chat_uses_the_model_chat_template(client, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello there"}]
    want = greedy(reference, messages, 24)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=24, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    # content given as a list of text parts renders the same
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "Hello there"}]}]
    r2 = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=24, temperature=0)
    assert r2.choices[0].message.content == want.text


def test_chat_stream_with_usage(client, reference):
    messages = [{"role": "user", "content": "Stream me something"}]
    want = greedy(reference, messages, 30, ignore_eos=True)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert finals[0].model_extra["speculative"]["num_drafts"] > 0
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 30
    assert last.usage.prompt_tokens == len(want.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])
    assert len(chunks) > 3  # really streamed, not one blob


def test_completion_stream_raw_sse_format(spec_server, reference):
    want = greedy(reference, "raw sse", 10, ignore_eos=True)
    body = {"model": MODEL, "prompt": "raw sse", "max_tokens": 10, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", spec_server.base_url + "/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = [l for l in resp.iter_lines() if l]
    assert all(l.startswith("data: ") for l in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(l[6:]) for l in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
    assert "usage" not in chunks[-1] and chunks[-1]["speculative"]["num_draft_tokens"] > 0


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(client, reference, stream):
    full = greedy(reference, "stop here", 60, ignore_eos=True).text
    # a two-character stop string from the middle of the text (printable, so the byte decoding is settled)
    i = next(i for i in range(10, len(full) - 2) if full[i:i + 2].isprintable() and full[i:i + 2].strip())
    stop = full[i:i + 2]
    r = client.completions.create(model=MODEL, prompt="stop here", max_tokens=60, temperature=0, stop=[stop, "\x00zz"],
                                  stream=stream, extra_body={"ignore_eos": True})
    if stream:
        chunks = list(r)
        text = "".join(c.choices[0].text for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        text, reason = r.choices[0].text, r.choices[0].finish_reason
    assert text == full[:full.find(stop)] and reason == "stop"


def test_seeds_reproduce_sampled_output(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=1.0,
                                         top_p=0.95, seed=seed, extra_body={"ignore_eos": True}).choices[0].text
    a, b, c = sample(7), sample(7), sample(8)
    assert a == b and a != c


def test_vllm_extras_top_k_and_min_tokens(client, reference):
    # top_k = 1 samples the argmax: the greedy text even at temperature 1
    want = greedy(reference, "extras", 16, ignore_eos=True)
    r = client.completions.create(model=MODEL, prompt="extras", max_tokens=16, temperature=1.0,
                                  extra_body={"top_k": 1, "ignore_eos": True, "min_tokens": 16})
    assert r.choices[0].text == want.text and r.usage.completion_tokens == 16


def test_completion_logprobs(client, reference):
    want = greedy(reference, "logprobs", 8, ignore_eos=True, logprobs=True)
    r = client.completions.create(model=MODEL, prompt="logprobs", max_tokens=8, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert len(lp.tokens) == 8 and [list(d.values())[0] for d in lp.top_logprobs] == lp.token_logprobs
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    streamed = list(client.completions.create(model=MODEL, prompt="logprobs", max_tokens=8, temperature=0,
                                              logprobs=0, stream=True, extra_body={"ignore_eos": True}))
    got = [x for c in streamed if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert got == pytest.approx(want.logprobs, abs=1e-4)
    offsets = [x for c in streamed if c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset  # a stream's offsets continue across chunks
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "lp"}], max_tokens=6,
                                          temperature=0, logprobs=True, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and all(c.logprob <= 0 and c.top_logprobs == [] for c in content)


def test_top_logprobs_are_the_targets_under_speculation(client, reference):
    """The speculating server's alternatives at each position equal plain offline decoding's: both endpoints,
    streamed and not."""
    want = greedy(reference, "top", 8, ignore_eos=True, logprobs=True, top_logprobs=3)
    def text(ids):  # a token's string as the server writes it
        return reference.tokenizer.decode(ids, skip_special_tokens=False)
    r = client.completions.create(model=MODEL, prompt="top", max_tokens=8, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    for got, chosen, lp_chosen, top in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs, want.top_logprobs):
        expected = {text([t]): v for t, v in top} | {chosen: lp_chosen}  # the three best and the chosen token
        assert got.keys() == expected.keys() and list(got.values()) == pytest.approx(list(expected.values()), abs=1e-4)
    assert all(len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1] for top in want.top_logprobs)
    assert [top[0][0] for top in want.top_logprobs] == want.token_ids  # greedy: the best is the chosen token
    chat_want = greedy(reference, [{"role": "user", "content": "top"}], 6, ignore_eos=True, logprobs=True,
                       top_logprobs=2)
    for stream in (False, True):
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "top"}],
                                              max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                                              stream=stream, extra_body={"ignore_eos": True})
        content = ([c for chunk in chat if chunk.choices and chunk.choices[0].logprobs
                    for c in chunk.choices[0].logprobs.content] if stream else chat.choices[0].logprobs.content)
        assert [[a.token for a in c.top_logprobs] for c in content] == [
            [text([t]) for t, _ in top] for top in chat_want.top_logprobs]
        assert [a.logprob for c in content for a in c.top_logprobs] == pytest.approx(
            [v for top in chat_want.top_logprobs for _, v in top], abs=1e-4)
    with pytest.raises(openai.BadRequestError):  # alternatives without logprobs
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "top"}], max_tokens=2,
                                       top_logprobs=2)


def test_penalties_give_the_offline_engines_penalised_output(client, reference):
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.3)
    want = greedy(reference, "penalties penalties", 16, ignore_eos=True, **penalties)
    assert want.text != greedy(reference, "penalties penalties", 16, ignore_eos=True).text
    r = client.completions.create(model=MODEL, prompt="penalties penalties", max_tokens=16, temperature=0,
                                  presence_penalty=0.5, frequency_penalty=0.5,
                                  extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    assert r.choices[0].text == want.text


def test_n_choices_streamed_and_not(client, reference):
    want = greedy(reference, "choices", 8, ignore_eos=True)
    r = client.completions.create(model=MODEL, prompt="choices", max_tokens=8, temperature=0, n=3,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.text == want.text for c in r.choices)
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(want.prompt_token_ids)
    one = client.completions.create(model=MODEL, prompt="choices", max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True}).model_extra["speculative"]
    # greedy choices draft and verify alike: the response's stats are three times one request's
    assert r.model_extra["speculative"]["num_drafts"] == 3 * one["num_drafts"] > 0
    assert r.model_extra["speculative"]["num_accepted_tokens"] == 3 * one["num_accepted_tokens"]
    messages = [{"role": "user", "content": "choices"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=12, temperature=1.0, seed=7, n=2,
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    texts = {0: "", 1: ""}
    usage = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
        usage = chunk.usage or usage
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]  # seeded: each choice reproduces
    assert texts[0] != texts[1]  # each choice draws with its own seed
    assert usage.completion_tokens == 24


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_structured_output_through_every_field(client, reference):
    """response_format (json_schema, json_object), vLLM's structured_outputs and guided_* fields, streamed and
    not: the speculating server's greedy output is the offline engine's under the same grammar, and valid."""
    import jsonschema
    from specserve.structured_output.params import StructuredOutputsParams as Guide
    messages = [{"role": "user", "content": "A person as JSON"}]
    prompt = reference.tokenizer.encode_chat(messages)
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                     "strict": True}}}, Guide(json=json.dumps(PERSON))),
        ({"response_format": {"type": "json_object"}}, Guide(json_object=True)),
        ({"extra_body": {"guided_regex": "[a-f]{3,9}"}}, Guide(regex="[a-f]{3,9}")),
        ({"extra_body": {"guided_choice": ["cat", "dog"]}}, Guide(choice=("cat", "dog"))),
        ({"extra_body": {"structured_outputs": {"grammar": 'start: "n=" /[0-9]+/'}}}, Guide(grammar='start: "n=" /[0-9]+/')),
    ]
    for kwargs, guide in cases:
        want = reference.generate([prompt], SamplingParams(max_tokens=48, temperature=0, structured_outputs=guide))[0]
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0, **kwargs)
        assert r.choices[0].message.content == want.text, kwargs
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=48, temperature=0, stream=True, **kwargs) if c.choices)
        assert streamed == want.text
        if r.choices[0].finish_reason == "stop" and guide.json is not None:
            jsonschema.validate(json.loads(want.text), PERSON)
    r = client.completions.create(model=MODEL, prompt="yes or no?", max_tokens=8, temperature=1.0, seed=3, n=4,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert all(c.text in ("yes", "no") for c in r.choices)


def test_echo_and_prompt_logprobs(client, reference):
    """completions' echo (the prompt before the completion, its tokens with logprobs after the first) and
    vLLM's prompt_logprobs, equal to the offline engine's, streamed and not."""
    prompt = "echo the prompt back"
    want = reference.generate([prompt], SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=2,
                                                       ignore_eos=True))[0]
    ids = want.prompt_token_ids
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=2,
                                  extra_body={"ignore_eos": True, "prompt_logprobs": 2})
    c = r.choices[0]
    assert c.text == prompt + want.text
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 5 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(want.prompt_logprobs[p][ids[p]][0], abs=1e-4)
    served = c.model_extra["prompt_logprobs"]
    assert served[0] is None and len(served) == len(ids)
    assert {int(t) for t in served[1]} == set(want.prompt_logprobs[1])
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                       logprobs=2, stream=True, extra_body={"ignore_eos": True})
    chunks = [ch.choices[0] for ch in stream if ch.choices]
    assert "".join(ch.text for ch in chunks) == c.text
    assert sum(len(ch.logprobs.tokens) for ch in chunks) == len(lp.tokens)


def test_n_choices_share_the_prompts_kv(client, spec_server):
    """The other choices start once the first has prefilled the prompt: they read its blocks from the cache."""
    prompt = "a prompt long enough to fill several KV cache blocks of sixteen tokens each " * 3
    before = parse_prometheus(httpx.get(spec_server.root + "/metrics").text)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=1.0, n=4, seed=1,
                                  extra_body={"cache_salt": "n-choices"})  # a salt of its own: a cold cache
    after = parse_prometheus(httpx.get(spec_server.root + "/metrics").text)
    full = r.usage.prompt_tokens // 16 * 16
    # each of the 3 others finds the prompt's full blocks (the one holding the last prompt token, perhaps not)
    assert full >= 48 and after["prefix_cache_hits"] - before["prefix_cache_hits"] >= 3 * (full - 16)


def test_models_health_and_unknown_model(client, spec_server):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny", "tiny-alias"] and models[0].model_extra["max_model_len"] == 1024
    assert client.models.retrieve("tiny").id == "tiny"
    assert httpx.get(spec_server.root + "/health").json() == {"status": "ok"}


def test_a_repeated_system_prompt_comes_from_the_prefix_cache_within_its_salt(client, spec_server):
    system = {"role": "system", "content": "You answer in one short sentence. " * 12}

    def hits(question: str, **extra) -> tuple[float, float]:
        before = parse_prometheus(httpx.get(spec_server.root + "/metrics").text)
        client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": question}],
                                       max_tokens=2, temperature=0, extra_body=extra)
        after = parse_prometheus(httpx.get(spec_server.root + "/metrics").text)
        return (after["prefix_cache_hits"] - before["prefix_cache_hits"],
                after["prefix_cache_queries"] - before["prefix_cache_queries"])

    hits("Why is the sky blue?", cache_salt="tenant-a")
    found, asked = hits("What is a CPU?", cache_salt="tenant-a")
    assert asked > 100 and found >= 96  # the system prompt's full blocks, at least
    assert hits("What is a CPU?", cache_salt="tenant-b")[0] == 0  # another tenant's cache is not its own
    with pytest.raises(openai.BadRequestError):
        hits("What is a CPU?", cache_salt="")


def test_metrics_expose_vllm_style_names_and_match_responses(client, spec_server):
    before = parse_prometheus(httpx.get(spec_server.root + "/metrics").text)
    per_response = [client.completions.create(model=MODEL, prompt=f"metrics {i}", max_tokens=20, temperature=0,
                                              extra_body={"ignore_eos": True}).model_extra["speculative"]
                    for i in range(3)]
    after = parse_prometheus(httpx.get(spec_server.root + "/metrics").text)
    # the benchmark client reads these counters; they must agree with the per-response stats
    assert after["spec_drafts"] - before["spec_drafts"] == sum(s["num_drafts"] for s in per_response)
    assert after["spec_accepted_tokens"] - before["spec_accepted_tokens"] == sum(
        s["num_accepted_tokens"] for s in per_response)
    assert after["spec_draft_tokens"] - before["spec_draft_tokens"] == sum(s["num_draft_tokens"] for s in per_response)
    assert "preemptions" in after
    text = httpx.get(spec_server.root + "/metrics").text
    for name in ("request_success_total{", "num_requests_running{", "num_requests_waiting{", "kv_cache_usage_perc{",
                 "time_to_first_token_seconds_bucket{", "time_per_output_token_seconds_bucket{",
                 "inter_token_latency_seconds_bucket{", "e2e_request_latency_seconds_bucket{",
                 "request_queue_time_seconds_bucket{", "prompt_tokens_total{", "generation_tokens_total{",
                 "spec_decode_num_accepted_tokens_per_pos_total{", "spec_decode_draft_length_bucket{",
                 "spec_decode_step_draft_length_bucket{", "num_preemptions_total{", "prefix_cache_queries_total{",
                 "prefix_cache_hits_total{"):
        assert "specserve:" + name in text, name
    assert 'position="0"' in text and 'finished_reason="length"' in text
    assert "_created" not in text


def test_50_concurrent_streaming_clients_get_correct_text(spec_server, reference):
    n = 50
    prompts = [f"Client {i} says hi" for i in range(n)]
    messages = [[{"role": "user", "content": f"Chat client {i}"}] for i in range(n)]
    lengths = [8 + (i * 7) % 40 for i in range(n)]
    # half completions, half chat; each compared with the offline greedy output for the same input
    want = [o.text for o in greedy(reference, [prompts[i] if i % 2 else messages[i] for i in range(n)],
                                   lengths, ignore_eos=True)]

    async def one(c, i):
        kw = dict(model=MODEL, max_tokens=lengths[i], temperature=0, stream=True,
                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        if i % 2:
            stream = await c.completions.create(prompt=prompts[i], **kw)
            pieces = [ch.choices[0].text async for ch in stream if ch.choices]
        else:
            stream = await c.chat.completions.create(messages=messages[i], **kw)
            pieces = []
            async for ch in stream:
                if ch.choices:
                    pieces.append(ch.choices[0].delta.content or "")
                else:
                    usage = ch.usage
            assert usage.completion_tokens == lengths[i]
        return "".join(pieces)

    async def main():
        async with openai.AsyncOpenAI(base_url=spec_server.base_url, api_key="unused", max_retries=0,
                                      timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(n)))

    got = asyncio.run(main())
    assert [i for i in range(n) if got[i] != want[i]] == []
    assert wait_until(lambda: spec_server.metric("specserve:num_requests_running") == 0, timeout=10)


def _kv_free(server) -> bool:
    return (server.metric("specserve:kv_cache_usage_perc") == 0
            and server.metric("specserve:num_requests_running") == 0)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request_and_frees_its_kv(paced_server, stream):
    server = paced_server
    aborts = server.metric("specserve:request_success_total", finished_reason="abort")
    # a paced engine: 1000 tokens take >= 1000 * PACE_S / (k + 1) (5 s) on any machine: the client leaves first
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if stream:
        with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()  # kept: dropping a half-read iterator would close the connection already
            first = next(l for l in lines if l.startswith("data: "))
            assert json.loads(first[6:])["choices"]
            assert server.metric("specserve:kv_cache_usage_perc") > 0  # it is still generating
        # leaving the `with` closes the connection mid-stream
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.base_url + "/completions", json=body, timeout=httpx.Timeout(30, read=0.05))
    assert wait_until(lambda: _kv_free(server), timeout=20)
    assert server.metric("specserve:request_success_total", finished_reason="abort") == aborts + 1
