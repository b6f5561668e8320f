"""vLLM's prompt_logprobs: each prompt token's raw log-probability and rank under the target, with the most
likely tokens at its position, the same whether the prompt is prefilled in one chunk or several, under
speculation or not, and when the prompt is in the prefix cache (such requests skip it)."""
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.errors import InvalidRequestError
from tests.spec_decode.test_speculative_engine import prompts


def causal_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """[n, V] log-probabilities of the token after each position, from one causal pass."""
    from specserve.model.attention import AttentionMetadata, allocate_kv_cache
    c, device = model.config, model.embed_tokens.weight.device
    blocks = len(tokens) // 16 + 1
    cache = allocate_kv_cache(c.num_hidden_layers, blocks, 16, c.num_key_value_heads, c.head_dim, torch.float32, device)
    meta = AttentionMetadata.build([len(tokens)], [len(tokens)], [list(range(blocks))], 16, device)
    with torch.no_grad():
        return torch.log_softmax(model.compute_logits(model(torch.tensor(tokens, device=device), meta, cache)), -1)


@pytest.mark.parametrize("budget,spec", [(2048, False), (16, False), (16, True)])
def test_prompt_logprobs_are_the_targets(tiny_target, tiny_draft, budget, spec):
    config = {"model": str(tiny_draft), "num_speculative_tokens": 3} if spec else None
    llm = LLM(model=str(tiny_target), dtype="float32", max_num_batched_tokens=budget, speculative_config=config)
    prompt = max(prompts(12, seed=5), key=len)
    plain = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0))[0]
    # twice: the second finds the prompt in the prefix cache, which a prompt_logprobs request must not use
    outs = llm.generate([prompt, prompt], SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=3))
    ref = causal_logprobs(llm.engine.runner.model, prompt)
    for out in outs:
        assert out.token_ids == plain.token_ids
        got = out.prompt_logprobs
        assert got[0] is None and len(got) == len(prompt)
        for p in range(1, len(prompt)):
            row, token = ref[p - 1], prompt[p]
            logprob, rank = got[p][token]
            assert logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert rank == int((row > row[token]).sum()) + 1
            top = row.topk(3)
            for i, (t, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist())):
                assert got[p][t][0] == pytest.approx(lp, abs=1e-4) and (t == token or got[p][t][1] == i + 1)


def test_prompt_logprobs_are_checked():
    with pytest.raises(InvalidRequestError):
        SamplingParams(prompt_logprobs=21)
