"""Small SentencePiece BPE vocabularies laid out as llama.cpp's converter writes them: control tokens, the 256
<0xNN> byte pieces, merged pieces scored by the order a BPE training run learned them, then single characters.
"llama" style (Mistral, Mixtral, Llama 2): <unk> <s> </s>, a "▁" in front of the text. "gemma" style:
<pad> <eos> <bos> <unk> <start_of_turn> <end_of_turn>, no prefix (add_space_prefix false)."""
from collections import Counter
from pathlib import Path

from gguf import GGUFWriter

CORPUS = """The quick brown fox jumps over the lazy dog. The dog sleeps, the fox runs.
Hello there! How are you today? I am fine, thank you. Hello again, there is the answer.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
for i in range(10):
    print(i, fibonacci(i))
Numbers like 12, 345 and 2024 appear in the text; so do abc abc abc and tokens and tokenizers."""
CONTROL = {"llama": ["<unk>", "<s>", "</s>"], "gemma": ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>",
                                                       "<end_of_turn>"]}
USER_DEFINED = "<mask>"
MERGES = 160


def spm_vocab(style: str = "llama") -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a vocabulary of about 450 pieces."""
    text = CORPUS.replace(" ", "\u2581")
    words = Counter("\u2581" + w for w in text.split("\u2581"))
    splits = {w: list(w) for w in words}
    merged = []
    for _ in range(MERGES):  # plain BPE training: join the most frequent adjacent pair
        pairs = Counter()
        for w, parts in splits.items():
            for a, b in zip(parts, parts[1:]):
                pairs[a, b] += words[w]
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        merged.append(a + b)
        for w, parts in splits.items():
            i = 0
            while i < len(parts) - 1:
                if (parts[i], parts[i + 1]) == (a, b):
                    parts[i:i + 2] = [a + b]
                i += 1
    chars = sorted({c for w in words for c in w} - set(merged))
    pieces = list(dict.fromkeys(merged)) + chars
    control = CONTROL[style]
    tokens = control + [f"<0x{b:02X}>" for b in range(256)] + [USER_DEFINED] + pieces
    types = [2 if t == "<unk>" else 3 for t in control] + [6] * 256 + [4] + [1] * len(pieces)
    scores = [0.0] * (len(control) + 257) + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


def add_spm_tokenizer(w: GGUFWriter, style: str, template: str | None = None, add_bos: bool | None = None,
                      kind: str = "llama"):
    """The tokenizer metadata of a `style` vocabulary, as llama.cpp's converter writes it (`kind`: another
    tokenizer.ggml.model, to see it refused)."""
    tokens, scores, types = spm_vocab(style)
    w.add_tokenizer_model(kind)
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    ids = {t: i for i, t in enumerate(tokens)}
    bos, eos = ("<s>", "</s>") if style == "llama" else ("<bos>", "<eos>")
    w.add_bos_token_id(ids[bos])
    w.add_eos_token_id(ids[eos])
    w.add_unk_token_id(ids["<unk>"])
    if style == "gemma":
        w.add_pad_token_id(ids["<pad>"])
        w.add_eot_token_id(ids["<end_of_turn>"])
        w.add_add_space_prefix(False)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_add_eos_token(False)
    if template:
        w.add_chat_template(template)


def write_spm_gguf(path: Path, style: str, template: str | None = None, add_bos: bool | None = None,
                   kind: str = "llama") -> Path:
    """A GGUF file with the vocabulary and a "llama" architecture header, and no tensors (a tokenizer test
    reads no weights)."""
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_head_count(1)
    add_spm_tokenizer(w, style, template, add_bos, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
