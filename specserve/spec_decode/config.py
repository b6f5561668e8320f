"""`--speculative-config` in vLLM's format.

    {"model": "DIR_OR_ALIAS", "num_speculative_tokens": 4}                 draft model
    {"method": "ngram", "num_speculative_tokens": 4,
     "prompt_lookup_max": 4, "prompt_lookup_min": 2}                       prompt lookup, no draft model
    {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 64,
     "suffix_decoding_max_cached_requests": 1000, "suffix_decoding_max_spec_factor": 1.0,
     "suffix_decoding_min_token_prob": 0.1}                            suffix decoding (spec_decode/suffix.py)
    {"model": "DIR_OR_ALIAS", "num_speculative_tokens": 4, "ngram_first": true, "suffix_first": true}
                                      prompt lookup and/or suffix decoding where they find a match, the draft
                                      model elsewhere: each request, each step, whichever is predicted to
                                      commit the most tokens per unit of time (spec_decode/choice.py)
    {"method": "eagle", "model": "DIR_OR_ALIAS", "num_speculative_tokens": 4}
                                      a draft that reads the target's hidden state (`specserve distill
                                      --method eagle`); "draft_model" with such a directory works too
    {"model": ["code", "chat"], "num_speculative_tokens": 4}
                                      several reduced-vocabulary drafts: each request is drafted by the
                                      one whose vocabulary covers its prompt best (spec_decode/router.py);
                                      "default" is every shipped draft this way

A draft model can be quantized at load, as the target can: `"quantization": "q8_0"` (or q4_0, q4_1; the
CPU kernels read the blocks, elsewhere the dequantized values run).

Any of them takes `"policy"`: how many tokens each request drafts each step (spec_decode/policies/), with
the policy's own settings in `"policy_options"`. `none` (or an empty string) switches speculation off.

Benchmarks only: `"rejection_sample_method": "synthetic"` with `"synthetic_acceptance_rates": [r_1, ..., r_k]`
or `"synthetic_acceptance_length": L` keeps drafts at set rates instead of verifying them (vLLM's names;
spec_decode/synthetic.py), so random-weight shapes can be measured speculating; responses say so.

Two defaults, on purpose:
- a config that names no policy gets `static` (always num_speculative_tokens, which is the ceiling for
  every other policy): what vLLM does with the same config, and no startup profile of the step cost;
- `specserve serve` without `--speculative-config` runs DEFAULT_SPECULATIVE (`speculative_choice`): the
  shipped drafts under the `adaptive` policy, which chooses each request's length every step from the
  measured step cost and acceptance, so that speculation pays at batch 1 and backs off under load
  (docs/design.md §3.4). The server pays its startup profile once; a library user asks for it by name.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

from specserve.errors import SpecServeError
from specserve.spec_decode.synthetic import check_rates, rates_for_length

NGRAM = "ngram"  # the method, and the source name of prompt-lookup proposals (priced as a free draft)
SUFFIX = "suffix"  # the method, and the source name of suffix-decoding proposals (free too)
FREE = (NGRAM, SUFFIX)  # proposals that cost no draft forward
METHODS = ("draft_model", "eagle", NGRAM, SUFFIX)
# The server's default: prompt lookup where it finds a match, the shipped EAGLE drafts elsewhere (in Q8_0:
# the acceptance of bf16 at half the bytes, bench/results/spec_decode/2026-12-05-draft-quantization.md), each
# request's draft length chosen every step by the adaptive policy, up to 4. Suffix decoding ("suffix_first")
# is not in it: within lengths of 4 it drafted fewer accepted tokens a step than prompt lookup and cost host
# time each step, on natural code, chat and multi-turn code editing alike
# (docs/experiments/speculation-that-pays.md).
DEFAULT_SPECULATIVE = ('{"model": "default", "num_speculative_tokens": 4, "ngram_first": true, '
                       '"quantization": "q8_0", "policy": "adaptive"}')
DRAFT_QUANTIZATIONS = ("q8_0", "q4_0", "q4_1")  # model/quantize.py's at-load formats (CPU kernels)
OFF = ("", "none", "null", "off")  # --speculative-config values that switch speculation off
MAX_SPECULATIVE_TOKENS = 16  # verify queries stay in the "short" attention group (attention.SHORT_QUERY_MAX)


@dataclass(slots=True)
class SpeculativeConfig:
    method: str = "draft_model"
    model: str | list[str] | None = None  # a list: route each request to one of these drafts
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    draft_dtype: str | None = None  # default: the target's dtype
    quantization: str | None = None  # the drafts' weights: None dense; "q8_0", "q4_0", "q4_1" quantized at load
    ngram_first: bool = False  # draft model only: prompt lookup where it finds a match (spec_decode/choice.py)
    suffix_first: bool = False  # draft model only: suffix decoding where it finds a match
    suffix_decoding_max_tree_depth: int = 64  # vLLM's names; spec_decode/suffix.py says what each does
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    policy: str = "static"  # spec_decode/policies/: how many tokens each request drafts, step by step
    policy_options: dict | None = None
    # Benchmark only (spec_decode/synthetic.py): "synthetic" keeps drafts at set rates instead of verifying them.
    rejection_sample_method: str = "standard"
    synthetic_acceptance_rates: list[float] | None = None  # per position, unconditional, non-increasing
    synthetic_acceptance_length: float | None = None  # or: mean tokens a step at k drafts (one rate per position)

    def __post_init__(self):
        if self.method == "draft":
            self.method = "draft_model"
        if self.method not in METHODS:
            raise SpecServeError(f"speculative method {self.method!r} is not supported (choose from {', '.join(METHODS)})")
        if not 1 <= self.num_speculative_tokens < MAX_SPECULATIVE_TOKENS:
            raise SpecServeError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS - 1}], "
                                 f"got {self.num_speculative_tokens}")
        if isinstance(self.model, list) and not (self.model and all(isinstance(m, str) and m for m in self.model)):
            raise SpecServeError(f'"model" must be a draft name or a non-empty list of draft names, got {self.model!r}')
        if self.method in ("draft_model", "eagle") and not self.model:
            raise SpecServeError('speculative config needs "model" (a draft directory or alias) '
                                 'or "method": "ngram" or "suffix"')
        for name in ("ngram_first", "suffix_first"):
            if not isinstance(getattr(self, name), bool):
                raise SpecServeError(f"{name} must be true or false, got {getattr(self, name)!r}")
            if getattr(self, name) and self.method in FREE:
                raise SpecServeError(f'"{name}" combines a model-free proposer with a draft model: it needs "model"')
        if not (isinstance(self.suffix_decoding_max_tree_depth, int) and self.suffix_decoding_max_tree_depth >= 1):
            raise SpecServeError("suffix_decoding_max_tree_depth must be a positive integer")
        if not (isinstance(self.suffix_decoding_max_cached_requests, int)
                and self.suffix_decoding_max_cached_requests >= 0):
            raise SpecServeError("suffix_decoding_max_cached_requests must be an integer >= 0 (0: no cache)")
        if not (isinstance(self.suffix_decoding_max_spec_factor, (int, float))
                and self.suffix_decoding_max_spec_factor > 0):
            raise SpecServeError("suffix_decoding_max_spec_factor must be a positive number")
        if not (isinstance(self.suffix_decoding_min_token_prob, (int, float))
                and 0 <= self.suffix_decoding_min_token_prob <= 1):
            raise SpecServeError("suffix_decoding_min_token_prob must be in [0, 1]")
        if not isinstance(self.policy, str) or not self.policy:
            raise SpecServeError(f'"policy" must be a policy name, got {self.policy!r}')
        if self.policy_options is not None and not isinstance(self.policy_options, dict):
            raise SpecServeError(f'"policy_options" must be a JSON object, got {self.policy_options!r}')
        if self.quantization is not None and self.quantization not in DRAFT_QUANTIZATIONS:
            raise SpecServeError(f'"quantization" of the drafts must be one of {", ".join(DRAFT_QUANTIZATIONS)} '
                                 f"(or absent: dense), got {self.quantization!r}")
        self._check_synthetic()
        uses_lookup = self.method == NGRAM or self.ngram_first
        if uses_lookup and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise SpecServeError("need 1 <= prompt_lookup_min <= prompt_lookup_max")

    def _check_synthetic(self) -> None:
        if self.rejection_sample_method not in ("standard", "synthetic"):
            raise SpecServeError(f'"rejection_sample_method" must be "standard" or "synthetic", '
                                 f"got {self.rejection_sample_method!r}")
        given = [name for name in ("synthetic_acceptance_rates", "synthetic_acceptance_length")
                 if getattr(self, name) is not None]
        if self.rejection_sample_method == "standard" and given:
            raise SpecServeError(f'"{given[0]}" needs "rejection_sample_method": "synthetic" (benchmarks only: '
                                 "the output then does not follow the target model)")
        if self.rejection_sample_method == "synthetic" and len(given) != 1:
            raise SpecServeError('"rejection_sample_method": "synthetic" needs exactly one of '
                                 '"synthetic_acceptance_rates" and "synthetic_acceptance_length"')
        if self.synthetic_acceptance_rates is not None:
            check_rates(self.synthetic_acceptance_rates, self.num_speculative_tokens)
        if self.synthetic_acceptance_length is not None:
            if not isinstance(self.synthetic_acceptance_length, (int, float)):
                raise SpecServeError(f"synthetic_acceptance_length must be a number, "
                                     f"got {self.synthetic_acceptance_length!r}")
            rates_for_length(self.synthetic_acceptance_length, self.num_speculative_tokens)

    @property
    def synthetic_rates(self) -> list[float] | None:
        """The unconditional per-position acceptance rates of synthetic verification (None: verification)."""
        if self.rejection_sample_method != "synthetic":
            return None
        if self.synthetic_acceptance_rates is not None:  # checked in __post_init__
            return [float(r) for r in self.synthetic_acceptance_rates]
        return rates_for_length(self.synthetic_acceptance_length, self.num_speculative_tokens)

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if value.strip().lower() in OFF:
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise SpecServeError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise SpecServeError("--speculative-config must be a JSON object")
        value = dict(value)
        if "model" in value and "method" not in value:
            value["method"] = "draft_model"
        known = {f.name for f in fields(cls)}
        unknown = set(value) - known
        if unknown:
            raise SpecServeError(f"unknown speculative config keys: {', '.join(sorted(unknown))}")
        return cls(**value)


def speculative_choice(value: str | None, model: str) -> tuple[str | None, str]:
    """The speculative config a server of `model` runs, given its --speculative-config `value`, and why.
    Without one, the shipped drafts run if they are installed, but only with the default target: a draft
    must share the target's vocabulary."""
    from specserve.model.registry import DEFAULT_MODEL
    from specserve.spec_decode.drafts import SHIPPED, shipped_draft_dir

    if value is not None:
        if value.strip().lower() in OFF:
            return None, "speculative decoding off (--speculative-config none)"
        return value, "speculative config from --speculative-config"
    if model != DEFAULT_MODEL:
        return None, "speculative decoding off (no --speculative-config; the shipped drafts pair with the default model only)"
    if all((shipped_draft_dir(name) / "config.json").exists() for name in SHIPPED):
        return DEFAULT_SPECULATIVE, f"speculative decoding with the shipped drafts: {DEFAULT_SPECULATIVE}"
    return None, "speculative decoding off (the shipped drafts are not installed; pass --speculative-config)"
