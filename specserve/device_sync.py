"""Device -> host transfers of the engine, counted.

On a GPU every read of a device tensor from Python (`.tolist()`, `.item()`, `int(t)`) waits for all queued
work: each one is a pipeline stall. The engine reads device results through `to_host` only, once per step
(the sampler's tokens, logprobs and draft confidences together), plus once per drafting step for a policy
that decides on draft confidences as they come. `transfers` counts them; `bench/step_overhead.py` reports
transfers per step and tests/engine/test_host_sync.py checks nothing else reads device tensors.
"""
from __future__ import annotations

import torch

transfers = 0  # to_host calls since the process started


def to_host(*tensors: torch.Tensor | None) -> list[list | None]:
    """Copies the tensors to the host with one synchronisation and returns them as (nested) lists."""
    global transfers
    transfers += 1
    staged = [None if t is None else t.to("cpu", non_blocking=True) for t in tensors]
    if any(t is not None and t.device.type == "cuda" for t in tensors):
        torch.cuda.current_stream().synchronize()
    return [None if t is None else t.tolist() for t in staged]
