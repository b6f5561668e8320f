"""Save a trained draft as a Hugging Face-style directory that `--speculative-config` loads: config.json,
model.safetensors (bf16), the target's tokenizer files, vocab_map.json for a reduced head, distill.json."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from specserve.model.weights import hf_state_dict, save_hf_weights

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def export_draft(model, vocab_map: list[int] | None, target_dir: Path, out: Path, info: dict,
                 dtype: torch.dtype = torch.bfloat16) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_hf_weights({k: v.to("cpu", dtype) for k, v in hf_state_dict(model).items()}, out)
    cfg = model.config.to_hf()
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (Path(target_dir) / name).exists():
            shutil.copyfile(Path(target_dir) / name, out / name)
    if vocab_map is not None:
        (out / "vocab_map.json").write_text(json.dumps(vocab_map) + "\n")
    elif (out / "vocab_map.json").exists():
        (out / "vocab_map.json").unlink()
    (out / "distill.json").write_text(json.dumps(info, indent=2) + "\n")
    return out
