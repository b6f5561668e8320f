"""The EAGLE proposer reads exactly the target's hidden states: row j of the draft gets f_{j-1}, through
chunked prefill, speculation, rollback and preemption. (Losslessness: test_speculative_engine.py.)"""
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.errors import SpecServeError
from specserve.spec_decode.eagle import EagleProposer
from tests.spec_decode.test_speculative_engine import prompts


@pytest.mark.parametrize("small_kv,shared", [(False, False), (True, False), (False, True), (True, True)])
def test_draft_rows_read_the_targets_hidden_state_of_the_previous_position(tiny_target, tiny_eagle, small_kv,
                                                                           shared, monkeypatch):
    """`shared`: prompts that share prefixes, so that later ones take the earlier ones' blocks from the
    prefix cache and their features with them."""
    from tests.engine.test_prefix_caching import conversations
    from specserve.distill.student import causal_forward
    seen = []  # (tokens so far, first position read, rows read)
    pending = EagleProposer._pending_features

    def recording(self, seq):
        first = self.drafter.computed.get(seq.request_id, 0) - 1
        rows = pending(self, seq)
        seen.append((list(seq.token_ids), first, rows.clone()))
        return rows

    monkeypatch.setattr(EagleProposer, "_pending_features", recording)
    kw = dict(num_kv_blocks=40, block_size=4, max_model_len=128, max_num_seqs=16) if small_kv else {}
    llm = LLM(model=str(tiny_target), dtype="float32", max_num_batched_tokens=32,  # chunked prefill
              speculative_config={"method": "eagle", "model": str(tiny_eagle), "num_speculative_tokens": 4}, **kw)
    hits = []
    llm.engine.step = lambda step=llm.engine.step: (step(), hits.append(llm.engine.last_stats.prefix_cache_hits))[0]
    outs = llm.generate(conversations(40, seed=3) if shared else prompts(40, seed=3),
                        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    if small_kv:
        assert llm.engine.scheduler.num_preemptions > 0
    assert sum(hits) > 0 or not (shared or small_kv)  # a preempted request finds its own blocks again
    assert sum(o.spec["num_accepted_tokens"] for o in outs) > 50 and len(seen) > 100
    target = llm.engine.runner.model
    device = target.embed_tokens.weight.device
    for tokens, first, rows in seen:
        hidden = causal_forward(target, torch.tensor([tokens], device=device))[0, :len(tokens) - 1]  # f_0 .. f_{L-2}
        want = torch.cat([hidden.new_zeros(1, hidden.shape[1]), hidden])  # f_{-1} = 0: the row of position 0
        assert len(rows) == len(tokens) - 1 - first  # rows for positions first .. L-2
        torch.testing.assert_close(rows, want[first + 1:], atol=1e-4, rtol=1e-4)


def test_eagle_configuration_errors(tiny_target, tiny_draft, tiny_eagle, tmp_path):
    with pytest.raises(SpecServeError, match="needs an EAGLE draft"):
        LLM(model=str(tiny_target), speculative_config={"method": "eagle", "model": str(tiny_draft)})
    with pytest.raises(SpecServeError, match='needs "model"'):
        LLM(model=str(tiny_target), speculative_config={"method": "eagle"})
    from tests.tiny_models import make_tiny_model
    wide = make_tiny_model(tmp_path / "wide", seed=2, hidden=96, heads=6, kv_heads=2)
    with pytest.raises(SpecServeError, match="hidden states of width 64"):
        LLM(model=str(wide), speculative_config={"method": "eagle", "model": str(tiny_eagle)})
    # "draft_model" with an EAGLE directory runs it as an EAGLE draft.
    llm = LLM(model=str(tiny_target), speculative_config={"model": str(tiny_eagle), "num_speculative_tokens": 2})
    assert isinstance(llm.engine.proposer, EagleProposer)
