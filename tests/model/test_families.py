"""Every model family against transformers in float32: tiny random checkpoints as transformers saves them and
as llama.cpp-style GGUF files, loaded by our loader, give the reference's logits on prefill, token-by-token
decode (torch ops and the C attention kernel) and a ragged batch, the same greedy continuations of several
prompts, and the same again with the weights on our CPU kernels (experts one KernelLinear pair each)."""
import copy
import random

import pytest
import torch

from specserve.model.cpu_linear import KernelLinear, kernel_can_run
from specserve.model.greedy import greedy_decode
from specserve.model.kernels import short_attention_supported
from specserve.model.loader import load_model
from specserve.model.mlp import MoE
from specserve.model.packed_linear import pack_linears
from specserve.model.quantize import weight_summary
from specserve.settings import settings
from tests.model.family_fixtures import FAMILIES, MOE_FAMILIES, make_family_dir, reference_with, write_family_gguf
from tests.model.helpers import new_cache, run_step

TOL = 1e-4
needs_kernel = pytest.mark.skipif(not kernel_can_run(torch.zeros(1)) or
                                  not short_attention_supported(torch.float32, torch.device("cpu")),
                                  reason="no C compiler: the kernels cannot run here")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, HF folder, transformers reference, our model loaded from the folder)."""
    path = make_family_dir(tmp_path_factory.mktemp(request.param) / "hf", request.param)
    ref = reference_with(path, _tensors(path), path.parent / "ref")
    return request.param, path, ref, load_model(str(path)).model


def _tensors(path):
    from safetensors.torch import load_file
    return load_file(str(path / "model.safetensors"))


def reference_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


def test_the_family_loads_as_its_own_architecture(family):
    name, _, ref, ours = family
    assert ours.config.architecture == FAMILIES[name][0]
    assert any(layer.moe is not None for layer in ours.layers) == (name in MOE_FAMILIES)
    if name == "gemma3":
        assert [layer.sliding_window for layer in ours.layers] == [6, None, 6]
        assert [layer.rope_index for layer in ours.layers] == [1, 0, 1] and len(ours.ropes) == 2
    if name == "qwen3_moe":  # layer 1 is in mlp_only_layers
        assert [layer.moe is None for layer in ours.layers] == [False, True, False]


def test_prefill(family):
    _, _, ref, ours = family
    ids = random.Random(0).choices(range(256), k=37)
    got = run_step(ours, new_cache(ours, 8, 8), [(0, ids, 37)], [[3, 0, 6, 1, 7]], 8)
    assert (got - reference_logits(ref, ids)).abs().max() <= TOL


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=needs_kernel)], ids=["torch-ops", "c-kernel"])
def test_token_by_token_decode(family, kernel):
    _, _, ref, ours = family
    ids = random.Random(1).choices(range(256), k=20)
    cache, table = new_cache(ours, 8, 4), [[5, 2, 7, 0, 1, 3]]
    want = reference_logits(ref, ids)
    for t in range(len(ids)):
        got = run_step(ours, cache, [(t, ids[t:t + 1], t + 1)], table, 4, kernel)
        assert (got[0] - want[t]).abs().max() <= TOL, f"position {t}"


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=needs_kernel)], ids=["torch-ops", "c-kernel"])
def test_ragged_batch_of_prefill_chunks_decodes_and_verifies(family, kernel):
    _, _, ref, ours = family
    rng = random.Random(2)
    shapes = [(20, 30), (15, 1), (9, 1), (8, 5), (0, 12)]  # (cached, new) per sequence
    block_size, blocks = 4, list(range(64))
    rng.shuffle(blocks)
    tables, full = [], []
    for cached, new in shapes:
        tables.append([blocks.pop() for _ in range(-(-(cached + new) // block_size))])
        full.append(rng.choices(range(256), k=cached + new))
    cache = new_cache(ours, 64, block_size)
    warm = [(i, c) for i, (c, _) in enumerate(shapes) if c]
    run_step(ours, cache, [(0, full[i][:c], c) for i, c in warm], [tables[i] for i, _ in warm], block_size)
    got = run_step(ours, cache, [(c, full[i][c:], c + n) for i, (c, n) in enumerate(shapes)], tables, block_size,
                   kernel)
    offset = 0
    for i, (cached, new) in enumerate(shapes):
        want = reference_logits(ref, full[i])[cached:]
        assert (got[offset:offset + new] - want).abs().max() <= TOL, f"sequence {i}"
        offset += new


def _greedy_reference(ref, prompt, n):
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                           pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("on_kernels", [False, pytest.param(True, marks=needs_kernel)], ids=["torch", "kernels"])
def test_greedy_continuations_are_the_references(family, on_kernels):
    """Several prompts, 12 tokens each: the same tokens as transformers' generate(), with the weights as loaded
    and on our kernels (float32 KernelLinear, experts one pair each, as the engine serves them)."""
    _, _, ref, ours = family
    if on_kernels:
        ours = copy.deepcopy(ours)
        assert pack_linears(ours) > 0
        assert all(layer.moe.experts is not None for layer in ours.layers if layer.moe is not None)
    rng = random.Random(3)
    for length in (1, 5, 17):
        prompt = rng.choices(range(256), k=length)
        assert greedy_decode(ours, prompt, 12) == _greedy_reference(ref, prompt, 12), f"prompt of {length}"


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_file_computes_the_reference(family, qtype, tmp_path):
    """The family's GGUF file (names, stacked experts, permuted rows, 1 + w norms, metadata) loads to the
    model transformers computes from the same (dequantized) weights."""
    name, path, _, _ = family
    expected = write_family_gguf(tmp_path / "m.gguf", path, name, qtype)
    ref = reference_with(path, expected, tmp_path / "ref")
    loaded = load_model(str(tmp_path / "m.gguf"))
    assert loaded.config.architecture == FAMILIES[name][0]
    ids = random.Random(4).choices(range(256), k=29)
    got = run_step(loaded.model, new_cache(loaded.model, 8, 8), [(0, ids, 29)], [[3, 0, 6, 1, 7]], 8)
    assert (got - reference_logits(ref, ids)).abs().max() <= TOL
    prompt = ids[:7]
    assert greedy_decode(loaded.model, prompt, 10) == _greedy_reference(ref, prompt, 10)


@needs_kernel
def test_gguf_blocks_stay_quantized_experts_included(family, tmp_path, monkeypatch):
    """quantization="gguf": every matrix but the routers on the kernel as Q8_0 blocks, one KernelLinear pair per
    expert; on the exact path the same function as the dequantized model."""
    monkeypatch.setattr(settings, "int8_dot", False)
    name, path, _, _ = family
    write_family_gguf(tmp_path / "m.gguf", path, name, "Q8_0")
    path = str(tmp_path / "m.gguf")
    dense, native = load_model(path).model, load_model(path, quantization="gguf").model
    for layer in native.layers:
        if layer.moe is not None:
            assert layer.moe.gate_up is None and len(layer.moe.experts) == layer.moe.num_experts
            assert all(m.source_fmt == "q8_0" for pair in layer.moe.experts for m in pair)
    assert "q8_0" in weight_summary(native)
    ids = random.Random(5).choices(range(256), k=21)
    want = run_step(dense, new_cache(dense, 8, 8), [(0, ids, 21)], [[3, 0, 6, 1, 7]], 8)
    got = run_step(native, new_cache(native, 8, 8), [(0, ids, 21)], [[3, 0, 6, 1, 7]], 8, True)
    assert (got - want).abs().max() <= TOL + 1e-6 * want.abs().max()


def test_gguf_generation_config_and_stop_tokens(family, tmp_path):
    from specserve.server.generation_config import resolve
    name, path, _, _ = family
    write_family_gguf(tmp_path / "m.gguf", path, name, "F32")
    defaults, why = resolve("auto", str(tmp_path / "m.gguf"))
    assert (defaults.temperature, defaults.top_k) == (pytest.approx(0.6), 40) and "m.gguf" in why
    folder_defaults, _ = resolve("auto", str(path))
    assert (folder_defaults.temperature, folder_defaults.top_p, folder_defaults.top_k) == (0.7, 0.8, 20)


def test_moe_runs_each_routed_expert_once_and_reads_no_other(family):
    """A step's tokens grouped by expert: each expert the router chose runs its gate/up and down matrices once,
    for all of its tokens at once; experts nobody chose are not read."""
    name, _, _, ours = family
    if name not in MOE_FAMILIES:
        pytest.skip("a dense family")
    model = copy.deepcopy(ours)
    pack_linears(model)
    moe = next(layer.moe for layer in model.layers if layer.moe is not None)
    calls = []  # (expert, projection, rows)
    for e, pair in enumerate(moe.experts):
        for which, module in zip(("gate_up", "down"), pair):
            assert isinstance(module, KernelLinear)
            module.register_forward_pre_hook(lambda m, args, e=e, which=which: calls.append((e, which, len(args[0]))))
            if which == "gate_up":  # the kernel's swiglu bypasses forward: count it too
                original = module.swiglu
                module.swiglu = lambda x, e=e, original=original: (calls.append((e, "gate_up", len(x))), original(x))[1]
    routed = []
    moe.register_forward_hook(lambda m, args, out: routed.append(m.route(args[0])[1]))
    for seed in range(50):  # a 3-token step where some expert is unused and some takes several tokens
        calls.clear(), routed.clear()
        ids = random.Random(seed).choices(range(256), k=3)
        run_step(model, new_cache(model, 8, 8), [(0, ids, 3)], [[0]], 8)
        chosen = routed[0]  # [tokens, k]
        used = sorted(set(chosen.flatten().tolist()))
        if len(used) < moe.num_experts and max(chosen.flatten().bincount()) > 1:
            break
    else:
        pytest.fail("no prompt routed to fewer than all experts")
    assert sorted(e for e, which, _ in calls if which == "gate_up") == used
    assert sorted(e for e, which, _ in calls if which == "down") == used
    for e, which, rows in calls:
        assert rows == int((chosen == e).sum()), (e, which)


def test_moe_grouped_matmul_is_the_per_expert_loop():
    """The stacked experts' path (torch's grouped matmul, the GPU path) equals one F.linear per expert."""
    from specserve.model.mlp import grouped_linear
    torch.manual_seed(0)
    x, w = torch.randn(11, 16), torch.randn(5, 8, 16)
    counts = torch.tensor([3, 0, 4, 0, 4])
    offsets = counts.cumsum(0).to(torch.int32)
    got = grouped_linear(x, w, offsets)
    want = torch.cat([x[:3] @ w[0].T, x[3:7] @ w[2].T, x[7:] @ w[4].T])
    assert torch.allclose(got, want, atol=1e-6)
    w.requires_grad_(True)  # autograd: the loop
    assert torch.allclose(grouped_linear(x, w, offsets), want, atol=1e-6)


def test_moe_stays_on_the_grouped_path_without_the_kernel(family, monkeypatch):
    """Where the kernel cannot run, the stacked experts stay (grouped matmul) and still compute the model."""
    name, _, ref, ours = family
    if name not in MOE_FAMILIES:
        pytest.skip("a dense family")
    moe = next(m for m in ours.modules() if isinstance(m, MoE))
    assert moe.experts is None and moe.gate_up is not None
    ids = random.Random(7).choices(range(256), k=8)
    got = run_step(ours, new_cache(ours, 4, 8), [(0, ids, 8)], [[0]], 8)
    assert (got - reference_logits(ref, ids)).abs().max() <= TOL
