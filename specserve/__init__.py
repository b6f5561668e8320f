"""specserve: LLM serving with load-adaptive speculative decoding and an interpretable latency model."""
import os

# OpenMP threads that spin while they wait collapse as soon as another process wants one of their cores:
# the spinning thread burns its time slice and every parallel region then waits for a descheduled peer.
# Threads that sleep at once (OMP_WAIT_POLICY=PASSIVE) pay a wake-up at each of the ~250 parallel regions
# of a decode step instead (+20 % per token on an idle machine). A very short spin, then sleep, keeps the
# best of both: a step's next region starts within those few microseconds, and a contended core is given
# up almost at once (bench/contention.py --wait-policies measures the choices). It must be set before torch
# loads its OpenMP runtime, so here, on the first import of specserve; an explicit OMP_WAIT_POLICY or
# GOMP_SPINCOUNT wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "300")
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
