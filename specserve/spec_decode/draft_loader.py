"""Build the proposer a SpeculativeConfig asks for, checking the draft fits the target."""
from __future__ import annotations

import json

import torch

from specserve.errors import SpecServeError
from specserve.model.loader import LoadedModel, load_model
from specserve.spec_decode.choice import DraftChoice
from specserve.spec_decode.config import FREE, NGRAM, SUFFIX, SpeculativeConfig
from specserve.spec_decode.eagle import EagleProposer, TargetFeatures
from specserve.spec_decode.lookup import NgramProposer
from specserve.spec_decode.proposer import DraftModelProposer, Drafter
from specserve.spec_decode.router import RoutedProposer
from specserve.spec_decode.suffix import SuffixOptions, SuffixProposer


def load_drafts(spec: SpeculativeConfig, target: LoadedModel, config) -> list[LoadedModel]:
    """The draft models `spec` names (none for n-gram lookup; several are routed per request)."""
    if spec.method in FREE:
        return []
    from specserve.spec_decode.drafts import resolve_drafts
    vocab = target.tokenizer.hf.get_vocab()  # a dict of the whole vocabulary: built once, not per draft
    return [load_draft(name, spec, target, config, vocab) for name in resolve_drafts(spec.model)]


def load_draft(name: str, spec: SpeculativeConfig, target: LoadedModel, config, vocab: dict[str, int]
               ) -> LoadedModel:
    """vocab: the target's (token -> id), which the draft's must equal."""
    draft = load_model(name, spec.draft_dtype or config.dtype, config.device, spec.quantization)
    if draft.tokenizer.hf.get_vocab() != vocab:
        raise SpecServeError(f"draft model {name} has a different tokenizer than the target "
                             f"{config.model}; speculative decoding needs the same vocabulary")
    if spec.method == "eagle" and not draft.config.eagle:
        raise SpecServeError(f'"method": "eagle" needs an EAGLE draft (made by `specserve distill --method eagle`); '
                             f"{name} is a standalone draft: use \"method\": \"draft_model\"")
    if draft.config.eagle:
        if draft.config.hidden_size != target.config.hidden_size:
            raise SpecServeError(f"EAGLE draft {name} reads hidden states of width {draft.config.hidden_size}, "
                                 f"but the target's are {target.config.hidden_size} wide: it was made for another target")
        share_target_embedding(draft.model, target.model)
    return draft


def share_target_embedding(draft, target) -> None:
    """An EAGLE draft (LlamaModel) reads tokens through the target's own embedding, not stored with it."""
    shared, dtype = target.embed_tokens.weight, draft.norm.weight.dtype  # the draft's dtype (its fc may be quantized)
    draft.embed_tokens.weight = torch.nn.Parameter(shared.to(dtype), requires_grad=False) \
        if shared.dtype != dtype else shared


def load_vocab_map(draft: LoadedModel, target_vocab_size: int) -> torch.Tensor | None:
    """[draft vocab] target token id of each head row of a reduced-vocabulary draft; None for a full head."""
    if not draft.config.draft_vocab_size:
        return None
    path = draft.path / "vocab_map.json"
    if not path.exists():
        raise SpecServeError(f"reduced-vocabulary draft {draft.path} has no vocab_map.json")
    vocab_map = torch.tensor(json.loads(path.read_text()), dtype=torch.long)
    if len(vocab_map) != draft.config.draft_vocab_size or int(vocab_map.max()) >= target_vocab_size:
        raise SpecServeError(f"vocab_map.json in {draft.path} does not match draft_vocab_size / the target vocabulary")
    return vocab_map


def draft_names(drafts: list[LoadedModel]) -> list[str]:
    """Each draft's directory name ("code", "chat" for the shipped ones), or its whole path where two share one."""
    names = [d.path.name for d in drafts]
    return names if len(set(names)) == len(names) else [str(d.path) for d in drafts]


def suffix_proposer(spec: SpeculativeConfig, device) -> SuffixProposer:
    return SuffixProposer(SuffixOptions(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
                                        spec_factor=spec.suffix_decoding_max_spec_factor,
                                        min_token_prob=spec.suffix_decoding_min_token_prob), device)


def build_proposer(spec: SpeculativeConfig, drafts: list[LoadedModel], target: LoadedModel, make_runner,
                   choice: DraftChoice | None = None, names: list[str] | None = None,
                   features: TargetFeatures | None = None, lookups: list | None = None):
    """make_runner(model) -> the runner that drafts with `model` over the engine's block tables; choice: which
    source drafts each request (a lookup's hit or the model; None: the first hit); `features`: the target's
    hidden states that EAGLE drafts read (one store for all of them, made here if None); lookups: the free
    proposers the drafts share (so that suffix decoding's cache of earlier outputs is one; made here if None)."""
    device = target.model.embed_tokens.weight.device
    if spec.method == NGRAM:
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, device)
    if spec.method == SUFFIX:
        return suffix_proposer(spec, device)
    names = names or draft_names(drafts)
    if lookups is None:
        lookups = ([suffix_proposer(spec, device)] if spec.suffix_first else []) + (
            [NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, device)] if spec.ngram_first else [])
    if len(drafts) > 1:
        vocab = target.config.vocab_size
        proposers = []
        for d, name in zip(drafts, names):
            proposers.append(build_proposer(spec, [d], target, make_runner, choice, [name], features, lookups))
            features = getattr(proposers[-1], "features", features)  # EAGLE drafts share the first one's
        return RoutedProposer(proposers,
                              [load_vocab_map(d, vocab) for d in drafts], vocab, names)
    draft = drafts[0]
    drafter = Drafter(make_runner(draft.model), target.config.vocab_size,
                      load_vocab_map(draft, target.config.vocab_size), names[0], lookups, choice)
    return EagleProposer(drafter, features) if draft.config.eagle else DraftModelProposer(drafter)


def draft_runners(proposer) -> dict:
    """{draft name: the runner it drafts with} of a built proposer (empty for prompt lookup alone)."""
    if proposer is None or isinstance(proposer, (NgramProposer, SuffixProposer)):
        return {}
    if isinstance(proposer, RoutedProposer):
        return {name: p.runner for name, p in zip(proposer.names, proposer.proposers)}
    return {proposer.drafter.name: proposer.runner}
