"""A GGUF file's tokenizer as a `tokenizers.Tokenizer` (tokenizer.json) plus tokenizer_config.json: byte-level
BPE ("gpt2": Qwen, Llama 3, SmolLM) and SentencePiece BPE ("llama": Mistral, Mixtral, Llama 2, Gemma)."""
from __future__ import annotations

import json

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from specserve.errors import ModelLoadError
from specserve.model.tokenizer import Tokenizer as SpecserveTokenizer

# llama.cpp pre-tokenizer names -> the split regex in front of byte-level BPE. "smollm" and "starcoder"
# split digits one by one and then use GPT-2's regex.
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
PRE_TOKENIZERS = {"default": (False, GPT2_REGEX), "gpt2": (False, GPT2_REGEX),
                  "smollm": (True, GPT2_REGEX), "starcoder": (True, GPT2_REGEX),
                  "llama-bpe": (False, LLAMA3_REGEX), "qwen2": (False, QWEN2_REGEX)}
TOKENIZER_KINDS = {"gpt2": "byte-level BPE", "llama": "SentencePiece BPE"}
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4
SPACE = "\u2581"  # SentencePiece's visible space


def byte_level_bpe(g, tokens: list[str]) -> Tokenizer:
    pre = g.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(f"{g.path}: pre-tokenizer {pre!r} is not supported "
                             f"(supported: {', '.join(PRE_TOKENIZERS)})")
    merges = [tuple(m.split(" ", 1)) for m in g.require("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    split_digits, regex = PRE_TOKENIZERS[pre]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if split_digits else []
    if regex == GPT2_REGEX:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges that reproduce llama.cpp's SentencePiece tokenizer, which has none: it joins the adjacent
    pair whose joined piece is in the vocabulary with the highest score, first. So every split of a normal
    piece into two normal pieces is a merge, ranked by the joined piece's score (ties: the earlier piece).
    Where one piece's two splits overlap in a word, llama.cpp joins the leftmost and BPE the better-ranked split:
    possible in principle, not seen on the test vocabularies."""
    normal = {t for t, ty in zip(tokens, types) if ty == NORMAL}
    ranked = sorted((-scores[i], i, k, piece) for i, piece in enumerate(tokens) if piece in normal
                    for k in range(1, len(piece)) if piece[:k] in normal and piece[k:] in normal)
    return [(piece[:k], piece[k:]) for _, _, k, piece in ranked]


def sentencepiece_bpe(g, tokens: list[str], types: list[int]) -> Tokenizer:
    """Text -> "▁"-for-space pieces (one "▁" in front when add_space_prefix, llama.cpp's default), merged by
    score, characters outside the vocabulary as <0xNN> byte pieces; decoding reverses each step."""
    scores = g.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    unk = g.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=spm_merges(tokens, scores, types),
                               unk_token=tokens[unk] if unk is not None else None, fuse_unk=True,
                               byte_fallback=True))
    # A normalizer (not Metaspace) so the prefix goes in front of each stretch of text between special
    # tokens, as llama.cpp tokenizes each stretch on its own.
    prefix = g.get("tokenizer.ggml.add_space_prefix", True)
    replace = normalizers.Replace(" ", SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace]) if prefix else replace
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tok


def _build(g) -> tuple[Tokenizer, dict]:
    """The tokenizer and the tokenizer_config.json contents built from the GGUF tokenizer metadata (g: a
    gguf_convert.GGUFFile)."""
    kind = g.require("tokenizer.ggml.model")
    if kind not in TOKENIZER_KINDS:
        raise ModelLoadError(f"{g.path}: tokenizer model {kind!r} is not supported (supported: "
                             + ", ".join(f"{k!r} ({v})" for k, v in TOKENIZER_KINDS.items()) + ")")
    tokens = g.require("tokenizer.ggml.tokens")
    types = g.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    tok = byte_level_bpe(g, tokens) if kind == "gpt2" else sentencepiece_bpe(g, tokens, types)
    # Control and unknown tokens are matched whole in text and skipped when decoding; user-defined ones
    # (<think>, <mask>) are matched whole, never split by BPE, and kept.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN)])
    tok.add_tokens([AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED])

    def name(key):
        i = g.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "model_max_length": int(g.get(f"{g.get('general.architecture')}.context_length", 2048))}
    for key in ("bos", "eos", "unknown", "padding"):
        if name(key) is not None:
            config[{"unknown": "unk", "padding": "pad"}.get(key, key) + "_token"] = name(key)
    template = g.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
    bos = name("bos") if g.get("tokenizer.ggml.add_bos_token", kind == "llama") else None
    eos = name("eos") if g.get("tokenizer.ggml.add_eos_token", False) else None
    if bos or eos:
        single = [t for t in (bos, "$A", eos) if t]
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=single + [p.replace("$A", "$B") for p in single],
            special_tokens=[(t, tokens.index(t)) for t in (bos, eos) if t])
    return tok, config


def gguf_tokenizer_files(g) -> dict[str, dict]:
    """tokenizer.json and tokenizer_config.json contents, for a folder converted from the GGUF file."""
    tok, config = _build(g)
    return {"tokenizer.json": json.loads(tok.to_str()), "tokenizer_config.json": config}


def gguf_tokenizer(g, eos_token_ids: list[int]) -> SpecserveTokenizer:
    """The file's tokenizer with its chat template and special tokens, as the engine uses it."""
    tok, config = _build(g)
    special = {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if k in config}
    return SpecserveTokenizer(tok, config.get("chat_template"), special, eos_token_ids)
