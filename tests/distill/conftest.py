import pytest

from specserve.distill.pipeline import DistillConfig
from specserve.distill.train import TrainConfig


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A few real stdlib modules as a FILES corpus (~25k byte tokens for the tiny byte-level target)."""
    from specserve.distill.corpus import stdlib_root
    root = tmp_path_factory.mktemp("corpus")
    paths = []
    for rel in ("json/encoder.py", "json/decoder.py", "textwrap.py"):
        p = root / rel.replace("/", "_")
        p.write_text((stdlib_root() / rel).read_text())
        paths.append(str(p))
    return paths


def tiny_config(target, corpus, tmp_path, steps, name="draft", **kw) -> DistillConfig:
    """A seconds-long distill run on the tiny target. With corpus ["chat"] the data are 200 ShareGPT prompts
    in the tiny chat template plus the target's own 32-token greedy replies: the distribution the engine
    then drafts on (a random target's continuations look nothing like real text)."""
    train = dict(steps=steps, batch=8, lr=3e-3, echo=1, eval_every=10, seed=0)
    train.update(kw.pop("train", {}))
    args = dict(target=str(target), out=tmp_path / name, corpus=corpus, work=tmp_path / f"work-{name}",
                layers=1, hidden=64, embedding_rank=16, draft_vocab=96, window=96, shard_windows=8,
                eval_windows=8, chat_prompts=200, max_reply_tokens=32, train=TrainConfig(**train))
    args.update(kw)
    return DistillConfig(**args)
