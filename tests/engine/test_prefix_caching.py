"""Prefix caching in the engine: a prompt that starts like an earlier one computes only what is new, and the
output is the same as without the cache: plain decoding and every speculation method, through preemption,
with EAGLE's target features coming back with the cached blocks."""
import random

import pytest

from specserve import LLM, SamplingParams
from tests.spec_decode.test_speculative_engine import METHODS, spec_config

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def conversations(n: int, seed: int = 0) -> list[list[int]]:
    """n prompts in waves that share a 37-token system prompt, half of them also a first turn of their own
    wave's predecessor: the second wave finds the first's blocks in the cache."""
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(37)]
    out = []
    for i in range(n):
        turn = [rng.randrange(256) for _ in range(rng.randint(5, 30))]
        out.append(system + (out[i - 1][37:] if i % 2 and out else []) + turn)
    return out


def run(llm: LLM, waves: list[list[list[int]]], params=GREEDY) -> tuple[list[list[int]], int, int]:
    """Generate wave after wave (a wave's requests at once); outputs, prompt tokens computed, cache hits."""
    engine, outs, computed, hits = llm.engine, [], 0, 0
    for w, wave in enumerate(waves):
        for i, prompt in enumerate(wave):
            engine.add_request(prompt, params, request_id=f"{w}-{i}")
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
            computed += engine.last_stats.num_prefill_tokens
            hits += engine.last_stats.prefix_cache_hits
        outs += [done[f"{w}-{i}"] for i in range(len(wave))]
    return outs, computed, hits


@pytest.fixture(scope="module")
def uncached(tiny_target):
    waves = [conversations(6, seed=1), conversations(6, seed=1)[::-1] + conversations(4, seed=2)]
    llm = LLM(model=str(tiny_target), dtype="float32", enable_prefix_caching=False)
    outs, computed, hits = run(llm, waves)
    assert hits == 0
    return waves, outs, computed


def test_cached_prefixes_are_not_computed_again_and_the_output_is_unchanged(tiny_target, uncached):
    waves, want, computed_without = uncached
    llm = LLM(model=str(tiny_target), dtype="float32")
    outs, computed, hits = run(llm, waves)
    assert outs == want
    assert hits >= 6 * 32  # the second wave's repeats: at least their system prompt's full blocks
    assert computed == computed_without - hits  # every hit is a prompt token not computed


@pytest.mark.parametrize("method", METHODS)
def test_speculation_over_cached_prefixes_stays_lossless(tiny_target, request, uncached, method):
    waves, want, _ = uncached
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config=spec_config(method, request, 4))
    outs, _, hits = run(llm, waves)
    assert hits > 0 and outs == want


def test_preemption_with_the_cache_recomputes_only_what_was_evicted(tiny_target, tiny_eagle, uncached):
    waves, want, _ = uncached
    llm = LLM(model=str(tiny_target), dtype="float32", num_kv_blocks=40, block_size=4, max_model_len=128,
              speculative_config={"method": "eagle", "model": str(tiny_eagle), "num_speculative_tokens": 4})
    outs, _, hits = run(llm, waves)
    assert llm.engine.scheduler.num_preemptions > 0 and hits > 0
    assert outs == want


def test_reset_prefix_cache_makes_the_next_request_compute_everything(tiny_target):
    llm = LLM(model=str(tiny_target), dtype="float32")
    prompt = conversations(1)[0]
    assert run(llm, [[prompt]])[2] == 0 and run(llm, [[prompt]])[2] > 0
    llm.reset_prefix_cache()
    assert run(llm, [[prompt]])[2] == 0


def test_requests_with_different_cache_salts_share_nothing(tiny_target):
    llm = LLM(model=str(tiny_target), dtype="float32")
    prompt = conversations(1)[0]
    salted = [SamplingParams(max_tokens=4, temperature=0, cache_salt=s) for s in ("a", "b", "a")]
    hits = []
    for i, params in enumerate(salted):
        _, _, hit = run(llm, [[prompt]], params)
        hits.append(hit)
    assert hits[0] == hits[1] == 0 and hits[2] == (len(prompt) - 1) // 16 * 16
