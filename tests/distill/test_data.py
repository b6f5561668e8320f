"""The data pipeline: held-out split, windows, draft vocabulary and coverage, teacher top-k cache format."""
from pathlib import Path

import numpy as np
import pytest
import torch

from specserve.distill import corpus
from specserve.distill.student import causal_forward
from specserve.distill.teacher import PAD, TeacherCache, teach
from specserve.model.loader import load_model


def test_stdlib_split_is_disjoint_stable_and_about_one_in_twenty():
    train, held = corpus.stdlib_files("train"), corpus.stdlib_files("eval")
    assert not set(train) & set(held)
    assert 0.02 < len(held) / (len(train) + len(held)) < 0.09
    assert held == corpus.stdlib_files("eval")  # same split every call (hash of the path, not random)


def test_chat_training_never_sees_benchmark_prompts(tiny_target):
    from specserve.distill.evaluate import chat_prompts
    bench = {q["text"].strip() for q in corpus.spec_bench_questions("eval")}
    bench_train = {q["text"].strip() for q in corpus.spec_bench_questions("train")}
    train, held = corpus.sharegpt_prompts("train"), corpus.sharegpt_prompts("eval")
    assert train and held and not set(train) & set(held)
    assert not bench & set(train) and not bench & bench_train
    assert (len(bench), len(bench_train)) == (130, 350)  # MT-Bench's 80 + 10 of each task category held out
    assert {q["category"] for q in corpus.spec_bench_questions("eval")} >= {
        "writing", "coding", "summarization", "translation", "rag"}
    # The acceptance benchmark's prompts are held-out questions, and it cannot ask for more than there are.
    tok = load_model(str(tiny_target), "float32").tokenizer
    asked = [ids for ids_list in chat_prompts(tok, 10).values() for ids in ids_list]
    held_ids = [tok.encode_chat([{"role": "user", "content": q["text"]}]) for q in corpus.spec_bench_questions("eval")]
    assert len(asked) == 130 and all(ids in held_ids for ids in asked)
    with pytest.raises(ValueError, match="held-out"):
        chat_prompts(tok, 11)


def test_windows_and_padding():
    stream = np.arange(10, dtype=np.int32)
    assert corpus.stream_windows(stream, 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    w = corpus.sample_windows([np.array([1, 2, 3]), np.arange(10)], 5, PAD)
    assert w.tolist() == [[1, 2, 3, PAD, PAD], [0, 1, 2, 3, 4]]


def test_frequent_vocab_keeps_the_most_frequent_and_the_required_tokens():
    stream = np.array([5] * 10 + [7] * 5 + [9] * 3 + [1], dtype=np.int32)
    vocab = corpus.frequent_vocab(stream, 3, vocab_size=12, must_keep=[11])
    assert vocab == [5, 7, 11]
    assert corpus.coverage(stream, vocab) == 15 / 19
    assert corpus.coverage(stream, None) == 1.0


def test_teacher_cache_holds_exact_top_k_and_logsumexp(tiny_target, tmp_path):
    target = load_model(str(tiny_target), "float32")
    windows = np.random.default_rng(0).integers(0, 256, (6, 12)).astype(np.int32)
    windows[1, 9:] = PAD
    entry = teach(target.model, windows, k=8, chunk=4)
    assert entry["tokens"].dtype == torch.int32 and entry["topk_ids"].shape == (6, 12, 8)
    assert entry["topk_logits"].dtype == torch.float16 and entry["lse"].dtype == torch.float32
    logits = target.model.lm_head(causal_forward(target.model, torch.from_numpy(windows).long().clamp_min(0)))
    assert torch.equal(entry["topk_ids"][..., 0].long(), logits.argmax(-1))
    assert torch.allclose(entry["lse"], logits.logsumexp(-1), atol=1e-4)
    assert torch.allclose(entry["topk_logits"].float(), logits.topk(8, dim=-1).values, atol=2e-2)
    assert torch.equal(entry["tokens"][1, 9:], torch.full((3,), PAD, dtype=torch.int32))
    alone = teach(target.model, windows[1:2], k=8)  # a chunk that is all padding after 9 tokens: trimmed
    assert torch.equal(alone["topk_ids"][0, :9], entry["topk_ids"][1, :9]) and alone["topk_ids"].shape == (1, 12, 8)
    # The dense causal forward used for teaching is the engine's model: same logits as a paged decode.
    from specserve import LLM, SamplingParams
    out = LLM(model=str(tiny_target), dtype="float32").generate(
        [windows[0].tolist()], SamplingParams(max_tokens=1, temperature=0))[0]
    assert out.token_ids[0] == int(entry["topk_ids"][0, -1, 0])

    cache = TeacherCache(tmp_path / "cache", lambda rows: teach(target.model, rows, 8), windows, shard_size=3)
    first = cache.get(1)
    assert cache.tokens_taught == int((windows[3:6] != PAD).sum()) and (tmp_path / "cache" / "shard-00001.safetensors").exists()
    again = cache.get(1)  # served from disk, not taught again
    assert cache.tokens_taught == int((windows[3:6] != PAD).sum())
    assert all(torch.equal(first[k], again[k]) for k in first)


def test_low_rank_embedding_draft_round_trips_and_matches_the_engine(tiny_target, tmp_path):
    """The draft architecture the distiller ships (factorised input embedding, reduced head) saves, loads
    and computes the same logits through the engine's paged forward as through the training forward."""
    from specserve.distill.export import export_draft
    from specserve.distill.student import draft_config, init_student
    from specserve.engine.model_runner import ForwardItem, ModelRunner
    target = load_model(str(tiny_target), "float32")
    vocab = torch.arange(0, 260, 2)
    cfg = draft_config(target.config, layers=2, hidden=64, draft_vocab=len(vocab), embedding_rank=16)
    student = init_student(target.model, cfg, vocab, seed=0)
    out = export_draft(student, vocab.tolist(), tiny_target, tmp_path / "d", {"note": "test"}, torch.float32)
    loaded = load_model(str(out), "float32")
    assert loaded.config.embedding_rank == 16 and loaded.config.draft_vocab_size == 130
    ids = list(range(3, 40))
    dense = loaded.model.lm_head(causal_forward(loaded.model, torch.tensor([ids])))[0]
    assert torch.allclose(dense, student.lm_head(causal_forward(student, torch.tensor([ids])))[0], atol=1e-5)
    runner = ModelRunner(loaded.model, num_blocks=8, block_size=16)
    paged, _ = runner.forward([ForwardItem(ids, len(ids), list(range(8)), len(ids))])
    assert torch.allclose(paged, dense, atol=1e-4)


def test_unrolled_mask_table():
    """Keys visible to draft step s at position j, over passes 1..s (1 = visible), for T = 4."""
    from specserve.distill.student import unrolled_mask
    table = {
        1: ["1000", "1100", "1110", "1111"],
        2: ["0000 1000", "1000 0100", "1100 0010", "1110 0001"],
        3: ["0000 0000 1000", "0000 1000 0100", "1000 0100 0010", "1100 0010 0001"],
    }
    for s, rows in table.items():
        want = torch.tensor([[c == "1" for c in row.replace(" ", "")] for row in rows])
        assert torch.equal(unrolled_mask(4, s - 1), want), s


def test_training_passes_are_the_draft_steps_of_inference(tiny_target):
    """Pass s of EAGLE training at position j is what draft step s computes at inference: rows up to
    j - s + 1 made from the target's features, each later row from the previous row's own prediction,
    recomputed here one row at a time with plain causal attention."""
    from specserve.distill.eagle_draft import draft_passes, eagle_config, init_eagle
    target = load_model(str(tiny_target), "float32")
    model = init_eagle(target.model, eagle_config(target.config, 1, None), None, seed=0)
    with torch.no_grad():  # large weights, so that attending to the wrong rows shows
        for p in model.layers.parameters():
            if p.dim() == 2:
                p.normal_(std=0.3)
    torch.manual_seed(1)
    t, hidden = 10, target.config.hidden_size
    ids, prev = torch.randint(0, 200, (1, t)), torch.randn(1, t, hidden)
    with torch.no_grad():
        passes = draft_passes(model, ids, prev, 4)
        plain = draft_passes(model, ids, prev, 1)[0]
        for s, out in enumerate(passes, 1):
            for j in range(s - 1, t):
                feats = prev[:, :j - s + 2]
                for r in range(j - s + 2, j + 1):  # row r reads the prediction made at row r - 1
                    step = draft_passes(model, ids[:, :r], feats, 1)[0]
                    feats = torch.cat([feats, step[:, -1:]], 1)
                want = draft_passes(model, ids[:, :j + 1], feats, 1)[0][0, -1]
                assert torch.allclose(out[0, j], want, atol=1e-3), (s, j)  # chained fp32 rounding: ~1e-4
                if s > 1 and j >= s:  # the test can tell: pass s is not step 1
                    assert (plain[0, j] - want).abs().max() > 0.1, (s, j)


def test_eagle_loss_is_smooth_l1_plus_weighted_kl_over_the_non_padding_rows(tiny_target):
    """The loss, recomputed in fp32 from its definition (EAGLE: SmoothL1(f̂, f) + w · KL(p || q), p and q
    softmax of the kept head rows applied to f and f̂) on the unpadded rows; padding rows do not count."""
    import torch.nn.functional as F
    from specserve.distill.eagle_draft import EagleObjective, draft_passes, eagle_config, init_eagle, previous_features
    target = load_model(str(tiny_target), "float32")
    vocab_map = torch.arange(0, 200, 2)
    model = init_eagle(target.model, eagle_config(target.config, 1, len(vocab_map)), vocab_map, seed=0)
    torch.manual_seed(0)
    tokens = torch.randint(0, 200, (3, 12), dtype=torch.int32)
    tokens[1, 7:] = PAD
    features = torch.randn(3, 12, target.config.hidden_size)
    features[1, 7:] = 1e3  # garbage under the padding: would dominate any loss that read it
    objective = EagleObjective(None, passes=2, cls_weight=0.3, noise=0.0)
    loss, parts = objective.loss(model, {"tokens": tokens, "features": features})
    valid = tokens >= 0
    with torch.no_grad():
        outs = draft_passes(model, tokens.long().clamp_min(0), previous_features(features), 2)
        want = 0.0
        for s, out in enumerate(outs, 1):
            logp = F.log_softmax(features[valid] @ model.lm_head.weight.T, -1)
            logq = F.log_softmax(out[valid] @ model.lm_head.weight.T, -1)
            kl = (logp.exp() * (logp - logq)).sum(-1).mean()
            reg = F.smooth_l1_loss(out[valid], features[valid])
            assert abs(parts[f"kl{s}"] - float(kl)) < 0.02 * float(kl) + 1e-3, s  # bf16 head: ~1 % apart
            assert abs(parts[f"reg{s}"] - float(reg)) < 0.02 * float(reg), s
            want += reg + 0.3 * kl
    assert abs(float(loss.detach()) - float(want)) < 0.02 * float(want)


def test_similar_length_batches_cut_padding_change_no_loss_and_pick_every_window_alike(tiny_target):
    """Batches of similar-length windows cut to their longest real window: the EAGLE loss of a cut batch is
    the loss of the same windows uncut, and every window of a shard is picked about as often."""
    from specserve.distill.eagle_draft import EagleObjective, eagle_config, init_eagle
    from specserve.distill.train import similar_length_batch
    target = load_model(str(tiny_target), "float32")
    model = init_eagle(target.model, eagle_config(target.config, 1, None), None, seed=0)
    torch.manual_seed(0)
    lengths = torch.randint(4, 24, (32,))
    tokens = torch.randint(0, 200, (32, 24), dtype=torch.int32)
    tokens[torch.arange(24)[None] >= lengths[:, None]] = PAD
    shard = {"tokens": tokens, "features": torch.randn(32, 24, target.config.hidden_size),
             "index": torch.arange(32)[:, None].expand(32, 24)}
    objective = EagleObjective(None, passes=2, noise=0.0)
    cut = similar_length_batch(shard, 6)
    rows = cut["index"][:, 0]
    assert len(rows) == 6 and cut["tokens"].shape[1] == int(lengths[rows].max())
    whole = {k: shard[k][rows] for k in ("tokens", "features")}
    with torch.no_grad():
        a = float(objective.loss(model, {k: cut[k] for k in ("tokens", "features")})[0])
        b = float(objective.loss(model, whole)[0])
    assert abs(a - b) < 1e-3 * b
    picked = torch.zeros(32)
    for _ in range(2000):
        picked[similar_length_batch(shard, 6)["index"][:, 0]] += 1
    assert ((picked / 2000 - 6 / 32).abs() < 0.04).all()  # each window in 6 of 32 batches (SE ~0.009)
    spread = [float(lengths[similar_length_batch(shard, 6)["index"][:, 0]].float().std()) for _ in range(50)]
    assert sum(spread) / 50 < 0.5 * float(lengths.float().std())  # similar lengths, unlike a random six


def _contains(haystack: np.ndarray, needle: np.ndarray) -> bool:
    windows = np.lib.stride_tricks.sliding_window_view(haystack, len(needle))
    return bool((windows == needle).all(1).any())


def test_continuation_windows_are_a_corpus_prefix_and_the_targets_own_greedy_reply(tiny_target, tiny_corpus,
                                                                                  tmp_path):
    from specserve import LLM, SamplingParams
    from specserve.distill.pipeline import build_data
    from tests.distill.conftest import tiny_config
    target = load_model(str(tiny_target), "float32")
    cfg = tiny_config(tiny_target, tiny_corpus, tmp_path, steps=0, continuations=6, max_reply_tokens=24, window=72)
    train_w, eval_w, stream = build_data(cfg, target, log=lambda m: None)
    assert train_w.shape == (6, 72) and eval_w.shape == (8, 72) and (train_w >= 0).all()
    # The same split as windows of the text alone: training prefixes from training text, held-out from held-out.
    plain = tiny_config(tiny_target, tiny_corpus, tmp_path, steps=0, window=48)
    _, _, plain_stream = build_data(plain, target, log=lambda m: None)
    whole = corpus.token_stream(corpus.tokenize(target.tokenizer, [Path(p).read_text() for p in tiny_corpus]), 0)
    assert all(_contains(plain_stream, w[:48]) for w in train_w)
    assert all(_contains(whole, w[:48]) and not _contains(plain_stream, w[:48]) for w in eval_w)
    # The reply is what the engine serving the target in bf16 generates from the prefix, greedy, through EOS.
    llm = LLM(model=str(tiny_target), dtype="bfloat16")
    outs = llm.generate([w[:48].tolist() for w in train_w[:3]],
                        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert [list(o.token_ids) for o in outs] == train_w[:3, 48:].tolist()
    assert len(stream) == len(plain_stream) + train_w.size  # the draft vocabulary is counted over the replies too
    # Generated once: a second build reads them from the work directory.
    cached = (tmp_path / "work-draft" / "continuations.jsonl").read_text()
    again, _, _ = build_data(cfg, target, log=lambda m: None)
    assert np.array_equal(np.sort(again, 0), np.sort(train_w, 0))
    assert (tmp_path / "work-draft" / "continuations.jsonl").read_text() == cached


def test_continuation_features_recorded_while_generating_match_a_teacher_pass(tiny_target, tiny_corpus, tmp_path):
    """An EAGLE run keeps the hidden states the engine computed while generating the continuations: the same
    features a second pass of the (bf16) target would compute, so the training shards need no teacher."""
    from specserve.distill.pipeline import build_data, run
    from specserve.distill.teacher import teach_features
    from tests.distill.conftest import tiny_config
    target = load_model(str(tiny_target), "float32")
    cfg = tiny_config(tiny_target, tiny_corpus, tmp_path, steps=0, continuations=8, max_reply_tokens=24,
                      window=72, method="eagle")
    recorded = {}
    train_w, eval_w, _ = build_data(cfg, target, lambda m: None, recorded)
    assert set(recorded) == {w.tobytes() for w in np.concatenate([train_w, eval_w])}
    windows = train_w[:4]
    taught = teach_features(target.model.to(torch.bfloat16), windows)["features"].float()
    got = torch.stack([recorded[w.tobytes()] for w in windows]).float()
    assert got.shape == taught.shape == (4, 72, target.config.hidden_size)
    assert torch.allclose(got, taught, atol=0.02 * float(taught.abs().max()))  # bf16 kernels round differently
    assert (got[:, -1].abs().sum(-1) > 0).all()  # the last reply token's position is recorded too
    # A fresh run writes those as its feature shards and never runs the teacher.
    info = run(tiny_config(tiny_target, tiny_corpus, tmp_path, steps=1, name="fresh", continuations=8,
                           max_reply_tokens=24, window=72, method="eagle"), log=lambda m: None)
    assert info["teacher_tokens_cached"] == 0


def test_chat_features_recorded_while_generating_match_a_teacher_pass(tiny_target, tmp_path):
    """Chat samples end at EOS: the target never runs that last token, so a sample is prompt + reply without
    it, and the features recorded while generating cover every position of the window (padding: zeros)."""
    from specserve.distill.pipeline import build_data, run
    from specserve.distill.teacher import teach_features
    from tests.distill.conftest import tiny_config
    target = load_model(str(tiny_target), "float32")
    eos = set(target.tokenizer.eos_token_ids)
    cfg = tiny_config(tiny_target, ["chat"], tmp_path, steps=0, chat_prompts=12, spec_bench=True,
                      max_reply_tokens=16, window=64, method="eagle")
    recorded = {}
    train_w, eval_w, _ = build_data(cfg, target, lambda m: None, recorded)
    assert len(train_w) == 12 + 350 and set(recorded) == {w.tobytes() for w in np.concatenate([train_w, eval_w])}
    last = [w[w != PAD][-1] for w in train_w]
    assert not any(t in eos for t in last)  # no row after EOS
    windows = train_w[:8]
    taught = teach_features(target.model.to(torch.bfloat16), windows)["features"].float()
    got = torch.stack([recorded[w.tobytes()] for w in windows]).float()
    assert got.shape == taught.shape == (8, 64, target.config.hidden_size)
    assert torch.allclose(got, taught, atol=0.02 * float(taught.abs().max()))  # bf16 kernels round differently
    assert ((got.abs().sum(-1) > 0) == torch.from_numpy(windows != PAD)).all()  # every real position recorded
    info = run(tiny_config(tiny_target, ["chat"], tmp_path, steps=1, name="fresh", chat_prompts=12,
                           spec_bench=True, max_reply_tokens=16, window=64, method="eagle"), log=lambda m: None)
    assert info["teacher_tokens_cached"] == 0


def test_sampled_replies_add_seeded_training_windows_per_prompt_and_none_held_out(tiny_target, tmp_path):
    """--replies-per-prompt 3: each training prompt gets its greedy reply and two replies sampled with their own
    seeds (distinct, the same on a rerun, features recorded); held-out windows stay the greedy replies."""
    from specserve.distill.pipeline import build_data
    from specserve.errors import SpecServeError
    from tests.distill.conftest import tiny_config
    target = load_model(str(tiny_target), "float32")
    kw = dict(chat_prompts=6, max_reply_tokens=40, method="eagle")
    greedy_w, greedy_eval, _ = build_data(tiny_config(tiny_target, ["chat"], tmp_path, steps=0, name="g", **kw),
                                          target, lambda m: None, {})
    cfg = tiny_config(tiny_target, ["chat"], tmp_path, steps=0, name="s", replies_per_prompt=3, **kw)
    recorded = {}
    train_w, eval_w, _ = build_data(cfg, target, lambda m: None, recorded)
    assert len(train_w) == 3 * len(greedy_w) == 18
    assert {w.tobytes() for w in eval_w} == {w.tobytes() for w in greedy_eval}
    assert {w.tobytes() for w in greedy_w} <= {w.tobytes() for w in train_w}
    assert len({w.tobytes() for w in train_w}) > len(greedy_w) + 6  # most sampled replies differ from the greedy
    assert set(recorded) == {w.tobytes() for w in np.concatenate([train_w, eval_w])}
    again, _, _ = build_data(cfg, target, lambda m: None, None)  # read back from chat_samples.jsonl
    assert np.array_equal(again, train_w)
    fresh = tiny_config(tiny_target, ["chat"], tmp_path, steps=0, name="s2", replies_per_prompt=3, **kw)
    assert np.array_equal(build_data(fresh, target, lambda m: None, None)[0], train_w)  # seeded: same samples
    with pytest.raises(SpecServeError, match="--corpus chat"):
        build_data(tiny_config(tiny_target, ["code"], tmp_path, steps=0, name="c", replies_per_prompt=2),
                   target, lambda m: None, None)


def test_long_spec_bench_prompts_keep_their_question(tiny_target):
    """A RAG question follows its document: prompts cut in the middle keep both ends."""
    from specserve.distill.replies import chat_prompt
    tok = load_model(str(tiny_target), "float32").tokenizer
    text = "Context: " + "filler words " * 40 + "When does the new season come out?"
    head_only = tok.decode(chat_prompt(tok, text, 40))
    both = tok.decode(chat_prompt(tok, text, 40, keep_end=True))
    assert "Context:" in head_only and "season come out?" not in head_only
    assert "Context:" in both and "season come out?" in both and len(both) < len(text)
    assert chat_prompt(tok, "short", 40, keep_end=True) == chat_prompt(tok, "short", 40)
