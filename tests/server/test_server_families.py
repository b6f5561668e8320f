"""`specserve serve --model` with each model family, from its Hugging Face folder (with prompt-lookup
speculation) and from its GGUF file, through the OpenAI API: greedy output equal to the offline engine's,
chat rendered with the family's own template (the folder's tokenizer_config.json, the file's metadata).
Mixtral and Gemma 3 also with the SentencePiece vocabulary their real files carry."""
import openai
import pytest

from specserve import LLM, SamplingParams
from tests.model.family_fixtures import FAMILIES, SPM_STYLE, make_family_dir, write_family_gguf
from tests.server.conftest import SMALL_KV, ServerProcess

MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.mark.parametrize("family,spm", [(f, False) for f in FAMILIES] + [(f, True) for f in SPM_STYLE])
def test_the_family_is_served_from_its_folder_and_its_gguf_file(family, spm, tmp_path):
    folder = make_family_dir(tmp_path / "hf", family, spm=spm)
    write_family_gguf(tmp_path / "model.gguf", folder, family, "Q8_0", spm)
    for source, extra in ((folder, ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']),
                          (tmp_path / "model.gguf", [])):
        reference = LLM(model=str(source), dtype="float32", num_threads=1)
        prompt = reference.tokenizer.encode_chat(MESSAGES)
        assert ("\u2581there" in map(reference.tokenizer.hf.id_to_token, prompt)) == spm  # SentencePiece pieces
        want = reference.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
        server = ServerProcess(["--model", str(source), "--dtype", "float32", "--kv-cache-memory", SMALL_KV,
                                "--max-model-len", "256", "--served-model-name", family, *extra],
                               tmp_path / f"{source.name}.log")
        try:
            with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as client:
                r = client.chat.completions.create(model=family, messages=MESSAGES, max_tokens=16, temperature=0,
                                                   extra_body={"ignore_eos": True})
                assert r.choices[0].message.content == want.text, source
                assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 16
                text = client.completions.create(model=family, prompt="abc abc abc", max_tokens=8, temperature=0,
                                                 extra_body={"ignore_eos": True}).choices[0].text
            assert text == reference.generate(["abc abc abc"], SamplingParams(max_tokens=8, temperature=0,
                                                                            ignore_eos=True))[0].text
        finally:
            server.stop()


def test_each_family_renders_its_own_chat_template(tmp_path):
    """The folder's template and the GGUF file's are the family's (markers of each style in the prompt)."""
    markers = {"qwen3": "<s>user\n", "mixtral": "[INST] Hello there [/INST]", "gemma3": "<start_of_turn>user\n"}
    for family, marker in markers.items():
        folder = make_family_dir(tmp_path / family, family)
        write_family_gguf(tmp_path / f"{family}.gguf", folder, family)
        for source in (folder, tmp_path / f"{family}.gguf"):
            from specserve.model.loader import load_model
            assert marker in load_model(str(source)).tokenizer.apply_chat_template(MESSAGES), (family, source)
