"""The real default target on the CPU kernels: its GGUF blocks kept quantized against the dequantized
model, and bf16 batch invariance (a recompute by prefill, a verify and single decodes give the same bits)."""
import json
from importlib import resources

import pytest
import torch

from specserve.model.cpu_linear import KernelLinear, kernel_can_run
from specserve.model.greedy import greedy_decode
from specserve.model.loader import load_model
from specserve.model.packed_linear import pack_linears
from specserve.model.registry import gguf_path
from specserve.settings import settings
from tests.model.helpers import new_cache, run_step

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not kernel_can_run(torch.zeros(1)), reason="no C compiler: no kernel here")]
DATA = resources.files("specserve") / "data"


def prompts(n):
    rows = [json.loads(line) for line in (DATA / "spec_bench" / "question.jsonl").read_text().splitlines()]
    return [row["turns"][0] for row in rows[::96][:n]]


def test_native_q4_1_decodes_as_the_dequantized_model(smollm2_dir, monkeypatch):
    monkeypatch.setattr(settings, "int8_dot", False)  # the exact path
    path = str(gguf_path("smollm2-135m"))
    native, dense = load_model(path, "float32", quantization="gguf"), load_model(path, "float32")
    assert {m.fmt for m in native.model.modules() if isinstance(m, KernelLinear)} == {"q4_1", "q8_0"}
    for text in prompts(3):
        ids = native.tokenizer.encode_chat([{"role": "user", "content": text}])[:240]
        logits = [run_step(m.model, new_cache(m.model, 32, 16), [(0, ids, len(ids))], [list(range(32))], 16,
                           short_kernel=True) for m in (native, dense)]
        # float32 accumulation order only: logits of size ~20 agree to ~1e-4
        assert (logits[0] - logits[1]).abs().max() <= 1e-3
        assert greedy_decode(native.model, ids, 32) == greedy_decode(dense.model, ids, 32)


def test_the_integer_path_stays_close_to_the_dequantized_model(smollm2_dir):
    """int8 activations: logits within a few percent, the same top token at nearly every position
    (bench/quality.py measures perplexity and agreement on real text)."""
    path = str(gguf_path("smollm2-135m"))
    native, dense = load_model(path, "float32", quantization="gguf"), load_model(path, "float32")
    assert {m.fmt for m in native.model.modules() if isinstance(m, KernelLinear)} == {"i4", "i8"}
    agree = total = 0
    for text in prompts(3):
        ids = native.tokenizer.encode_chat([{"role": "user", "content": text}])[:240]
        got, want = (run_step(m.model, new_cache(m.model, 32, 16), [(0, ids, len(ids))], [list(range(32))], 16,
                              short_kernel=True) for m in (native, dense))
        assert ((got - want).norm() / want.norm()).item() < 0.05
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += got.shape[0]
    assert agree >= 0.9 * total, (agree, total)


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_bf16_logits_are_the_same_bits_in_a_recompute_a_verify_and_decodes(smollm2_dir, quantization):
    loaded = load_model("smollm2-135m", "bfloat16", quantization=quantization)
    model = loaded.model
    pack_linears(model)
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": prompts(1)[0]}])[:240]
    n = len(ids)
    table = [list(range(40))]
    kv = new_cache(model, 40, 16).bfloat16()
    steps = [run_step(model, kv, [(0, ids, n)], table, 16, short_kernel=True)]
    tokens = list(ids)
    for _ in range(12):  # greedy decodes
        tokens.append(int(steps[-1][-1].argmax()))
        steps.append(run_step(model, kv, [(0, tokens[-1:], len(tokens))], table, 16, short_kernel=True))
    decoded = torch.cat(steps)
    # A verify of the last 6 tokens on the cache of the first ones, and a recompute of everything.
    verify = run_step(model, kv, [(0, tokens[-6:], len(tokens))], table, 16, short_kernel=True)
    recompute = run_step(model, new_cache(model, 40, 16).bfloat16(), [(0, tokens, len(tokens))], table, 16,
                         short_kernel=True)
    assert torch.equal(verify, decoded[-6:])
    assert torch.equal(recompute, decoded)
