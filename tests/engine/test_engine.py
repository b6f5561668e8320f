"""Engine behaviour on a tiny random model (float32, so any difference is a bug, not rounding)."""
import random

import pytest

from specserve import LLM, SamplingParams
from specserve.errors import InvalidRequestError

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def prompts(n, seed=0, lo=3, hi=60):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def llm(tiny_target):
    return LLM(model=str(tiny_target), dtype="float32")


def test_batch_invariance_32_prompts_of_different_lengths(llm):
    ps = prompts(32)
    batched = [o.token_ids for o in llm.generate(ps, GREEDY)]
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in ps]
    assert batched == alone
    assert len({tuple(t) for t in alone}) > 16  # the prompts really lead to different outputs


def test_preemption_under_a_small_kv_budget_changes_nothing(tiny_target, llm):
    ps = prompts(12, seed=1, lo=20, hi=40)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(ps, params)]
    # 24 blocks of 4 = 96 slots; 12 requests of up to 80 tokens need far more, so the scheduler must preempt.
    small = LLM(model=str(tiny_target), dtype="float32", num_kv_blocks=24, block_size=4,
                max_model_len=96)
    got = small.generate(ps, params)
    assert [o.token_ids for o in got] == want
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.scheduler.blocks.num_free == 24


def test_abort_frees_every_block(tiny_target):
    llm = LLM(model=str(tiny_target), dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=128)
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True)) for p in prompts(6, seed=2)]
    for _ in range(3):
        engine.step()
    assert engine.scheduler.blocks.num_free < 64
    for i in ids:
        engine.abort(i)
    finals = engine.step()
    assert {o.request_id for o in finals if o.finished and o.finish_reason == "abort"} == set(ids)
    assert engine.scheduler.blocks.num_free == 64 and not engine.has_unfinished()


def test_stop_strings_including_ones_split_across_tokens(llm):
    p = [72, 101, 108, 108, 111]
    full = llm.generate([p], GREEDY)[0]
    pieces = [llm.tokenizer.decode([t]) for t in full.token_ids]
    # a stop string made of the end of token 5 and the start of token 6: it never appears in one token
    boundary = len("".join(pieces[:6]))
    stop = full.text[boundary - 1: boundary + 1]
    assert len(pieces[5]) >= 1 and len(pieces[6]) >= 1
    out = llm.generate([p], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:full.text.index(stop)]


def test_seeded_sampling_is_reproducible_across_batch_compositions(llm):
    sp = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    target = [10, 20, 30, 40]
    alone = llm.generate([target], sp)[0].token_ids
    others = prompts(9, seed=3)
    mixed = llm.generate(others[:4] + [target] + others[4:],
                         [SamplingParams(max_tokens=15, temperature=1.0, ignore_eos=True)] * 4 + [sp] +
                         [SamplingParams(max_tokens=9, temperature=0.5, ignore_eos=True)] * 5)
    assert mixed[4].token_ids == alone
    other_seed = llm.generate([target], SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50,
                                                       seed=99, ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_max_tokens_and_finish_reason(llm):
    outs = llm.generate(prompts(4, seed=4), SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
    assert all(len(o.token_ids) == 7 and o.finish_reason == "length" for o in outs)


def test_eos_stops_unless_ignored(llm):
    eos = llm.tokenizer.eos_token_ids[0]
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0, stop_token_ids=[]))[0]
    assert out.finish_reason == "length" or out.token_ids[-1] == eos
    forced = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0,
                                                      stop_token_ids=[out.token_ids[1]]))[0]
    assert forced.token_ids == out.token_ids[:2] and forced.finish_reason == "stop"
    assert forced.stop_reason == out.token_ids[1]


def test_overlong_prompt_is_rejected_with_both_numbers(tiny_target):
    llm = LLM(model=str(tiny_target), dtype="float32", max_model_len=64)
    with pytest.raises(InvalidRequestError, match=r"maximum context length is 64 tokens.*70 tokens \(60 in the prompt, 10"):
        llm.generate([[5] * 60], SamplingParams(max_tokens=10))


def test_chunked_prefill_equals_unchunked(tiny_target, llm):
    ps = prompts(6, seed=5, lo=40, hi=90)
    want = [o.token_ids for o in llm.generate(ps, GREEDY)]
    chunked = LLM(model=str(tiny_target), dtype="float32", max_num_batched_tokens=16)
    assert [o.token_ids for o in chunked.generate(ps, GREEDY)] == want


def test_bad_sampling_params_are_clear_errors():
    for kwargs, msg in [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
                        ({"top_p": 0}, "top_p"), ({"top_k": -3}, "top_k")]:
        with pytest.raises(InvalidRequestError, match=msg):
            SamplingParams(**kwargs)


def test_step_budget_default_depends_on_use(llm):
    """Offline generation (LLM, `specserve generate`) gets the throughput budget, `serve` the short-step one;
    a flag overrides it."""
    from specserve.cli import build_parser
    from specserve.engine.config import OFFLINE_MAX_NUM_BATCHED_TOKENS, SERVER_MAX_NUM_BATCHED_TOKENS
    assert OFFLINE_MAX_NUM_BATCHED_TOKENS > SERVER_MAX_NUM_BATCHED_TOKENS
    assert llm.engine.config.max_num_batched_tokens == OFFLINE_MAX_NUM_BATCHED_TOKENS
    parser = build_parser()
    assert parser.parse_args(["generate"]).max_num_batched_tokens == OFFLINE_MAX_NUM_BATCHED_TOKENS
    assert parser.parse_args(["serve"]).max_num_batched_tokens == SERVER_MAX_NUM_BATCHED_TOKENS
    assert parser.parse_args(["serve", "--max-num-batched-tokens", "64"]).max_num_batched_tokens == 64


def test_device_defaults_to_cuda_when_present_and_bad_devices_are_clear_errors(tiny_target):
    import torch

    from specserve.engine.config import EngineConfig
    from specserve.errors import SpecServeError
    assert EngineConfig(model=str(tiny_target)).device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert EngineConfig(model=str(tiny_target), device="cpu").device == "cpu"
    with pytest.raises(SpecServeError, match="unknown device 'tpu0'"):
        EngineConfig(model=str(tiny_target), device="tpu0")
    if not torch.cuda.is_available():
        with pytest.raises(SpecServeError, match="no CUDA GPU"):
            EngineConfig(model=str(tiny_target), device="cuda")


def test_step_cost_profile_is_cached_per_kernel_build(monkeypatch):
    """An edited kernel (another build) is profiled again instead of reusing the old build's step costs."""
    from types import SimpleNamespace

    import torch

    from specserve.engine import builder
    from specserve.engine.config import EngineConfig
    keys = []
    monkeypatch.setattr(builder.StepCostModel, "profile", lambda runner, drafts, rows, key: keys.append(key))
    runner = SimpleNamespace(device=torch.device("cpu"))
    target, config = SimpleNamespace(path="target"), EngineConfig(model="target")
    for build in ("specserve-kernels-aaaa", "specserve-kernels-aaaa", "specserve-kernels-bbbb"):
        monkeypatch.setattr(builder.cpu_kernels, "library_id", lambda build=build: build)
        builder.profile_step_costs(runner, None, config, target, [])
    assert keys[0] == keys[1] != keys[2]


def test_tpot_objectives_keep_the_cost_model_learning_without_speculation(tiny_target, llm):
    """The scheduler's TPOT admission reads the step cost model: with objectives (here the engine's
    --slo-tpot-ms) it learns from the steps even with no policy to observe them; without, nothing is profiled
    or observed (no host time spent on it)."""
    with_slo = LLM(model=str(tiny_target), dtype="float32", slo_tpot_ms=1000)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with_slo.generate([[5, 6, 7], [8, 9]], params)
    assert with_slo.engine.models.cost.observed > 0
    llm.generate([[5, 6, 7]], params)
    assert not llm.engine.models.has_cost
