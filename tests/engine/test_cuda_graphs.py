"""CUDA graphs (engine/cuda_graphs.py) against the eager step: the same logits, the same cache, the same greedy
text with and without speculation. Needs a CUDA GPU with Triton; skipped elsewhere (the CPU CI)."""
import pytest
import torch

from specserve.step_types import ForwardItem
from specserve.engine.llm import LLM
from specserve.engine.model_runner import ModelRunner
from specserve.engine.sampling_params import SamplingParams
from specserve.model import gpu_attention
from specserve.model.loader import load_model

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and gpu_attention.triton is not None),
                                reason="needs a CUDA GPU with Triton")


def runners(path):
    pair = []
    for eager in (True, False):
        model = load_model(str(path), "float32", "cuda").model
        pair.append(ModelRunner(model, num_blocks=64, block_size=16, max_model_len=512, enforce_eager=eager))
    return pair


@pytest.mark.parametrize("steps", [
    # each step: (host tokens, drafts on the device, ctx_len, logits wanted) per sequence
    [[(5, 0, 5, 1), (3, 0, 3, 1)], [(1, 0, 6, 1), (1, 0, 4, 1)]],                 # prefill, then decodes
    [[(20, 0, 20, 1)], [(1, 4, 25, 5)], [(1, 2, 28, 3)]],                          # verifies with device drafts
    [[(40, 0, 40, 0)], [(30, 0, 70, 1), (1, 0, 1, 1)], [(1, 3, 74, 4), (1, 0, 2, 1)]],  # prefill pieces, mixed
    [[(300, 0, 300, 1), (250, 0, 250, 1)], [(1, 0, 301, 1), (1, 3, 254, 4)]],       # 550 tokens: two replays
])
def test_graph_forward_matches_eager(tiny_target, steps):
    eager, graphed = runners(tiny_target)
    assert graphed.graphs is not None and eager.graphs is None
    calls, replays = [], []
    forward, replay = graphed.graphs.forward, graphed.graphs._replay
    graphed.graphs.forward = lambda *args: calls.append(args) or forward(*args)
    graphed.graphs._replay = lambda *args: replays.append(args) or replay(*args)
    torch.manual_seed(0)
    blocks = torch.randperm(63).tolist()
    tables = [blocks[:24], blocks[24:48]]
    for step in steps:
        items, drafts = [], []
        for i, (host, on_device, ctx, logits) in enumerate(step):
            items.append(ForwardItem(torch.randint(0, 250, (host,)).tolist(), ctx, tables[i], logits, on_device))
            drafts.append(torch.randint(0, 250, (on_device,)))
        device_ids = torch.cat(drafts).cuda() if any(len(d) for d in drafts) else None
        want_logits, want_hidden = eager.forward(items, device_ids=device_ids)
        got_logits, got_hidden = graphed.forward(items, device_ids=device_ids)
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_hidden, want_hidden, rtol=1e-5, atol=1e-5)
        used = sorted({b for t in tables for b in t})
        torch.testing.assert_close(graphed.kv_cache[:, :, used], eager.kv_cache[:, :, used])
    assert len(calls) == len(steps)  # every step replayed graphs, prefill chunks too (in pieces)
    assert len(replays) == len(steps) + (sum(it[0] for it in steps[0]) > 512)  # past 512 tokens: two


def test_greedy_identity_with_graphs_and_speculation(tiny_target):
    prompts = [[258] + list(range(10 + i, 40 + 3 * i)) for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    texts = []
    for eager, spec in [(True, None), (False, None), (False, '{"method": "ngram", "num_speculative_tokens": 4}')]:
        llm = LLM(str(tiny_target), dtype="float32", device="cuda", enforce_eager=eager, speculative_config=spec)
        texts.append([o.token_ids for o in llm.generate(prompts, params)])
        del llm
    assert texts[1] == texts[0]
    assert texts[2] == texts[0]
