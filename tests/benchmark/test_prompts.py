import numpy as np
import pytest

from specserve.benchmark.prompts import (DATASETS, PromptBuilder, build_prompts, load_dataset,
                                         load_tokenizer)
from specserve.benchmark.arrival_schedules import load_trace
from specserve.benchmark.workload import WorkloadSpec, make_workload
from specserve.errors import SpecServeError


def builder(tokenizer=None, seed=0, texts=None):
    return PromptBuilder(texts or load_dataset("spec-bench"), np.random.default_rng(seed), tokenizer)


def test_shipped_datasets_load():
    sizes = {name: len(load_dataset(name)) for name in DATASETS}
    assert sizes == {"spec-bench": 480, "mt-bench": 80, "sharegpt": 1000, "sharegpt-500": 500}
    with pytest.raises(SpecServeError):
        load_dataset("no-such-set")


def test_python_stdlib_code_prompts():
    texts = load_dataset("python-stdlib")
    assert len(texts) > 100
    assert sum(("def " in t or "import " in t) for t in texts) > 0.8 * len(texts)
    assert all(t.endswith("\n") and len(t) <= 3000 for t in texts)
    w = make_workload(WorkloadSpec(dataset="python-stdlib", max_concurrency=1, max_requests=3))
    assert w.prompt_info["python_version"] and all(p.text in texts for p in w.prompts)


def test_exact_token_length_from_corpus(tokenizer):
    # Random places in a corpus with translation prompts (German, and other scripts in places): cuts
    # fall inside words and multi-byte characters.
    b = builder(tokenizer, seed=5)
    lengths = [1, 2, 7, 64, 511, 2000] + [int(x) for x in np.random.default_rng(0).integers(1, 1500, 60)]
    for n in lengths:
        text, got = b.from_corpus(n)
        assert (got, len(tokenizer.encode(text))) == (n, n)


def test_exact_random_tokens(tokenizer):
    b = builder(tokenizer)
    for n in (5, 300):
        text, got = b.random_tokens(n)
        assert got == n == len(tokenizer.encode(text))


def test_load_tokenizer_from_file_or_folder(tokenizer_path):
    assert load_tokenizer(str(tokenizer_path)).encode("hello world")
    assert load_tokenizer(str(tokenizer_path.parent)).encode("hello world")
    assert load_tokenizer(None) is None
    with pytest.raises(SpecServeError):
        load_tokenizer(str(tokenizer_path.parent / "nope"))


def test_approximate_lengths_without_tokenizer():
    b = PromptBuilder(load_dataset("spec-bench"), np.random.default_rng(0), None, chars_per_token=3.5)
    text, est = b.from_corpus(200)
    assert len(text) == 700 and est == 200
    assert not b.exact


def test_build_prompts_seeded_and_clipped(tokenizer):
    ins, outs = np.array([50, 300, 20]), np.array([10, 40, 10])
    a = build_prompts(builder(tokenizer, 3), 3, dataset="spec-bench", input_lens=ins, output_lens=outs,
                      max_model_len=256)
    b = build_prompts(builder(tokenizer, 3), 3, dataset="spec-bench", input_lens=ins, output_lens=outs,
                      max_model_len=256)
    c = build_prompts(builder(tokenizer, 4), 3, dataset="spec-bench", input_lens=ins, output_lens=outs,
                      max_model_len=256)
    assert [p.text for p in a] == [p.text for p in b]
    assert [p.text for p in a] != [p.text for p in c]
    assert [p.tokens for p in a] == [50, 216, 20]        # 300 + 40 > 256: clipped to 256 - 40
    assert [p.clipped for p in a] == [False, True, False]
    assert [p.max_tokens for p in a] == [10, 40, 10]


def test_dataset_prompts_as_they_are(tokenizer):
    texts = load_dataset("mt-bench")
    ps = build_prompts(builder(tokenizer, texts=texts), 100, dataset="mt-bench", input_lens=None,
                       output_lens=np.full(100, 8))
    assert len({p.text for p in ps[:80]}) == 80              # one pass over the set before repeating
    assert all(p.text in texts and p.target_tokens is None for p in ps)
    with pytest.raises(SpecServeError):
        build_prompts(builder(tokenizer), 1, dataset="random", input_lens=None, output_lens=[4])


def test_mooncake_blocks_share_prefixes(tokenizer):
    b = builder(tokenizer)
    (a_text, a_n), (c_text, c_n) = b.from_blocks([7, 8], 700), b.from_blocks([7, 9], 700)
    assert a_n == c_n == 700
    block = tokenizer.decode(b._block(7).tolist())
    shared = len(block) - 8          # the last characters of a block may merge with the next block
    assert a_text[:shared] == c_text[:shared] == block[:shared]
    assert a_text != c_text


def test_workload_from_default_trace_uses_its_lengths(tokenizer):
    w = make_workload(WorkloadSpec(duration_s=20.0, seed=1), tokenizer=tokenizer, max_model_len=4096)
    assert w.arrival["process"] == "trace" and w.arrival["trace"]["source"] == "azure-conv"
    assert w.arrival_s[0] == 0.0 and w.arrival_s[-1] < 20.0
    assert all(p.tokens == p.target_tokens for p in w.prompts)
    assert w.prompt_info["exact_length"] and w.prompt_info["num_length_misses"] == 0
    # The Azure trace's first request: 374 prompt tokens, 44 output tokens.
    assert (w.prompts[0].target_tokens, w.prompts[0].max_tokens) == (374, 44)


def test_workload_poisson_and_closed():
    w = make_workload(WorkloadSpec(request_rate=5.0, max_requests=30, input_len=40, output_len=7))
    assert w.arrival["process"] == "poisson" and len(w.prompts) == 30 and w.offered_rate == 5.0
    assert {p.max_tokens for p in w.prompts} == {7} and w.prompt_info["counting"] == "estimate"
    g = make_workload(WorkloadSpec(request_rate=5.0, burstiness=3.0, duration_s=10.0))
    assert g.arrival["process"] == "gamma" and g.arrival_s.max() < 10.0
    c = make_workload(WorkloadSpec(max_concurrency=4, max_requests=9))
    assert c.arrival["process"] == "closed" and np.all(c.arrival_s == 0) and c.offered_rate is None


def test_synthetic_arrivals_draw_trace_lengths_from_the_whole_trace():
    """With a rate, request i must not take trace row i: a short run would see only the trace's first
    rows (their outputs average far below the trace's). Rows are drawn at random, seeded, and a run at
    another rate draws the same rows in the same order."""
    trace = load_trace("azure-conv")
    t = make_workload(WorkloadSpec(request_rate=2.0, max_requests=2000, trace="azure-conv"))
    assert t.arrival["trace"]["rows"] == "random"
    out = np.array([p.max_tokens for p in t.prompts])
    assert [p.max_tokens for p in t.prompts[:3]] != [44, 109, 55]   # the trace's first three rows
    whole, first = trace.output_tokens.mean(), trace.output_tokens[:2000].mean()
    assert abs(out.mean() - whole) < abs(first - whole) / 3
    assert set(out) <= set(trace.output_tokens.tolist())
    again = make_workload(WorkloadSpec(request_rate=9.0, max_requests=50, trace="azure-conv"))
    assert [p.max_tokens for p in again.prompts] == out[:50].tolist()
