"""The real default target: tokenizer, chat template and greedy decode against transformers."""
import json
from importlib import resources

import pytest
import torch

from specserve.model.greedy import greedy_decode
from specserve.model.loader import load_model
from specserve.model.registry import gguf_path

pytestmark = pytest.mark.slow
DATA = resources.files("specserve") / "data"


@pytest.fixture(scope="module")
def ours(smollm2_dir):
    return load_model(str(smollm2_dir))


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_dir):
    """transformers' own GGUF tokenizer conversion (its BPE, merges and special tokens are an independent
    reference), with one correction: transformers ignores `tokenizer.ggml.pre`, while llama.cpp's "smollm"
    pre-tokenizer isolates every digit before the GPT-2 split, as SmolLM2's original tokenizer does
    (test_vocabulary_was_trained_with_isolated_digits shows the evidence in the vocabulary itself)."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer
    g = gguf_path("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), tok.backend_tokenizer.pre_tokenizer])
    return tok


def test_vocabulary_was_trained_with_isolated_digits(ours):
    # Had digits not been split off (also from a leading space) before BPE training, " 1" and "12"
    # would be among the most frequent merges of a 49k vocabulary.
    digit_tokens = [t for t in ours.tokenizer.hf.get_vocab() if any(c in "0123456789" for c in t)]
    assert sorted(digit_tokens) == list("0123456789")


def test_tokenizer_matches_transformers_on_200_sharegpt_prompts(ours, hf_tokenizer):
    prompts = [c["conversations"][0]["value"]
               for c in json.loads((DATA / "sharegpt" / "ShareGPT_V3_filtered_1000.json").read_text())][:200]
    for p in prompts:
        assert ours.tokenizer.encode(p) == hf_tokenizer(p)["input_ids"], p[:80]
        assert ours.tokenizer.decode(ours.tokenizer.encode(p)) == p


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_apply_chat_template(ours, hf_tokenizer, add_generation_prompt):
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a prime ≥ 10."}],
    ]
    for msgs in conversations:
        want = hf_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours.tokenizer.apply_chat_template(msgs, add_generation_prompt) == want


def test_greedy_decode_matches_transformers_generate(ours, smollm2_dir):
    from transformers import LlamaForCausalLM
    ref = LlamaForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    rows = [json.loads(line) for line in (DATA / "spec_bench" / "question.jsonl").read_text().splitlines()]
    for row in rows[::96][:5]:  # five prompts spread over the categories
        ids = ours.tokenizer.encode_chat([{"role": "user", "content": row["turns"][0]}])
        got = greedy_decode(ours.model, ids, 64)
        with torch.no_grad():
            want = ref.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, min_new_tokens=64,
                                attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):]
        assert got == want.tolist(), row["category"]
