"""specserve: LLM serving with load-adaptive speculative decoding and an interpretable latency model."""
import os

# How OpenMP threads wait between the ~250 parallel regions of a decode step. Sleeping at once
# (OMP_WAIT_POLICY=PASSIVE) pays a wake-up per region: +20 % per token on an AMD EPYC guest, 4x on an Intel
# Xeon guest whose wake-ups take ~50 us. Spinning long collapses as soon as another process wants one of
# the cores: the spinning thread burns its time slice while every region waits for a descheduled peer.
# So: spin a few thousand pause instructions (tens of microseconds, enough to bridge the step's serial gaps),
# then sleep; and while another process keeps a core busy the engine runs the step on fewer threads
# (engine/threads.py), where no peer is waited for. bench/contention.py --wait-policies measures the choices.
# It must be set before torch loads its OpenMP runtime, so here, on the first import of specserve; an
# explicit OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "3000")
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
