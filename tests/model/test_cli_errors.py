"""Every model-loading error reaches the user as one `error: ...` line and exit code 2, no traceback."""
import json

from specserve.cli import main
from tests.model.gguf_fixtures import write_gguf
from tests.tiny_models import make_tiny_model


def broken_models(tmp):
    from transformers import LlamaConfig, LlamaForCausalLM
    ref = LlamaForCausalLM(LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2))
    cfg = dict(hidden=64, ffn=96, layers=1, heads=4, kv_heads=2)
    write_gguf(tmp / "q5.gguf", ref.state_dict(), cfg, "Q5_0")
    write_gguf(tmp / "falcon.gguf", ref.state_dict(), cfg, "F32", arch="falcon")
    (tmp / "corrupt.gguf").write_bytes(b"GGUF\x03\x00")
    no_field = make_tiny_model(tmp / "nofield", seed=0)
    config = json.loads((no_field / "config.json").read_text())
    del config["hidden_size"]
    (no_field / "config.json").write_text(json.dumps(config))
    bad_weights = make_tiny_model(tmp / "badweights", seed=0)
    (bad_weights / "model.safetensors").write_bytes(b"not a safetensors file")
    bad_arch = make_tiny_model(tmp / "badarch", seed=0)
    (bad_arch / "config.json").write_text(
        (bad_arch / "config.json").read_text().replace("LlamaForCausalLM", "GPT2LMHeadModel"))
    return [
        (tmp / "missing", "model not found"),
        (tmp / "q5.gguf", "Q5_0, which is not supported"),
        (tmp / "falcon.gguf", "unsupported GGUF architecture 'falcon'"),
        (tmp / "corrupt.gguf", "corrupt or unreadable GGUF file"),
        (no_field, "missing required field 'hidden_size'"),
        (bad_weights, "corrupt safetensors file"),
        (bad_arch, "unsupported architecture 'GPT2LMHeadModel'"),
    ]


def test_each_model_error_is_one_clear_line(tmp_path, capsys):
    for path, message in broken_models(tmp_path):
        assert main(["generate", "--model", str(path), "--max-tokens", "1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], (path, err)
        assert str(path.name) in err[0] or "model not found" in err[0]


def test_unknown_alias_is_one_clear_line(capsys):
    assert main(["models", "fetch", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: unknown model alias 'no-such-model' (known: smollm2-135m)"]
