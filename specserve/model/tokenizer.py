"""Tokenizer: a `tokenizers.Tokenizer` plus the chat template and special tokens of a model directory."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from specserve.errors import InvalidRequestError, ModelLoadError
from specserve.model.chat_template import render_chat


def _token_str(value) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as AddedToken dicts."""
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, chat_template: str | None, special_tokens: dict[str, str],
                 eos_token_ids: list[int], tool_chat_template: str | None = None):
        self.hf = tokenizer
        self.chat_template = chat_template
        self.tool_chat_template = tool_chat_template or chat_template  # for requests with tools
        self.special_tokens = special_tokens  # bos_token, eos_token, ... as the template sees them
        self.eos_token_ids = eos_token_ids
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, model_dir: Path, eos_token_ids: list[int] | None = None) -> "Tokenizer":
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ModelLoadError(f"no tokenizer.json in {model_dir}")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad JSON
            raise ModelLoadError(f"corrupt tokenizer file {path}: {e}") from None
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = tool_template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: the default one, and Hermes' "tool_use" for tools
            named = {t.get("name"): t.get("template") for t in template}
            template, tool_template = named.get("default"), named.get("tool_use")
        jinja_file = model_dir / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text()
        special = {k: _token_str(cfg[k]) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                   if cfg.get(k) is not None}
        eos = list(eos_token_ids or [])
        if not eos and special.get("eos_token") is not None:
            eos_id = tok.token_to_id(special["eos_token"])
            eos = [eos_id] if eos_id is not None else []
        return cls(tok, template, special, eos, tool_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch gives the same ids and releases the GIL while it works (encode holds it throughout:
        # 4 s for a 2.6 MB text), so a caller on a worker thread leaves the others running.
        return self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def template_for(self, tools: bool) -> str | None:
        """The chat template a conversation with (or without) tools is rendered with."""
        return self.tool_chat_template if tools else self.chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str:
        """`tools` (transformers' form) and `kwargs` reach the template as variables of those names."""
        template = self.template_for(bool(tools))
        if not template:
            raise InvalidRequestError("this model has no chat template; use the completions API")
        return render_chat(template, messages, add_generation_prompt, self.special_tokens,
                           **kwargs, **({"tools": tools} if tools else {}))

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # The template already writes BOS/special tokens as text; don't add them twice.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt),
                           add_special_tokens=False)
