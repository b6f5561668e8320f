"""Quantized weights at load (`load_model(..., quantization=...)`): GGUF blocks kept as they are, HF
checkpoints quantized, and the dense fallback without the kernel. On the exact path (SPECSERVE_INT8_DOT=0)
native and dequantized models must compute the same function up to float32 accumulation order (tolerance:
1e-4 plus 1e-6 of the largest logit); on the integer path (the default) up to the activations' int8
rounding (relative error of the logits below 3%)."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specserve.errors import ModelLoadError, SpecServeError
from specserve.model import cpu_forward, kernels
from specserve.model.cpu_linear import (KernelLinear, StackedKernelLinear, dequantize_gguf, kernel_can_run,
                                        quantize)
from specserve.model.loader import load_model
from specserve.model.quantize import weight_summary
from specserve.settings import settings
from tests.byte_vocab import VOCAB
from tests.model.gguf_fixtures import write_gguf
from tests.model.helpers import new_cache, run_step

needs_kernel = pytest.mark.skipif(not kernel_can_run(torch.zeros(1)), reason="no C compiler: no kernel here")
SMALL = dict(hidden=64, ffn=96, layers=2, heads=4, kv_heads=2)
WIDE = dict(hidden=256, ffn=512, layers=2, heads=4, kv_heads=2)  # Q4_K blocks hold 256 inputs


def write_model(tmp_path, qtype):
    cfg = WIDE if qtype.startswith("Q4_K") else SMALL
    torch.manual_seed(0)
    hf = LlamaConfig(vocab_size=VOCAB, hidden_size=cfg["hidden"], intermediate_size=cfg["ffn"],
                     num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                     num_key_value_heads=cfg["kv_heads"], tie_word_embeddings=False, max_position_embeddings=256,
                     rms_norm_eps=1e-5)
    write_gguf(tmp_path / "m.gguf", LlamaForCausalLM(hf).state_dict(), cfg, qtype)
    return str(tmp_path / "m.gguf")


def logits(model, ids=tuple(range(40, 70)), short_kernel=False):
    return run_step(model, new_cache(model, 4, 16), [(0, list(ids), len(ids))], [[0, 1]], 16, short_kernel)


def close(a, b):
    return (a - b).abs().max() <= 1e-4 + 1e-6 * b.abs().max()


def formats(model):
    return sorted({m.fmt for m in model.modules() if isinstance(m, KernelLinear)})


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_gguf_blocks_stay_quantized_and_compute_the_dequantized_model(tmp_path, qtype, monkeypatch):
    monkeypatch.setattr(settings, "int8_dot", False)
    path = write_model(tmp_path, qtype)
    dense, native = load_model(path), load_model(path, quantization="gguf")
    assert formats(native.model) == [qtype.lower()]
    assert sum(isinstance(m, KernelLinear) for m in native.model.modules()) == 2 * 4 + 1
    assert native.model.embed_tokens.weight.dtype == torch.float32  # the table stays dense
    assert close(logits(native.model), logits(dense.model))
    assert weight_summary(native.model).startswith(f"{qtype.lower()} x 9")


@needs_kernel
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_a_checkpoint_is_quantized_at_load(tiny_target, fmt, monkeypatch):
    monkeypatch.setattr(settings, "int8_dot", False)
    dense, quant = load_model(str(tiny_target)), load_model(str(tiny_target), quantization=fmt)
    assert formats(quant.model) == [fmt]
    with torch.no_grad():  # the reference: the same model with each matrix quantized and dequantized
        for name, m in dense.model.named_modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(dequantize_gguf(quantize(m.weight, fmt), fmt, m.in_features))
    assert close(logits(quant.model), logits(dense.model))


@needs_kernel
@pytest.mark.parametrize("int8_dot", [False, True])
def test_a_q4_k_m_file_runs_every_matrix_on_the_kernels(tmp_path, monkeypatch, int8_dot):
    """llama.cpp's _M mixes store attn_v, ffn_down and the output matrix as Q6_K: q/k/v becomes a stacked
    projection (Q4_K q and k, then Q6_K v), every matrix stays quantized, the one-call forward takes the
    layers (the same bits as layer by layer), and the model computes the dequantized model's function:
    up to accumulation order on the exact path, up to the int8 activations on the integer one."""
    monkeypatch.setattr(settings, "int8_dot", int8_dot)
    path = write_model(tmp_path, "Q4_K_M")
    dense, native = load_model(path), load_model(path, quantization="gguf")
    layer = native.model.layers[0]
    assert isinstance(layer.qkv_proj, StackedKernelLinear)
    assert [m.source_fmt for m in (*layer.qkv_proj.parts, layer.o_proj, layer.gate_up_proj, layer.down_proj,
                                   native.model.lm_head)] == ["q4_k", "q6_k", "q4_k", "q4_k", "q6_k", "q6_k"]
    assert torch.equal(layer.qkv_proj.dense_weight(), dense.model.layers[0].qkv_proj.weight)
    one_call = []
    run_layers = cpu_forward.run_layers
    monkeypatch.setattr(cpu_forward, "run_layers", lambda *a: one_call.append(1) or run_layers(*a))
    got, want = logits(native.model, short_kernel=True), logits(dense.model)
    assert one_call
    if not int8_dot:
        assert close(got, want)
    else:  # each matrix keeps its int8 bound (test_int8_dot.py); this random model amplifies them to ~10 %
        assert 0 < relative_error(got, want) < 0.2
    monkeypatch.setattr(cpu_forward, "can_run", lambda *a: False)
    assert torch.equal(logits(native.model, short_kernel=True), got)  # layer by layer: StackedKernelLinear.forward


@needs_kernel
def test_a_dense_matrix_in_a_later_layer_keeps_the_one_call_forward_off(tmp_path, monkeypatch):
    """The one-call forward needs every layer's projections on the kernel, not only the first layer's."""
    native = load_model(write_model(tmp_path, "Q4_1"), quantization="gguf")
    want = logits(native.model, short_kernel=True)
    last = native.model.layers[-1]
    linear = torch.nn.Linear(last.o_proj.in_features, last.o_proj.out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(last.o_proj.dense_weight())
    last.o_proj = linear
    one_call = []
    run_layers = cpu_forward.run_layers
    monkeypatch.setattr(cpu_forward, "run_layers", lambda *a: one_call.append(1) or run_layers(*a))
    got = logits(native.model, short_kernel=True)
    assert not one_call
    assert relative_error(got, want) < 0.03  # the same weights, the torch op for one matrix


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q4_K"])
def test_the_integer_path_computes_the_dequantized_model_up_to_int8_activations(tmp_path, qtype):
    path = write_model(tmp_path, qtype)
    dense, native = load_model(path), load_model(path, quantization="gguf")
    assert formats(native.model) == [{"Q8_0": "i8", "Q4_K": "i4w"}.get(qtype, "i4")]
    assert weight_summary(native.model).startswith(f"{qtype.lower()} (int8 dot) x 9")
    got, want = logits(native.model), logits(dense.model)
    assert 0 < relative_error(got, want) < 0.03


def test_without_the_kernel_the_same_weights_load_dense(tmp_path, monkeypatch):
    path = write_model(tmp_path, "Q4_1")
    reference = load_model(path)
    monkeypatch.setattr(settings, "cpu_kernels", False)
    kernels._library.cache_clear()
    try:
        fallback = load_model(path, quantization="gguf")
        assert formats(fallback.model) == []
        assert close(logits(fallback.model), logits(reference.model))
    finally:
        monkeypatch.setattr(settings, "cpu_kernels", True)
        kernels._library.cache_clear()


def test_quantization_errors_are_clear(tmp_path, tiny_target):
    with pytest.raises(ModelLoadError, match="unknown quantization 'q3_x'"):
        load_model(str(tiny_target), quantization="q3_x")
    with pytest.raises(ModelLoadError, match="'gguf' needs a .gguf model"):
        load_model(str(tiny_target), quantization="gguf")


def test_auto_quantization_keeps_a_gguf_models_blocks_on_the_cpu_only(tmp_path, tiny_target):
    from specserve.engine.config import resolve_quantization
    gguf = str(tmp_path / "m.gguf")
    assert resolve_quantization("auto", gguf, "cpu") == ("gguf" if kernels.available() else None)
    assert resolve_quantization("auto", gguf, "cuda:0") is None
    assert resolve_quantization("auto", str(tiny_target), "cpu") is None  # a dense checkpoint stays dense
    assert resolve_quantization("none", gguf, "cpu") is None and resolve_quantization(None, gguf, "cpu") is None
    assert resolve_quantization("q8_0", str(tiny_target), "cpu") == "q8_0"
    with pytest.raises(SpecServeError, match="unknown quantization 'q3'.*auto, none"):
        resolve_quantization("q3", gguf, "cpu")
