"""specserve: LLM serving with load-adaptive speculative decoding and an interpretable latency model."""
__version__ = "0.1.0"
