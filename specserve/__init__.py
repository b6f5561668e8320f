"""specserve: LLM serving with load-adaptive speculative decoding and an interpretable latency model."""
import os

# OpenMP threads that spin while they wait collapse as soon as another process wants one of their cores:
# the spinning thread burns its time slice and every parallel region then waits for a descheduled
# peer. Sleeping waiters are woken promptly instead (bench/contention.py measures both). It must be set
# before torch loads its OpenMP runtime, so here, on the first import of specserve; an explicit
# OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
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
