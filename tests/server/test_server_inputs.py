"""What a vLLM user sends besides sampling fields, through the official client (and httpx for vLLM's own
routes): prompt lists in /v1/completions, /tokenize, /detokenize and /version, and vLLM's output and template
options."""
import httpx
import openai
import pytest

from tests.server.conftest import MODEL, greedy


def test_a_list_of_prompts_gets_n_choices_each_numbered_as_openai_does(client, reference):
    prompts = ["The quick brown fox", "Hello", [72, 101, 108, 108, 111, 32, 119]]
    for group in (prompts[:2], [prompts[2], [65, 66]]):  # texts, or token-id lists
        want = greedy(reference, group, 10, ignore_eos=True)
        r = client.completions.create(model=MODEL, prompt=group, n=2, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        assert [c.text for c in r.choices] == [w.text for w in want for _ in range(2)]  # prompt i, choice j: i*2+j
        assert r.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)  # each prompt counted once
        assert r.usage.completion_tokens == 40
        texts, usage = {}, None
        for chunk in client.completions.create(model=MODEL, prompt=group, n=2, max_tokens=10, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
            usage = chunk.usage or usage
        assert [texts[i] for i in range(4)] == [c.text for c in r.choices] and usage == r.usage
    echoed = client.completions.create(model=MODEL, prompt=prompts[:2], max_tokens=3, temperature=0, echo=True)
    assert [c.text[:len(p)] for c, p in zip(echoed.choices, prompts[:2])] == prompts[:2]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=["fine", ""], max_tokens=3)
    assert "prompt 1 is empty" in e.value.message


def test_tokenize_and_detokenize(spec_server, reference):
    root = spec_server.root
    r = httpx.post(root + "/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == reference.tokenizer.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 1024 and "".join(body["token_strs"]) == "HelloĠworld"  # the vocabulary's strings
    assert httpx.post(root + "/detokenize", json={"model": MODEL, "tokens": body["tokens"]}).json() == {
        "prompt": "Hello world"}
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(root + "/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == reference.tokenizer.encode_chat(messages) and chat["token_strs"] is None
    bare = httpx.post(root + "/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert bare["tokens"] == reference.tokenizer.encode_chat(messages, add_generation_prompt=False)
    for path, body, param in [("/tokenize", {"prompt": "x", "messages": messages}, "prompt"),
                              ("/tokenize", {}, "prompt"),
                              ("/detokenize", {"tokens": [1, 260]}, "tokens"),
                              ("/tokenize", {"model": "other", "prompt": "x"}, "model")]:
        r = httpx.post(root + path, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
    assert httpx.get(root + "/version").json()["version"]


def test_tokenizer_routes_are_behind_the_api_key(keyed_server):
    r = httpx.post(keyed_server.root + "/tokenize", json={"prompt": "x"})
    assert r.status_code == 401
    r = httpx.post(keyed_server.root + "/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer sekret"})
    assert r.json()["count"] == 1


def test_include_stop_str_and_tokens_as_ids(client, reference):
    want = greedy(reference, "The quick brown fox", 30, ignore_eos=True)
    stop = want.text[5:8]
    r = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=30, temperature=0, stop=[stop],
                                  logprobs=0, extra_body={"include_stop_str_in_output": True,
                                                          "return_tokens_as_token_ids": True})
    assert r.choices[0].text == want.text[:want.text.index(stop) + len(stop)]
    assert r.choices[0].logprobs.tokens[0] == f"token_id:{want.token_ids[0]}"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=30, temperature=0, stop=[stop], stream=True,
        extra_body={"include_stop_str_in_output": True}))
    assert streamed == r.choices[0].text


def test_continue_final_message(client, reference):
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "One, two,"}]
    ids = reference.tokenizer.encode(reference.tokenizer.apply_chat_template(messages, False).rstrip("\n"),
                                     add_special_tokens=False)
    want = greedy(reference, ids, 8, ignore_eos=True)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                   "ignore_eos": True})
    assert r.choices[0].message.content == want.text and r.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as e:  # vLLM's rule: not with a generation prompt
        client.chat.completions.create(model=MODEL, messages=messages, extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "continue_final_message"


@pytest.mark.parametrize("extra, param, advice", [
    ({"logit_bias": {"5": 10}}, "logit_bias", "structured_outputs"),
    ({"min_p": 0.1}, "min_p", "top_p or top_k"),
    ({"suffix": "end"}, "suffix", "fill-in-the-middle"),
    ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "stream_options",
     "last chunk"),
    ({"priority": 3}, "priority", "slo_ttft_ms"),
])
def test_what_is_refused_says_what_to_do_instead(client, extra, param, advice):
    body = dict(extra)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                  **{k: body.pop(k) for k in ("logit_bias", "suffix", "stream", "stream_options")
                                     if k in body}, extra_body=body)
    assert e.value.body["param"] == param and advice in e.value.message


def test_fields_that_do_not_change_the_output_are_accepted(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       store=False, metadata={"k": "v"}, user="u", service_tier="auto",
                                       prompt_cache_key="k", safety_identifier="s", reasoning_effort="low",
                                       prediction={"type": "content", "content": "hello"},
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.completion_tokens == 2
