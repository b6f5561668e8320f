"""End to end on the tiny random target: a short distill run raises acceptance over its initialisation,
resume continues exactly, the CLI writes a loadable draft, and target/draft tokenizers must match."""
import json

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.distill.evaluate import position_acceptance, teacher_forced_agreement, tokens_per_step
from specserve.distill.pipeline import run
from specserve.errors import SpecServeError
from specserve.model.loader import load_model
from specserve.spec_decode.draft_loader import load_vocab_map, share_target_embedding
from tests.distill.conftest import tiny_config

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def heldout_prompts(target, n=24):
    """Held-out ShareGPT prompts (never trained on) in the tiny target's chat template."""
    from specserve.distill.corpus import sharegpt_prompts
    from specserve.model.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(target)
    return [tok.encode_chat([{"role": "user", "content": tok.decode(tok.encode(p, add_special_tokens=False)[:60])}])
            for p in sharegpt_prompts("eval")[:n]]


def acceptance(target, draft, prompts):
    llm = LLM(model=str(target), dtype="float32", speculative_config={"model": str(draft),
                                                                       "num_speculative_tokens": 4})
    return tokens_per_step(llm.generate(prompts, GREEDY))


@pytest.fixture(scope="module")
def distilled(tiny_target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distill")
    # Same work directory: the trained run reuses the generated replies and teacher shards of the first.
    init = run(tiny_config(tiny_target, ["chat"], tmp, steps=0, name="init", work=tmp / "work"), log=lambda m: None)
    trained = run(tiny_config(tiny_target, ["chat"], tmp, steps=80, name="trained", work=tmp / "work"),
                  log=lambda m: None)
    return tmp / "init", tmp / "trained", init, trained


def test_distillation_raises_acceptance_over_initialisation(tiny_target, distilled):
    init_dir, trained_dir, init, trained = distilled
    prompts = heldout_prompts(tiny_target)
    before, after = acceptance(tiny_target, init_dir, prompts), acceptance(tiny_target, trained_dir, prompts)
    assert after > before + 0.3, (before, after)
    assert trained["heldout_top1_agreement"] > init["heldout_top1_agreement"] + 0.15
    log = [json.loads(line) for line in (trained_dir.parent / "work" / "train_log.jsonl").open()]
    assert log[0]["step"] == 0 and log[-1]["final"] and log[-1]["step"] == 80
    info = json.loads((trained_dir / "distill.json").read_text())
    assert info["draft_vocab_size"] == 96 and 0 < info["vocab_coverage"]["train"] <= 1


def test_position_acceptance_splits_the_acceptance_length_over_draft_positions(tiny_target, distilled):
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config={"model": str(distilled[1]),
                                                                           "num_speculative_tokens": 4})
    outs = llm.generate(heldout_prompts(tiny_target, 8), GREEDY)
    probs = position_acceptance(outs, 4)
    assert probs[0] > 0 and all(a >= b for a, b in zip(probs, probs[1:])), probs
    assert sum(probs) == pytest.approx(tokens_per_step(outs) - 1)


def test_exported_directory_is_a_reduced_vocabulary_hf_draft(distilled):
    _, trained_dir, _, _ = distilled
    cfg = json.loads((trained_dir / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 96 and cfg["embedding_rank"] == 16 and not cfg["tie_word_embeddings"]
    vocab_map = json.loads((trained_dir / "vocab_map.json").read_text())
    assert len(vocab_map) == 96 and vocab_map == sorted(set(vocab_map)) and 259 in vocab_map  # EOS kept
    from safetensors.torch import load_file
    w = load_file(str(trained_dir / "model.safetensors"))
    assert w["lm_head.weight"].shape == (96, 64) and w["model.embed_tokens.weight"].shape == (260, 16)
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (trained_dir / name).exists()


def test_reduced_vocabulary_draft_is_lossless_greedy(tiny_target, distilled):
    _, trained_dir, _, _ = distilled
    prompts = heldout_prompts(tiny_target) + [[7, 8, 9], [200, 201, 202, 203]]
    want = [o.token_ids for o in LLM(model=str(tiny_target), dtype="float32").generate(prompts, GREEDY)]
    for k, seqs in ((3, 1), (6, 16)):
        llm = LLM(model=str(tiny_target), dtype="float32", max_num_seqs=seqs,
                  speculative_config={"model": str(trained_dir), "num_speculative_tokens": k})
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want, f"k={k}"


class Interrupted(Exception):
    pass


def stop_at(step):
    def callback(**progress):
        if progress["step"] == step:
            raise Interrupted
    return callback


def test_resume_continues_where_the_run_stopped(tiny_target, tiny_corpus, tmp_path):
    """A run killed after step 7 (checkpoint every step here) and resumed ends with the same weights as an
    uninterrupted run: same step, optimizer state, RNG, learning-rate schedule and shard order."""
    every_step = {"checkpoint_seconds": 0}
    straight = run(tiny_config(tiny_target, tiny_corpus, tmp_path, steps=16, name="straight", train=every_step),
                   log=lambda m: None)
    with pytest.raises(Interrupted):
        run(tiny_config(tiny_target, tiny_corpus, tmp_path, steps=16, name="split", train=every_step),
            log=lambda m: None, progress_cb=stop_at(8))
    assert torch.load(tmp_path / "work-split" / "checkpoint.pt", weights_only=False)["step"] == 7
    resumed = run(tiny_config(tiny_target, tiny_corpus, tmp_path, steps=16, name="split", resume=True,
                              train=every_step), log=lambda m: None)
    assert resumed["steps"] == 16
    a = torch.load(tmp_path / "work-straight" / "checkpoint.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "work-split" / "checkpoint.pt", weights_only=False)["model"]
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-5), name
    assert abs(straight["final_loss"] - resumed["final_loss"]) < 1e-3


def test_resume_refuses_a_target_with_another_tokenizer(tiny_target, tiny_corpus, tmp_path):
    import shutil
    run(tiny_config(tiny_target, tiny_corpus, tmp_path, steps=2, name="d"), log=lambda m: None)
    other = tmp_path / "other-target"
    shutil.copytree(tiny_target, other)
    tok = (other / "tokenizer.json").read_text().replace('"</s>"', '"<eos>"')
    (other / "tokenizer.json").write_text(tok)
    with pytest.raises(SpecServeError, match="different tokenizer"):
        run(tiny_config(other, tiny_corpus, tmp_path, steps=4, name="d", resume=True), log=lambda m: None)


def test_engine_refuses_a_distilled_draft_with_another_tokenizer(tiny_target, distilled, tmp_path):
    import shutil
    _, trained_dir, _, _ = distilled
    other = tmp_path / "draft"
    shutil.copytree(trained_dir, other)
    tok = (other / "tokenizer.json").read_text().replace('"</s>"', '"<eos>"')
    (other / "tokenizer.json").write_text(tok)
    with pytest.raises(SpecServeError, match="different tokenizer"):
        LLM(model=str(tiny_target), speculative_config={"model": str(other), "num_speculative_tokens": 2})


def test_cli_minutes_budget_writes_a_loadable_draft(tiny_target, tiny_corpus, tmp_path):
    from specserve.cli import main
    out = tmp_path / "cli-draft"
    rc = main(["distill", "--target", str(tiny_target), "--out", str(out), "--corpus", *tiny_corpus,
               "--layers", "1", "--hidden", "64", "--embedding-rank", "16", "--draft-vocab", "96",
               "--window", "64", "--batch", "4", "--minutes", "0.05", "--work", str(tmp_path / "w")])
    assert rc == 0
    info = json.loads((out / "distill.json").read_text())
    assert info["steps"] > 0 and info["train_seconds"] >= 3 and info["command"].startswith("specserve distill")
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config={"model": str(out),
                                                                           "num_speculative_tokens": 3})
    assert llm.generate([[7, 8, 9]], GREEDY)[0].spec["num_drafts"] > 0


def test_prepare_only_fills_the_teacher_cache_and_the_training_run_reads_it(tiny_target, tiny_corpus, tmp_path):
    prepared = run(tiny_config(tiny_target, tiny_corpus, tmp_path, steps=4, prepare_only=True), log=lambda m: None)
    shards = sorted((tmp_path / "work-draft" / "teacher").glob("shard-*.safetensors"))
    assert prepared["shards"] > 1 and len(shards) == prepared["shards"] and prepared["teacher_tokens_cached"] > 0
    assert not (tmp_path / "draft").exists()
    trained = run(tiny_config(tiny_target, tiny_corpus, tmp_path, steps=4), log=lambda m: None)
    assert trained["steps"] == 4 and trained["teacher_tokens_cached"] == 0


@pytest.mark.parametrize("flag, value, message", [
    ("--ttt-steps", "0", "expected a positive integer"), ("--ttt-steps", "-1", "expected a positive integer"),
    ("--ttt-steps", "two", "expected a positive integer"), ("--kl-weight", "-0.5", "expected a non-negative number"),
    ("--kl-weight", "nan", "expected a non-negative number"), ("--kl-weight", "heavy", "expected a non-negative number"),
])
def test_cli_rejects_a_bad_eagle_option_in_one_line(flag, value, message, capsys):
    from specserve.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["distill", "--out", "x", "--corpus", "code", "--method", "eagle", "--steps", "1", flag, value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"{flag}: {message}" in err and "Traceback" not in err


def test_reduced_vocabulary_draft_is_lossless_when_sampling(tiny_target, distilled):
    """T = 0.8, top-p 0.9 with the distilled 96-of-260-token draft (q = 0 outside its vocabulary, so every
    token outside it can only come from the recovered-token path): the first two generated tokens follow
    the exact target marginals."""
    from tests.spec_decode.test_speculative_engine import exact_marginals
    _, trained_dir, _, _ = distilled
    llm = LLM(model=str(tiny_target), dtype="float32", max_num_seqs=64,
              speculative_config={"model": str(trained_dir), "num_speculative_tokens": 3})
    prompt = heldout_prompts(tiny_target, 1)[0][-12:]
    base = dict(max_tokens=4, temperature=0.8, top_p=0.9, ignore_eos=True)
    p1, p2 = exact_marginals(llm, prompt, SamplingParams(**base))
    vocab = torch.tensor(json.loads((trained_dir / "vocab_map.json").read_text()))
    outside = torch.ones(p1.numel(), dtype=torch.bool)
    outside[vocab] = False
    assert float(p2[outside].sum()) > 0.02  # the target really puts mass where the draft cannot go
    n = 3000
    outs = llm.generate([prompt] * n, [SamplingParams(**base, seed=s) for s in range(n)])
    assert sum(o.spec["num_accepted_tokens"] for o in outs) > 100
    for pos, exact in ((0, p1), (1, p2)):
        counts = torch.bincount(torch.tensor([o.token_ids[pos] for o in outs]), minlength=exact.numel()).float()
        tv = 0.5 * (counts / n - exact).abs().sum().item()
        # TV of an n-sample empirical distribution from the exact one is ~sqrt(support / n) / 2 at most.
        assert tv < 0.08, f"position {pos}: TV {tv:.3f}"
        if exact[outside].sum() > 0.02:
            assert abs(float(counts[outside].sum() / n - exact[outside].sum())) < 0.03


def test_eagle_distillation_raises_acceptance_and_exports_a_draft_without_the_embedding(tiny_target, tmp_path):
    """`--method eagle`: one target-width layer reading the target's hidden states, trained on cached
    target features; the exported draft omits the (shared) embedding and the engine runs it losslessly."""
    work = tmp_path / "work"  # shared: the trained run reuses the first run's replies and feature shards
    init = run(tiny_config(tiny_target, ["chat"], tmp_path, steps=0, name="init", work=work, method="eagle"),
               log=lambda m: None)
    trained = run(tiny_config(tiny_target, ["chat"], tmp_path, steps=80, name="trained", work=work, method="eagle",
                              ttt_steps=3, train={"lr": 1e-2}), log=lambda m: None)
    prompts = heldout_prompts(tiny_target)
    before, after = acceptance(tiny_target, tmp_path / "init", prompts), acceptance(tiny_target, tmp_path / "trained", prompts)
    assert after > before + 0.2, (before, after)
    assert trained["heldout_top1_agreement"] > init["heldout_top1_agreement"] + 0.15
    assert trained["heldout_top1_agreement_step2"] > init["heldout_top1_agreement_step2"] + 0.15
    assert trained["heldout_top1_agreement_step3"] > init["heldout_top1_agreement_step2"] + 0.1  # 3 steps unrolled
    cfg = json.loads((tmp_path / "trained" / "config.json").read_text())
    assert cfg["eagle"] and cfg["num_hidden_layers"] == 1 and cfg["hidden_size"] == 64
    from safetensors.torch import load_file
    w = load_file(str(tmp_path / "trained" / "model.safetensors"))
    assert "model.embed_tokens.weight" not in w and w["model.fc.weight"].shape == (64, 128)
    want = [o.token_ids for o in LLM(model=str(tiny_target), dtype="float32").generate(prompts, GREEDY)]
    llm = LLM(model=str(tiny_target), dtype="float32", max_num_seqs=8,
              speculative_config={"method": "eagle", "model": str(tmp_path / "trained"), "num_speculative_tokens": 4})
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == want
    # Teacher-forced on the same replies, the draft's step 1 agrees about as often as the engine accepts
    # its first drafted token (what the engine serves is what was trained), and far more than at init.
    target, seqs = load_model(str(tiny_target), "float32").model, [p + w for p, w in zip(prompts, want)]
    agreement = {}
    for name in ("init", "trained"):
        draft = load_model(str(tmp_path / name), "float32")
        share_target_embedding(draft.model, target)
        agreement[name] = teacher_forced_agreement(target, draft.model, load_vocab_map(draft, target.config.vocab_size),
                                                   seqs, [len(p) for p in prompts])
    assert agreement["trained"]["reply"] > agreement["init"]["reply"] + 0.15, agreement
    first = position_acceptance(outs, 4)[0]
    assert abs(agreement["trained"]["reply"] - first) < 0.1, (agreement, first)
