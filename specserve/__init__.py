"""specserve: LLM serving with load-adaptive speculative decoding and an interpretable latency model."""
__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):  # lazy: `import specserve` must not pull in torch for the CLI's --help
    if name == "LLM":
        from specserve.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from specserve.engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
