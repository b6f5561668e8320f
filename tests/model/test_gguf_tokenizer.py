"""SentencePiece GGUF vocabularies (Mistral / Mixtral / Llama 2 / Gemma files) against two references:
llama.cpp's tokenizer written out below (the bigram whose joined piece scores highest joins first, characters
outside the vocabulary as byte pieces, a space in front of each stretch of text when add_space_prefix) and
transformers' own GGUF tokenizer on the same file, where transformers does what llama.cpp does."""
import re

import pytest
from transformers import AutoTokenizer

from specserve.errors import ModelLoadError
from specserve.model.gguf_convert import GGUFFile, gguf_stop_ids
from specserve.model.gguf_tokenizer import gguf_tokenizer
from tests.model.spm_vocab import spm_vocab, write_spm_gguf

PLAIN = ["Hello there", "The quick brown fox\njumps over the lazy dog.\n\n", "12 345 2024 and 7", "abc abc abc",
         "def fibonacci(n):\n    if n < 2:\n        return n\n\tx", "héllo wörld 日本語 🙂 ☃", "a  b   c    d",
         "tokens, tokenizers; theres", ""]
EDGES = [" leading space", "   three leading", "trailing  ", "\nnewline first", " "]
LITERAL_SPACE_MARK = "\u2581 is a space to SentencePiece"  # encodes as llama.cpp does, decodes to a space
SPECIALS = {"llama": ["<s>[INST] Hello [/INST]</s> x", "a<mask>b <mask> c", "<unk>x</s>"],
            "gemma": ["<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n", "a<mask>b <pad>"]}
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ '[INST] ' + m.content + ' [/INST]' }}{% endfor %}"


def llama_cpp_tokenize(style: str, text: str, add_bos: bool) -> list[int]:
    """llama.cpp's llm_tokenizer_spm with special tokens parsed (llama_vocab::tokenize, SPM branch)."""
    tokens, scores, types = spm_vocab(style)
    ids = {t: i for i, t in enumerate(tokens)}
    whole = sorted((t for t, ty in zip(tokens, types) if ty in (2, 3, 4)), key=len, reverse=True)
    out = [ids["<s>" if style == "llama" else "<bos>"]] if add_bos else []
    after_special = True
    for part in re.split("(" + "|".join(map(re.escape, whole)) + ")", text):
        if part in whole:
            out.append(ids[part])
            after_special = True
        elif part:
            out += _spm_fragment(ids, scores, ((" " if style == "llama" and after_special else "") + part))
            after_special = False
    return out


def _spm_fragment(ids, scores, text):
    symbols = list(text.replace(" ", "\u2581"))
    while True:
        pairs = [(-scores[ids[a + b]], i) for i, (a, b) in enumerate(zip(symbols, symbols[1:])) if a + b in ids]
        if not pairs:
            break
        _, i = min(pairs)  # the best score, then the leftmost
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    out = []
    for s in symbols:
        out += [ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()]
    return out


def file_tokenizer(path):
    g = GGUFFile(path)
    return gguf_tokenizer(g, gguf_stop_ids(g))


@pytest.fixture(scope="module", params=["llama", "gemma"])
def spm(request, tmp_path_factory):
    """(style, folder with m.gguf, our tokenizer of the file)."""
    folder = tmp_path_factory.mktemp(request.param)
    write_spm_gguf(folder / "m.gguf", request.param, TEMPLATE)
    return request.param, folder, file_tokenizer(folder / "m.gguf")


def test_encoding_is_llama_cpps(spm):
    style, _, tok = spm
    for text in PLAIN + EDGES + SPECIALS[style] + [LITERAL_SPACE_MARK]:
        assert tok.encode(text) == llama_cpp_tokenize(style, text, add_bos=True), text
        assert tok.encode(text, add_special_tokens=False) == llama_cpp_tokenize(style, text, add_bos=False), text


def test_transformers_reads_the_file_the_same_way(spm):
    """transformers' GGUF tokenizer prepends "▁" (and strips it when decoding) whatever add_space_prefix says,
    and only where the text does not start with a space, and in front of the first stretch of text alone: so
    compare plain text, and a Gemma file's text with the space transformers adds written out."""
    style, folder, tok = spm
    ref = AutoTokenizer.from_pretrained(folder, gguf_file="m.gguf")
    for text in PLAIN:
        if style == "gemma" and not text:
            continue
        ids = tok.encode(text if style == "llama" else " " + text)
        assert ids == ref.encode(text), text
        if style == "llama":
            assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
            assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False), text


def test_decoding_gives_the_text_back(spm):
    style, _, tok = spm
    vocab = tok.hf.get_vocab()
    for text in PLAIN + EDGES:
        assert tok.decode(tok.encode(text)) == text
    assert "<0xE6>" in tok.hf.encode("日本").tokens and "<0xE6>" in vocab  # through byte pieces
    # no space in front of what follows a special token: llama.cpp's piece-by-piece decoding
    assert tok.decode(tok.encode("a<mask>b", add_special_tokens=False), skip_special_tokens=False) == (
        "a<mask> b" if style == "llama" else "a<mask>b")


def test_bos_follows_the_file_and_the_chat_template_is_the_files(tmp_path):
    for style, bos in (("llama", "<s>"), ("gemma", "<bos>")):
        for add_bos, first in ((None, [bos]), (True, [bos]), (False, [])):  # absent: llama.cpp adds it
            tok = file_tokenizer(write_spm_gguf(tmp_path / f"{style}{add_bos}.gguf", style, TEMPLATE, add_bos))
            assert tok.encode("Hi")[:len(first)] == [tok.hf.token_to_id(t) for t in first]
            assert tok.encode("Hi")[len(first)] != tok.hf.token_to_id(bos)
        prompt = tok.apply_chat_template([{"role": "user", "content": "Hello there"}])
        assert prompt == f"{bos}[INST] Hello there [/INST]"
        ids = tok.encode_chat([{"role": "user", "content": "Hello there"}])
        assert ids == llama_cpp_tokenize(style, prompt, add_bos=False) and ids.count(tok.hf.token_to_id(bos)) == 1


def test_gemma_stops_at_end_of_turn_too(tmp_path):
    tok = file_tokenizer(write_spm_gguf(tmp_path / "g.gguf", "gemma"))
    assert tok.eos_token_ids == [tok.hf.token_to_id("<eos>"), tok.hf.token_to_id("<end_of_turn>")]


def test_an_unsupported_tokenizer_kind_is_a_one_line_error(tmp_path):
    write_spm_gguf(tmp_path / "m.gguf", "llama", kind="bert")
    with pytest.raises(ModelLoadError) as e:
        file_tokenizer(tmp_path / "m.gguf")
    assert "tokenizer model 'bert' is not supported (supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece" \
        in str(e.value) and "\n" not in str(e.value)
