"""Table-driven cases for the scheduler: budgets, admission, preemption, and the clamps it applies to
whatever a speculation policy asks for."""
import pytest

from specserve.engine.block_manager import BlockManager
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.engine.sequence import Sequence, Status


def seq(rid, prompt_len, max_tokens=32, output=0):
    s = Sequence(str(rid), list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, temperature=0))
    s.token_ids += [7] * output
    return s


def running(sched, s):
    """Put s in the batch as a decode: its prompt (and output but the last token) already in the KV cache."""
    sched.waiting.remove(s) if s in sched.waiting else None
    s.status = Status.RUNNING
    sched.blocks.grow(s.block_table, len(s.token_ids) - 1)
    s.num_computed = len(s.token_ids) - 1
    sched.running.append(s)


class Asks:
    """A policy that asks for fixed lengths (the clamps are the scheduler's business)."""
    may_draft = True

    def __init__(self, *lengths):
        self.lengths = list(lengths)

    def plan(self, batch):
        self.seen = batch
        return self.lengths[:len(batch)]


def test_decodes_come_first_then_prefill_chunks_within_the_budget():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10, max_model_len=200)
    a, b = seq(0, 5, output=1), seq(1, 30)
    sched.add(a), sched.add(b)
    running(sched, a)
    plan = sched.schedule()
    assert [(s.seq, s.num_tokens) for s in plan.decodes] == [(a, 1)]
    assert [(s.seq, s.num_tokens) for s in plan.prefills] == [(b, 9)]  # chunked to what the budget leaves


def test_admission_stops_at_max_num_seqs():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100, max_model_len=200)
    for i in range(3):
        sched.add(seq(i, 5))
    plan = sched.schedule()
    assert [s.seq.request_id for s in plan.prefills] == ["0", "1"] and len(sched.waiting) == 1


def test_a_full_cache_preempts_the_latest_admitted_request():
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=8, max_num_batched_tokens=100, max_model_len=200)
    a, b = seq(0, 8, output=1), seq(1, 8, output=1)  # 8 cached tokens each: all 4 blocks
    for s in (a, b):
        sched.add(s)
        running(sched, s)
    plan = sched.schedule()  # a's next token needs a fifth block: b makes room
    assert [s.seq for s in plan.decodes] == [a] and plan.preempted == [b]
    assert b.status == Status.WAITING and b.num_computed == 0 and sched.num_preemptions == 1


CLAMPS = [
    # (name, asked, max_drafts, max_tokens, budget, kv blocks, expected lengths); two decodes, block size 4,
    # contexts of 8 tokens (7 cached + 1 new, so each decode's own token fits in its 2 held blocks)
    ("the policy's choice stands when it fits", [3, 1], 4, 32, 100, 64, [3, 1]),
    ("at most the configured ceiling", [9, 2], 4, 32, 100, 64, [4, 2]),
    ("never negative", [-2, 1], 4, 32, 100, 64, [0, 1]),
    ("no more than can still be committed", [4, 4], 4, 3, 100, 64, [1, 1]),  # 1 output, 2 left: 1 draft
    ("within the token budget, in batch order", [4, 4], 4, 32, 7, 64, [4, 1]),
    ("within the free KV slots, without preempting", [4, 4], 4, 32, 100, 5, [4, 0]),
]


@pytest.mark.parametrize("name,asked,ceiling,max_tokens,budget,blocks,want", CLAMPS, ids=[c[0] for c in CLAMPS])
def test_draft_lengths_are_clamped_after_the_policy(name, asked, ceiling, max_tokens, budget, blocks, want):
    sched = Scheduler(BlockManager(blocks, 4), max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=200,
                      max_drafts=ceiling)
    decodes = [seq(i, 7, max_tokens=max_tokens, output=1) for i in range(2)]
    for s in decodes:
        sched.add(s)
        running(sched, s)
    policy = Asks(*asked)
    plan = sched.schedule(policy)
    assert [s.max_drafts for s in plan.decodes] == want
    assert not plan.preempted
    for s in plan.decodes:  # the KV slots of the granted drafts are reserved
        assert len(s.seq.block_table) * 4 >= s.seq.num_computed + 1 + s.max_drafts
    view = policy.seen
    assert [r.request_id for r in view.requests] == ["0", "1"]
    assert [r.context_len for r in view.requests] == [8, 8]
    assert [r.tokens_left for r in view.requests] == [max_tokens - 1] * 2
    assert view.max_drafts == ceiling and view.token_budget == budget - 2


def test_max_model_len_also_bounds_drafts():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=100, max_model_len=10,
                      max_drafts=8)
    s = seq(0, 7, output=1)  # 8 tokens of 10: two more can be committed, so one draft
    sched.add(s)
    running(sched, s)
    assert [d.max_drafts for d in sched.schedule(Asks(8)).decodes] == [1]


def test_the_proposer_is_asked_before_planning_what_it_would_draft_with():
    """With a peek hook the policy sees, per request, the draft that will serve it this step and the most it
    can offer (a prompt-lookup hit of 2 tokens), and the scheduler cuts the plan to that offer."""
    offers = {"0": ("ngram", 2), "1": ("eagle", 4)}
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=100, max_model_len=200,
                      max_drafts=4, peek=lambda s, k: offers[s.request_id])
    for i in range(2):
        s = seq(i, 7, output=1)
        sched.add(s)
        running(sched, s)
    policy = Asks(4, 4)
    assert [s.max_drafts for s in sched.schedule(policy).decodes] == [2, 4]
    assert [(r.draft, r.max_drafts) for r in policy.seen.requests] == [("ngram", 2), ("eagle", 4)]
