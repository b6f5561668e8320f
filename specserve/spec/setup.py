"""Build the proposer a SpeculativeConfig asks for, checking the draft fits the target."""
from __future__ import annotations

import json

import torch

from specserve.engine.model_runner import ModelRunner
from specserve.errors import SpecServeError
from specserve.model.loader import LoadedModel, load_model
from specserve.spec.config import SpeculativeConfig
from specserve.spec.proposer import DraftModelProposer, NgramProposer


def load_draft(spec: SpeculativeConfig, target: LoadedModel, config) -> LoadedModel | None:
    if spec.method != "draft_model":
        return None
    from specserve.spec.drafts import resolve_draft
    draft = load_model(resolve_draft(spec.model), spec.draft_dtype or config.dtype, config.device)
    if draft.tokenizer.hf.get_vocab() != target.tokenizer.hf.get_vocab():
        raise SpecServeError(f"draft model {spec.model} has a different tokenizer than the target "
                             f"{config.model}; speculative decoding needs the same vocabulary")
    return draft


def build_proposer(spec: SpeculativeConfig, draft: LoadedModel | None, target: LoadedModel, num_blocks: int,
                   block_size: int):
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    vocab_map = None
    if draft.config.draft_vocab_size:
        path = draft.path / "vocab_map.json"
        if not path.exists():
            raise SpecServeError(f"reduced-vocabulary draft {draft.path} has no vocab_map.json")
        vocab_map = torch.tensor(json.loads(path.read_text()), dtype=torch.long)
        if len(vocab_map) != draft.config.draft_vocab_size or int(vocab_map.max()) >= target.config.vocab_size:
            raise SpecServeError(f"vocab_map.json in {draft.path} does not match draft_vocab_size / the target vocabulary")
    lookup = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max) if spec.ngram_first else None
    return DraftModelProposer(ModelRunner(draft.model, num_blocks, block_size), target.config.vocab_size, vocab_map,
                              lookup)
