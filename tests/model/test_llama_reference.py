"""Our logits equal transformers' for prefill, token-by-token decode and a ragged mixed batch, with short
queries through torch ops and through the C kernel."""
import random

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from specserve.model.kernels import short_attention_supported
from tests.model.helpers import new_cache, reference_pair, run_step

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
             max_position_embeddings=512)
CONFIGS = {
    "llama-gqa-tied": LlamaConfig(**SMALL, num_attention_heads=8, num_key_value_heads=2,
                                  tie_word_embeddings=True, rope_theta=10000.0),
    "llama3-rope-scaling": LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=4,
                                       tie_word_embeddings=False, rope_theta=500000.0,
                                       rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 64}),
    "qwen2-bias": Qwen2Config(**SMALL, num_attention_heads=4, num_key_value_heads=2,
                              tie_word_embeddings=False, use_sliding_window=False),
    "mistral-window": MistralConfig(**SMALL, num_attention_heads=4, num_key_value_heads=1,
                                    sliding_window=7),
}
for name, cfg in CONFIGS.items():
    cfg.architectures = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                          "mistral": "MistralForCausalLM"}[cfg.model_type]]
    cfg._attn_implementation = "eager"
TOL = 1e-4


@pytest.fixture(params=list(CONFIGS), scope="module")
def pair(request):
    return reference_pair(CONFIGS[request.param])


@pytest.fixture(params=["torch-ops", "c-kernel"])
def kernel(request):
    if request.param == "c-kernel" and not short_attention_supported(torch.float32, torch.device("cpu")):
        pytest.skip("no C compiler: the kernel path cannot run here")
    return request.param == "c-kernel"


def reference_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


def test_prefill(pair):
    ref, ours = pair
    ids = random.Random(0).choices(range(256), k=37)
    got = run_step(ours, new_cache(ours, 8, 8), [(0, ids, 37)], [[3, 0, 6, 1, 7]], 8)
    assert (got - reference_logits(ref, ids)).abs().max() <= TOL


def test_token_by_token_decode(pair, kernel):
    ref, ours = pair
    ids = random.Random(1).choices(range(256), k=24)
    cache, table = new_cache(ours, 8, 4), [[5, 2, 7, 0, 1, 3]]
    want = reference_logits(ref, ids)
    for t in range(len(ids)):
        got = run_step(ours, cache, [(t, ids[t:t + 1], t + 1)], table, 4, kernel)
        assert (got[0] - want[t]).abs().max() <= TOL, f"position {t}"


def test_ragged_batch_mixing_prefill_chunk_decodes_and_verifies(pair, kernel):
    ref, ours = pair
    rng = random.Random(2)
    # (tokens already cached, new tokens this step): a prefill chunk, two decodes, two 5-token
    # verifies, a fresh prompt and a long-context decode (which gets an attention group of its own),
    # each with its own scattered block table.
    shapes = [(20, 30), (15, 1), (9, 1), (8, 5), (33, 5), (0, 12), (150, 1)]
    block_size, blocks = 4, list(range(128))
    rng.shuffle(blocks)
    tables, seqs, full = [], [], []
    for cached, new in shapes:
        n = -(-(cached + new) // block_size)
        tables.append([blocks.pop() for _ in range(n)])
        full.append(rng.choices(range(256), k=cached + new))
    cache = new_cache(ours, 128, block_size)
    warm = [(i, s) for i, s in enumerate(shapes) if s[0] > 0]  # fill the caches (itself a ragged step)
    run_step(ours, cache, [(0, full[i][:c], c) for i, (c, _) in warm], [tables[i] for i, _ in warm],
             block_size)
    got = run_step(ours, cache, [(c, full[i][c:], c + n) for i, (c, n) in enumerate(shapes)], tables,
                   block_size, kernel)
    offset = 0
    for i, (cached, new) in enumerate(shapes):
        want = reference_logits(ref, full[i])[cached:]
        assert (got[offset:offset + new] - want).abs().max() <= TOL, f"sequence {i}"
        offset += new
