"""The served model's sampling defaults: what a request that omits temperature, top_p, ... samples with.

As vLLM's `--generation-config`: `auto` (the default) takes the model's own recommendation, a Hugging
Face directory's generation_config.json, a GGUF file's general.sampling.* metadata where it has some, or,
for an alias, the model card's values recorded with it in
model/registry.py (its GGUF file has none); `vllm` takes none, so requests get
the server's own defaults (OpenAI's: temperature 1, top_p 1, no top_k); a folder path reads that folder's
generation_config.json. Fields a request sets always win (protocol.py applies them). The library engine
never sees these: `LLM` and `SamplingParams` keep their documented defaults.
"""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

from specserve.errors import InvalidRequestError, SpecServeError
from specserve.server.protocol import SamplingDefaults

FILENAME = "generation_config.json"
# generation_config.json's name -> SamplingDefaults' field
APPLIED = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_new_tokens": "max_tokens",
           "repetition_penalty": "repetition_penalty"}
# Fields vLLM would apply that this server does not implement, with their neutral values: logged when set.
NOT_APPLIED = {"min_p": 0.0}


def resolve(choice: str, model: str) -> tuple[SamplingDefaults, str]:
    """The defaults for `--generation-config choice` with `--model model`, and a log line saying which and
    whence. Raises SpecServeError for a folder without the file, or a file with unusable values."""
    if choice == "vllm":
        return SamplingDefaults(), _describe(SamplingDefaults(), "--generation-config vllm")
    if choice != "auto":
        folder = Path(choice).expanduser()
        if not (folder / FILENAME).is_file():
            raise SpecServeError(f"--generation-config must be auto, vllm or a folder holding {FILENAME}; "
                                 f"{folder} has none")
        return _from_file(folder / FILENAME)
    from specserve.model.registry import ALIASES, cached_models

    alias = model if model in ALIASES else None
    path = Path(model).expanduser()
    if alias is None and path.suffix == ".gguf" and path.is_file():
        from specserve.model.gguf_convert import GGUFFile, gguf_generation_config
        return _from_dict(gguf_generation_config(GGUFFile(path)), f"{path} (general.sampling metadata)")
    if alias is None and path.is_dir():
        if (path / FILENAME).is_file():
            return _from_file(path / FILENAME)
        # the cached conversion of an alias (specserve models fetch) is still that alias
        alias = next((a for a, p in cached_models() if a in ALIASES and p.resolve() == path.resolve()), None)
    if alias is not None and ALIASES[alias].generation_config:
        return _from_dict(ALIASES[alias].generation_config,
                          f"the model card of {alias} (recorded in specserve/model/registry.py)")
    return SamplingDefaults(), _describe(SamplingDefaults(), f"no {FILENAME} with {model}")


def _from_file(file: Path) -> tuple[SamplingDefaults, str]:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise SpecServeError(f"cannot read {file}: {e}") from None
    if not isinstance(data, dict):
        raise SpecServeError(f"{file} is not a JSON object")
    return _from_dict(data, str(file))


def _from_dict(data: dict, source: str) -> tuple[SamplingDefaults, str]:
    values = {field: data[key] for key, field in APPLIED.items() if data.get(key) is not None}
    try:
        defaults = SamplingDefaults(**values)
        defaults.check()
    except (InvalidRequestError, TypeError) as e:
        raise SpecServeError(f"unusable sampling defaults in {source}: {e}") from None
    ignored = [f"{k}={data[k]}" for k, neutral in NOT_APPLIED.items() if data.get(k) not in (None, neutral)]
    line = _describe(defaults, source)
    if ignored:
        line += f"; not applied (this server does not implement them): {', '.join(ignored)}"
    return defaults, line


def _describe(defaults: SamplingDefaults, source: str) -> str:
    names = {v: k for k, v in APPLIED.items()}
    set_ = [f"{names[f.name]}={getattr(defaults, f.name)}" for f in fields(defaults)
            if getattr(defaults, f.name) is not None]
    what = " ".join(set_) if set_ else "the server's own (temperature=1 top_p=1)"
    return f"sampling defaults of requests that omit them: {what}, from {source}"
