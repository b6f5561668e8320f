"""Tiny random Llama models saved as real Hugging Face directories (config, safetensors, tokenizer.json),
so engine and speculative-decoding tests run the full loading path in milliseconds."""
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from specserve.model.config import ModelConfig
from specserve.model.llama import LlamaModel
from specserve.model.weights import hf_state_dict, save_hf_weights

EOS = "</s>"


def byte_tokenizer() -> Tokenizer:
    """Byte-level BPE with 256 byte tokens, 2 merges, 2 specials: 260 tokens (ids 258 <s>, 259 </s>)."""
    from tests.byte_vocab import MERGES, TOKENS
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(TOKENS)},
                               merges=[tuple(m.split(" ")) for m in MERGES]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", EOS])
    return tok


def make_tiny_model(path: Path, seed: int, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    head_scale: float = 1.0, draft_vocab: list[int] | None = None, noise: float = 0.0,
                    noise_seed: int = 0) -> Path:
    """`noise` > 0: the same weights as `seed` plus Gaussian noise, i.e. a draft that often agrees."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig(vocab_size=260, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                      tie_word_embeddings=False, eos_token_id=[259], bos_token_id=258,
                      draft_vocab_size=len(draft_vocab) if draft_vocab else None)
    torch.manual_seed(seed)
    model = LlamaModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                torch.nn.init.normal_(p, std=0.5 if "embed" in name else 1 / hidden ** 0.5)
        model.lm_head.weight.mul_(head_scale)  # larger -> peakier next-token distributions
        if noise:
            g = torch.Generator().manual_seed(noise_seed)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    save_hf_weights(hf_state_dict(model), path)
    (path / "config.json").write_text(json.dumps(cfg.to_hf()))
    byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": EOS, "bos_token": "<s>",
        "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<s>assistant: {% endif %}"}))
    if draft_vocab:
        (path / "vocab_map.json").write_text(json.dumps(draft_vocab))
    return path


def make_tiny_eagle(path: Path, target: Path, noise: float, noise_seed: int = 0,
                    draft_vocab: list[int] | None = None) -> Path:
    """An EAGLE-format draft for a tiny target: the target's own layers, norm and head behind
    fc = [identity on the token embedding | `noise`-scaled random weights on the target feature], so it
    agrees with the target more often the smaller the noise, and the features really enter its input.
    `draft_vocab`: keep only these head rows (a reduced-vocabulary draft, with its vocab_map.json)."""
    from specserve.model.loader import load_model
    tgt = load_model(str(target), "float32").model
    cfg = ModelConfig.from_hf(json.loads((target / "config.json").read_text()))
    cfg.eagle = True
    cfg.draft_vocab_size = len(draft_vocab) if draft_vocab else None
    model = LlamaModel(cfg)
    state = tgt.state_dict()
    if draft_vocab:
        state["lm_head.weight"] = state["lm_head.weight"][torch.tensor(draft_vocab)]
    model.load_state_dict(state, strict=False)
    g = torch.Generator().manual_seed(noise_seed)
    with torch.no_grad():
        h = cfg.hidden_size
        model.fc.weight.zero_()
        model.fc.weight[:, :h] = torch.eye(h)
        model.fc.weight[:, h:] = torch.randn(h, h, generator=g) * noise / h ** 0.5
        for name, p in model.named_parameters():
            if name.startswith("layers."):
                p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    path.mkdir(parents=True, exist_ok=True)
    save_hf_weights(hf_state_dict(model), path)
    (path / "config.json").write_text(json.dumps(cfg.to_hf()))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((target / name).read_bytes())
    if draft_vocab:
        (path / "vocab_map.json").write_text(json.dumps(draft_vocab))
    return path
