"""Batch invariance: a token's logits do not depend on how its step was composed (one prefill, prefill
chunks, verifies of k + 1 tokens, single decodes, other sequences alongside), bit for bit, in bf16 and
float32, dense and quantized. This is what keeps greedy output identical with and without speculation
and after a preemption recomputes a sequence's cache by prefill (issue 45)."""
import pytest
import torch

from specserve.model.attention import AttentionMetadata, allocate_kv_cache
from specserve.model.config import ModelConfig
from specserve.model.cpu_linear import kernel_can_run
from specserve.model.kernels import short_attention_supported
from specserve.model.llama import LlamaModel
from specserve.model.packed_linear import pack_linears
from specserve.model.quantize import quantize_model
from specserve.settings import settings

pytestmark = pytest.mark.skipif(not (kernel_can_run(torch.zeros(1)) and short_attention_supported(
    torch.float32, torch.device("cpu"))), reason="no C compiler: batch invariance needs the kernels")
BLOCK = 16


def tiny(dtype, quantization):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    model = LlamaModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model = model.to(dtype).eval().requires_grad_(False)
    if quantization:
        quantize_model(model, quantization)
    pack_linears(model)
    return model


def run(model, cache, seqs):
    """seqs: (block table, new token ids, context length incl. them) -> logits of every new token."""
    meta = AttentionMetadata.build([len(n) for _, n, _ in seqs], [c for *_, c in seqs], [t for t, _, _ in seqs],
                                   BLOCK, short_kernel=True)
    ids = torch.tensor([i for _, n, _ in seqs for i in n])
    with torch.no_grad():
        return model.compute_logits(model(ids, meta, cache))


def invariance(monkeypatch, dtype):
    """Default (unset) for bf16; float32 dense linears need SPECSERVE_BATCH_INVARIANT=1 (by default
    their prefill-sized inputs take oneDNN, see cpu_linear.invariant_linears)."""
    monkeypatch.setattr(settings, "batch_invariant", True if dtype == torch.float32 else None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("quantization", [None, "q4_0"])
def test_logits_are_the_same_bits_however_the_tokens_are_batched(dtype, quantization, monkeypatch):
    invariance(monkeypatch, dtype)
    model = tiny(dtype, quantization)
    c = model.config
    cache = lambda: allocate_kv_cache(c.num_hidden_layers, 40, BLOCK, c.num_key_value_heads, c.head_dim, dtype)  # noqa: E731
    toks = torch.randint(0, 300, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    seq, other = list(range(10)), list(range(20, 30))
    whole = run(model, cache(), [(seq, toks, 100)])  # one 100-token prefill (in kernel pieces of 32)

    kv = cache()  # a 37-token chunk, then verifies of 5 beside another sequence's prefill, then decodes
    parts = [run(model, kv, [(seq, toks[:37], 37)])]
    for i in range(37, 92, 5):
        parts.append(run(model, kv, [(other, toks[:7], 7), (seq, toks[i:i + 5], i + 5)])[7:])
    for i in range(92, 100):
        parts.append(run(model, kv, [(seq, toks[i:i + 1], i + 1), (other, toks[7:8], 8)])[:1])
    assert torch.equal(torch.cat(parts), whole)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_one_call_forward_gives_the_bits_of_the_layer_by_layer_one(dtype, monkeypatch):
    """cpu_forward.run_layers (all layers in one C call) against DecoderLayer.forward on the same kernels."""
    from specserve.model import cpu_forward
    invariance(monkeypatch, dtype)
    model = tiny(dtype, None)
    c = model.config
    toks = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    steps = [[(list(range(10)), toks[:33], 33)], [(list(range(10)), toks[33:38], 38), (list(range(20, 30)), toks[:3], 3)]]
    results = []
    for one_call in (True, False):
        monkeypatch.setattr(cpu_forward, "can_run", lambda *a, one_call=one_call: one_call)
        kv = allocate_kv_cache(c.num_hidden_layers, 40, BLOCK, c.num_key_value_heads, c.head_dim, dtype)
        results.append(torch.cat([run(model, kv, seqs) for seqs in steps]))
    assert torch.equal(results[0], results[1])


def test_float32_linears_take_onednn_for_prefills_by_default(monkeypatch):
    from specserve.model.packed_linear import can_pack
    monkeypatch.setattr(settings, "batch_invariant", None)
    model = tiny(torch.float32, None)
    large = model.layers[0].qkv_proj.large
    assert (large is not None) == can_pack(torch.zeros(1))
    assert tiny(torch.bfloat16, None).layers[0].qkv_proj.large is None
