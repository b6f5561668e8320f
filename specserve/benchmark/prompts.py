"""What each request asks: prompts from the shipped data sets, or of an exact token length made from real text.

Traces carry token counts but no text, so a prompt of the trace's length is cut from a corpus of real
prompts. Counting tokens exactly needs the server's tokenizer (`--tokenizer`); without one we use a
characters-per-token rule and the results say the lengths are approximate.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from specserve.benchmark import code_edit
from specserve.benchmark.arrival_schedules import DATA_DIR
from specserve.benchmark.stdlib import stdlib_files
from specserve.errors import SpecServeError

DATASETS = {
    "spec-bench": "spec_bench/question.jsonl",
    "mt-bench": "mt_bench/question.jsonl",
    "sharegpt": "sharegpt/ShareGPT_V3_filtered_1000.json",
    "sharegpt-500": "sharegpt/ShareGPT_V3_filtered_500.json",
}
RANDOM = "random"
# Code completion prompts: prefixes of the CPython standard library's own modules, a real offline corpus
# on every machine (docs/design.md §7). It follows the running Python's version, so record that with results.
STDLIB = "python-stdlib"
_STDLIB_FILES = 400          # modules sampled (every n-th of the sorted list): enough variety, quick to load
_STDLIB_PREFIX_CHARS = 3000  # a prompt is the start of a module, cut at a line end
# English prose under the BPE vocabularies of current LLMs runs at about 4 characters per token. Used
# only when neither a tokenizer nor the server's usage numbers can tell us better.
DEFAULT_CHARS_PER_TOKEN = 4.0
# Mooncake traces describe shared prefixes as blocks of this many tokens (the Mooncake release's size).
MOONCAKE_BLOCK_TOKENS = 512
_FIT_ROUNDS = 12


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class HFTokenizer:
    """A `tokenizers.Tokenizer` counted without special tokens: the server adds its own BOS/template."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=False)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(path: str | None) -> HFTokenizer | None:
    """A tokenizer.json file, or a Hugging Face checkpoint folder that holds one."""
    if not path:
        return None
    from tokenizers import Tokenizer as _Tok

    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise SpecServeError(f"tokenizer {path!r}: no tokenizer.json there")
    return HFTokenizer(_Tok.from_file(str(p)))


def _texts_from_rows(rows: list) -> list[str]:
    """First turns, or prompts, of JSONL/JSON rows in the formats of the shipped sets."""
    out = []
    for row in rows:
        if isinstance(row, str):
            out.append(row)
        elif "turns" in row:                      # Spec-Bench, MT-Bench
            out.append(row["turns"][0])
        elif "conversations" in row:              # ShareGPT
            human = [c["value"] for c in row["conversations"] if c.get("from") in ("human", "user")]
            if human:
                out.append(human[0])
        elif "prompt" in row or "text" in row:
            out.append(row.get("prompt", row.get("text")))
    return [t for t in out if isinstance(t, str) and t.strip()]


def _stdlib_prefixes() -> list[str]:
    files = stdlib_files()
    step = max(1, len(files) // _STDLIB_FILES)
    texts = []
    for p in files[::step]:
        try:
            head = p.read_text(encoding="utf-8")[:_STDLIB_PREFIX_CHARS]
        except (OSError, UnicodeDecodeError):
            continue
        head = head[: head.rfind("\n") + 1] if "\n" in head else head
        if len(head) > 200:   # skip near-empty modules (__init__ stubs)
            texts.append(head)
    return texts


def load_dataset(name: str) -> list[str]:
    """Prompt texts of a shipped data set (by name), the Python stdlib, the code-edit sessions' first turns,
    or a .jsonl/.json file."""
    if name == code_edit.DATASET:
        return [session[0] for session in code_edit.build_sessions(200, 1)]
    if name == STDLIB:
        texts = _stdlib_prefixes()
        if not texts:
            raise SpecServeError("no Python standard library sources found for the python-stdlib data set")
        return texts
    if name in DATASETS:
        path = DATA_DIR / DATASETS[name]
    else:
        path = Path(name).expanduser()
        if not path.is_file():
            raise SpecServeError(f"dataset {name!r}: not one of {', '.join([*DATASETS, STDLIB, 'code-edit', RANDOM])} "
                                 "and not a file")
    text = path.read_text(encoding="utf-8")
    try:
        rows = json.loads(text) if path.suffix == ".json" else [json.loads(ln) for ln in text.splitlines()
                                                                 if ln.strip()]
    except json.JSONDecodeError as e:
        raise SpecServeError(f"dataset {path}: not JSON/JSONL ({e})") from None
    texts = _texts_from_rows(rows)
    if not texts:
        raise SpecServeError(f"dataset {path}: no prompts found")
    return texts


@dataclass
class Prompt:
    text: str
    tokens: int                 # our count: exact with a tokenizer, estimated without
    target_tokens: int | None   # length asked for (trace or --input-len); None for a dataset prompt as is
    max_tokens: int
    clipped: bool = False       # shortened to fit the server's maximum length


class PromptBuilder:
    """Cuts prompts of a given token length out of a corpus made from a data set's texts, reproducibly."""

    def __init__(self, texts: list[str], rng: np.random.Generator, tokenizer: Tokenizer | None = None,
                 chars_per_token: float = DEFAULT_CHARS_PER_TOKEN) -> None:
        self.texts = texts
        self.rng = rng
        self.tok = tokenizer
        self.chars_per_token = chars_per_token
        order = rng.permutation(len(texts))
        self.corpus = "\n\n".join(texts[i] for i in order)
        self.corpus_ids = np.array(tokenizer.encode(self.corpus)) if tokenizer else None
        self._blocks: dict[int, np.ndarray] = {}
        self._order = rng.permutation(len(texts))   # data set prompts in a seeded order, no repeats per pass
        self._next = 0

    def next_text(self) -> str:
        text = self.texts[int(self._order[self._next % len(self.texts)])]
        self._next += 1
        return text

    @property
    def exact(self) -> bool:
        return self.tok is not None

    def count(self, text: str) -> int:
        if self.tok is not None:
            return len(self.tok.encode(text))
        return max(1, round(len(text) / self.chars_per_token))

    def _cyclic(self, seq: np.ndarray | str, start: int, n: int):
        reps = -(-(start + n) // len(seq)) + 1
        whole = np.tile(seq, reps) if isinstance(seq, np.ndarray) else seq * reps
        return whole[start:start + n]

    def fit(self, seq: np.ndarray, n: int) -> tuple[str, int]:
        """Text of exactly n tokens (when reachable) made from the token ids `seq`, read in order.

        Decoding ids and encoding the text again can merge or split tokens at the cut (or at bytes of a
        split character), so we iterate on the text's own tokenization: too long, keep its first n
        tokens; too short, append the next ids of `seq`. Canonical tokens re-encode to themselves except
        near the cut, so this settles in a round or two. The count returned is always the true one.
        """
        ids, pos = [int(x) for x in seq[:n]], n
        best = ("", 0)
        for _ in range(_FIT_ROUNDS):
            text = self.tok.decode(ids)
            canon = self.tok.encode(text)
            if abs(len(canon) - n) < abs(best[1] - n) or not best[0]:
                best = (text, len(canon))
            if len(canon) == n:
                break
            # A cut through a multi-byte character decodes to U+FFFD, which encodes to more tokens than
            # the bytes it replaced: always end on a whole character.
            if len(canon) > n:
                ids = canon[:n]
                while len(ids) > 1 and self.tok.decode(ids).endswith("\ufffd"):
                    ids.pop()
            else:
                # Append the next ids, skipping ahead past fragments of characters (text in scripts of
                # several tokens per character could otherwise never add exactly one token).
                more = n - len(canon)
                for p in range(pos, max(pos + 1, min(pos + 64, len(seq) - more))):
                    ids = canon + [int(x) for x in seq[p:p + more]]
                    if not self.tok.decode(ids).endswith("\ufffd"):
                        break
                pos = p + more
        return best

    def from_corpus(self, n: int) -> tuple[str, int]:
        """n tokens of real text starting at a random place in the corpus (so prompts do not share prefixes)."""
        if self.tok is None:
            chars = max(1, round(n * self.chars_per_token))
            start = int(self.rng.integers(len(self.corpus)))
            text = self._cyclic(self.corpus, start, chars)
            return text, self.count(text)
        start = int(self.rng.integers(len(self.corpus_ids)))
        return self.fit(self._cyclic(self.corpus_ids, start, 2 * n + 64), n)

    def random_tokens(self, n: int) -> tuple[str, int]:
        """n uniformly random vocabulary tokens (or corpus words, approximately, without a tokenizer)."""
        if self.tok is None:
            words = self.corpus.split()
            out, chars = [], 0
            while chars < n * self.chars_per_token:   # ends: every word adds at least 2 characters
                w = words[int(self.rng.integers(len(words)))]
                out.append(w)
                chars += len(w) + 1
            text = " ".join(out)
            return text, self.count(text)
        ids = self.rng.integers(0, getattr(self.tok, "vocab_size", 1000), size=2 * n + 64)
        return self.fit(ids, n)

    def _block(self, h: int) -> np.ndarray:
        """The text block a Mooncake hash id stands for: the same id gives the same tokens every time."""
        if h not in self._blocks:
            start = int(self.rng.integers(len(self.corpus_ids)))
            self._blocks[h] = self._cyclic(self.corpus_ids, start, MOONCAKE_BLOCK_TOKENS)
        return self._blocks[h]

    def from_blocks(self, hash_ids: list[int], n: int) -> tuple[str, int]:
        """Prompt whose leading blocks are shared with every other request naming the same hash ids."""
        if self.tok is None:
            return self.from_corpus(n)
        ids = np.concatenate([self._block(h) for h in hash_ids])
        if len(ids) < 2 * n + 64:   # fewer blocks than the length asks for: continue with fresh text
            start = int(self.rng.integers(len(self.corpus_ids)))
            ids = np.concatenate([ids, self._cyclic(self.corpus_ids, start, 2 * n + 64 - len(ids))])
        return self.fit(ids, n)


def build_prompts(builder: PromptBuilder, count: int, *, dataset: str, input_lens: np.ndarray | None,
                  output_lens: np.ndarray | list[int], max_model_len: int | None = None,
                  hash_ids: list[list[int]] | None = None) -> list[Prompt]:
    """One prompt per request. `input_lens` None means the data set's prompts as they are.

    With a known `max_model_len`, prompt + output must fit: the prompt is clipped first (keeping at least
    one token), then the output; clipped prompts are flagged so the report can count them.
    """
    prompts = []
    for i in range(count):
        out_len = int(output_lens[i])
        target = int(input_lens[i]) if input_lens is not None else None
        clipped = False
        if max_model_len is not None:
            if target is not None and target + out_len > max_model_len:
                target, clipped = max(1, max_model_len - out_len), True
            if out_len >= max_model_len:
                out_len, clipped = max(1, max_model_len // 2), True
                target = min(target, max_model_len - out_len) if target is not None else None
        if target is None and dataset != RANDOM:
            text = builder.next_text()
            n = builder.count(text)
            if max_model_len is not None and n + out_len > max_model_len:
                text, n = builder.from_corpus(max(1, max_model_len - out_len))
                clipped = True
        elif dataset == RANDOM:
            if target is None:
                raise SpecServeError("the random data set needs --input-len (or a trace with lengths)")
            text, n = builder.random_tokens(target)
        elif hash_ids is not None and hash_ids[i]:
            text, n = builder.from_blocks(hash_ids[i], target)
        else:
            text, n = builder.from_corpus(target)
        prompts.append(Prompt(text, n, target, out_len, clipped))
    return prompts
