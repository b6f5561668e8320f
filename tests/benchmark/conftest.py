"""Shared fixtures: a small BPE tokenizer trained on shipped text, and the scripted fake server."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))   # fake_server lives beside the tests

from specserve.benchmark.prompts import HFTokenizer, load_dataset  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer (vocab 600) trained on 300 Spec-Bench prompts: real merges, fast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<s>"], show_progress=False)
    tok.train_from_iterator(load_dataset("spec-bench")[:300], trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_path) -> HFTokenizer:
    from tokenizers import Tokenizer

    return HFTokenizer(Tokenizer.from_file(str(tokenizer_path)))
