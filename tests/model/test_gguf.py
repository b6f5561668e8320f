"""GGUF loading: dequantization, Q/K un-permutation, tokenizer, and the errors users see."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specserve.errors import ModelLoadError
from specserve.model.loader import load_model
from specserve.model.registry import gguf_path
from tests.byte_vocab import VOCAB
from tests.model.gguf_fixtures import write_gguf
from tests.model.helpers import new_cache, run_step

CFG = dict(hidden=64, ffn=96, layers=2, heads=4, kv_heads=2)


def tiny_reference():
    torch.manual_seed(0)
    hf = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                     max_position_embeddings=256, rms_norm_eps=1e-5)
    hf.architectures = ["LlamaForCausalLM"]
    return hf, LlamaForCausalLM(hf).eval()


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_dequantizes_and_unpermutes(tmp_path, qtype):
    hf, ref = tiny_reference()
    expected = write_gguf(tmp_path / "m.gguf", ref.state_dict(), CFG, qtype)
    ref.load_state_dict(expected)  # the reference gets the same (lossy) weights
    loaded = load_model(str(tmp_path / "m.gguf"))
    ids = list(range(40, 70))
    got = run_step(loaded.model, new_cache(loaded.model, 4, 16), [(0, ids, len(ids))], [[0, 1]], 16)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    assert (got - want).abs().max() <= 1e-4
    # byte tokens have id = byte value; "h e" merges to 257; digits are split one by one (smollm).
    assert loaded.tokenizer.encode("the 12 </s>") == [116, 257, 32, 49, 50, 32, 259]
    assert loaded.tokenizer.decode([116, 257, 32, 49, 50]) == "the 12"
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>hi</s>"
    assert loaded.config.eos_token_id == [259]


def test_unsupported_quant_type_is_a_clear_error(tmp_path):
    _, ref = tiny_reference()
    write_gguf(tmp_path / "m.gguf", ref.state_dict(), CFG, "Q5_0")
    with pytest.raises(ModelLoadError, match=r"quantization Q5_0, which is not supported.*m\.gguf|m\.gguf.*Q5_0"):
        load_model(str(tmp_path / "m.gguf"))


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    _, ref = tiny_reference()
    write_gguf(tmp_path / "m.gguf", ref.state_dict(), CFG, "F32", arch="falcon")
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'falcon'"):
        load_model(str(tmp_path / "m.gguf"))


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 7)
    with pytest.raises(ModelLoadError, match="corrupt or unreadable GGUF file .*bad.gguf"):
        load_model(str(bad))


@pytest.mark.slow
def test_real_gguf_and_converted_directory_give_identical_logits(smollm2_dir):
    from_dir = load_model(str(smollm2_dir))
    from_gguf = load_model(str(gguf_path("smollm2-135m")))
    ids = from_dir.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n")
    logits = [run_step(m.model, new_cache(m.model, 4, 16), [(0, ids, len(ids))], [[0, 1, 2, 3]], 16)
              for m in (from_dir, from_gguf)]
    assert torch.equal(logits[0], logits[1])
    assert from_dir.tokenizer.encode("x = 12345") == from_gguf.tokenizer.encode("x = 12345")
