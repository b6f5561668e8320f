"""Detokenization survives output that is not UTF-8: byte-fallback pieces (Llama 2, Mistral, Gemma
vocabularies) that stop forming valid UTF-8 after their first characters went out made tokenizers'
DecodeStream raise, which ended every request in the step; the stream now starts again at that token."""
from specserve.engine.output_processor import OutputProcessor
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.sequence import Sequence
from specserve.model.gguf_convert import GGUFFile
from specserve.model.gguf_tokenizer import gguf_tokenizer
from tests.model.spm_vocab import write_spm_gguf


def test_invalid_utf8_output_goes_on(tmp_path):
    tok = gguf_tokenizer(GGUFFile(write_spm_gguf(tmp_path / "t.gguf", "llama")), [2])
    ids = [tok.hf.token_to_id(t) for t in ("▁", "<0xC3>", "<0xA9>", "<0xE6>", "▁the", "▁fox")]  # é, a stray byte
    outputs = OutputProcessor(tok, [2])
    seq = Sequence("r", [1], SamplingParams(max_tokens=16, stop=["fox"]))
    outputs.add(seq)
    verdict = outputs.check(seq, ids)
    assert (verdict.num_tokens, verdict.finish_reason, verdict.stop_reason) == (6, "stop", "fox")
    # (the fresh stream decodes "▁the" as a first token, without its space, as vLLM's reset does)
    assert outputs.text("r").startswith("é") and "the" in outputs.text("r")
