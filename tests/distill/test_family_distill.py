"""`specserve distill` takes a target of any family: a tiny EAGLE draft (and a standalone one for Qwen3)
trains for a few steps on the target's teaching, and the engine then serves the target with it, greedy
token-identical to no speculation."""
import json

import pytest

from specserve import LLM
from specserve.distill.pipeline import run
from tests.distill.conftest import tiny_config
from tests.model.family_fixtures import FAMILIES, make_family_dir
from tests.spec_decode.test_speculative_engine import GREEDY, prompts

CASES = [(family, "eagle") for family in FAMILIES] + [("qwen3", "draft")]


@pytest.mark.parametrize("family,method", CASES)
def test_a_draft_distilled_for_the_family_serves_losslessly(family, method, tiny_corpus, tmp_path):
    target = make_family_dir(tmp_path / "target", family)
    info = run(tiny_config(target, tiny_corpus, tmp_path, steps=6, method=method), log=lambda m: None)
    assert info["steps"] == 6 and info["method"] == method
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    # the draft is a plain Llama-layout decoder whatever the target (an EAGLE one of the target's width)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg.get("eagle", False) == (method == "eagle")
    ps = prompts(12, seed=5)
    want = [o.token_ids for o in LLM(model=str(target), dtype="float32").generate(ps, GREEDY)]
    spec = {"method": "eagle" if method == "eagle" else "draft_model", "model": str(tmp_path / "draft"),
            "num_speculative_tokens": 3}
    outs = LLM(model=str(target), dtype="float32", max_num_seqs=4, speculative_config=spec).generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == want
    assert sum(o.spec["num_draft_tokens"] for o in outs) > 0
