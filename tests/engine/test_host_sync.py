"""A step reads device results once: every tensor -> Python conversion in the engine goes through
device_sync.to_host, once per step, for greedy and sampled requests, drafts and logprobs alike, under every
speculation policy. (On a GPU
each such read waits for all queued work; on the CPU we count the calls that would.)"""
import sys

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve import device_sync
from specserve.spec_decode.policies import POLICIES
from tests.spec_decode.policy_fixtures import BUILT_IN, cheap_drafts
from tests.spec_decode.test_speculative_engine import prompts

CONVERSIONS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy")


@pytest.fixture
def conversions(monkeypatch):
    """Counts tensor -> Python conversions made outside device_sync.to_host."""
    seen = []
    for name in CONVERSIONS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if not caller.endswith("device_sync.py"):
                seen.append((_name, caller, sys._getframe(1).f_lineno))
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return seen


def assert_one_read_per_step(engine, conversions, spec):
    kinds = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, top_k=20, seed=1, ignore_eos=True),
             SamplingParams(max_tokens=40, temperature=0, logprobs=True, ignore_eos=True)]
    for i, p in enumerate(prompts(9, seed=11)):
        engine.add_request(p, kinds[i % 3])
    while engine.scheduler.waiting or any(s.in_prefill for s in engine.scheduler.running):
        engine.step()
    conversions.clear()
    before, steps, drafted = device_sync.transfers, 0, 0
    for _ in range(5):
        engine.step()
        steps += 1
        assert engine.last_stats.num_decodes == 9
        drafted += sum(engine.last_stats.draft_lengths)
    assert conversions == []
    assert device_sync.transfers - before == steps
    return drafted


@pytest.mark.parametrize("spec", [None, "draft", "ngram"])
def test_one_device_to_host_transfer_per_step(tiny_target, tiny_draft, spec, conversions):
    config = {"draft": {"model": str(tiny_draft), "num_speculative_tokens": 3},
              "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}}.get(spec)
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config=config)
    drafted = assert_one_read_per_step(llm.engine, conversions, spec)
    assert drafted or spec != "draft"


@pytest.mark.parametrize("name,options", BUILT_IN, ids=[b[0] for b in BUILT_IN])
def test_every_policy_keeps_one_transfer_per_step(tiny_target, tiny_draft, name, options, conversions):
    """With the draft model and prompt lookup, under each registered policy (the server's adaptive default
    included), drafting and planning read nothing from the device: the sampler's read is the step's only."""
    assert sorted(n for n in POLICIES if not n.startswith("test_")) == sorted(n for n, _ in BUILT_IN)
    if name == "batch_table":  # 9 running: a table that still drafts there
        options = {"table": [[1, 3], [16, 1]]}
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config={
        "model": str(tiny_draft), "num_speculative_tokens": 3, "ngram_first": True, "policy": name,
        "policy_options": options})
    if llm.engine.models.has_cost:  # drafts priced cheap, so that the model-based policies draft here too
        llm.engine.models._cost = cheap_drafts(llm)
    drafted = assert_one_read_per_step(llm.engine, conversions, name)
    assert drafted or name == "off"
