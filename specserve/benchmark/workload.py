"""A run's workload: when each request arrives and what it asks, from the user's options. Seeded.

Arrival process, in order of precedence: `request_rate` gives Poisson/Gamma arrivals; else
`max_concurrency` without a trace gives a closed loop (everything queued at 0, N at a time); else the
trace's own timestamps are replayed (the shipped Azure conversation trace by default).
Lengths: explicit `input_len`/`output_len` win; else a trace's lengths when a trace is in use; else the
data set's prompts as they are, with `DEFAULT_OUTPUT_LEN` tokens out. A trace replayed on its own clock
keeps each row's lengths; synthetic arrivals (a rate) draw rows at random from the whole trace, so that a
run's length mix is the trace's at every rate (taking rows in order would give a short run only the
trace's first rows, whose lengths differ from the rest).
"""
from __future__ import annotations

import platform
from dataclasses import dataclass, field

import numpy as np

from specserve.benchmark import arrival_schedules as arr
from specserve.benchmark.prompts import (DEFAULT_CHARS_PER_TOKEN, RANDOM, STDLIB, Prompt, PromptBuilder,
                                         build_prompts, load_dataset)
from specserve.errors import SpecServeError

DEFAULT_TRACE = "azure-conv"
DEFAULT_OUTPUT_LEN = 128
DEFAULT_NUM_REQUESTS = 100     # synthetic and closed-loop runs with neither a count nor a duration
DEFAULT_TRACE_WINDOW_S = 60.0  # trace replays with neither: one minute of trace, not the whole hour


@dataclass
class WorkloadSpec:
    trace: str | None = None
    trace_format: str = "auto"
    time_scale: float = 1.0
    start_s: float = 0.0
    duration_s: float | None = None
    max_requests: int | None = None
    request_rate: float | None = None
    burstiness: float = 1.0           # coefficient of variation of inter-arrival gaps (1 = Poisson)
    max_concurrency: int | None = None
    dataset: str = "spec-bench"
    input_len: int | None = None
    output_len: int | None = None
    seed: int = 0
    turns: int | None = None          # multi-turn conversations (benchmark/conversations.py): turns each;
    think_time_s: float = 0.0         # the arrivals are then conversation starts


@dataclass
class Workload:
    arrival_s: np.ndarray
    prompts: list[Prompt]
    arrival: dict                 # the run record's `arrival` description
    offered_rate: float | None
    prompt_info: dict = field(default_factory=dict)


def _process(spec: WorkloadSpec) -> str:
    if spec.request_rate is not None:
        if np.isinf(spec.request_rate):
            return "burst"
        return "poisson" if spec.burstiness == 1.0 else "gamma"
    if spec.max_concurrency is not None and spec.trace is None:
        return "closed"
    return "trace"


def _trace_rows(trace: arr.Trace, n: int, process: str, rng: np.random.Generator) -> np.ndarray:
    """Which trace row each of the n requests takes its lengths from."""
    if process == "trace":
        return np.arange(n) % len(trace)
    return rng.integers(0, len(trace), size=n)


def make_workload(spec: WorkloadSpec, *, tokenizer=None, chars_per_token: float | None = None,
                  max_model_len: int | None = None, counting: str | None = None) -> Workload:
    rng_arrivals = np.random.default_rng([spec.seed, 1])   # separate streams: changing the rate
    rng_prompts = np.random.default_rng([spec.seed, 2])    # must not change which prompts are sent
    rng_rows = np.random.default_rng([spec.seed, 3])       # nor which trace rows give the lengths
    process = _process(spec)
    trace = None
    trace_name = spec.trace or (DEFAULT_TRACE if process == "trace" else None)
    if trace_name:
        duration = spec.duration_s
        if process == "trace" and duration is None and spec.max_requests is None:
            duration = DEFAULT_TRACE_WINDOW_S
        trace = arr.window(arr.load_trace(trace_name, spec.trace_format), spec.start_s,
                           duration if process == "trace" else None,
                           spec.time_scale if process == "trace" else 1.0,
                           spec.max_requests if process == "trace" else None)

    if process == "trace":
        times = trace.times_s
        offered = (len(times) - 1) / float(times[-1] - times[0]) if len(times) > 1 and times[-1] > 0 \
            else None
    elif process in ("closed", "burst"):
        times = np.zeros(spec.max_requests or DEFAULT_NUM_REQUESTS)
        offered = None
    else:
        n = spec.max_requests if spec.max_requests is not None or spec.duration_s is not None \
            else DEFAULT_NUM_REQUESTS
        times = arr.synthetic_arrivals(spec.request_rate, rng_arrivals, n=n, duration_s=spec.duration_s,
                                       cv=spec.burstiness)
        offered = spec.request_rate
    n = len(times)
    if n == 0:
        raise SpecServeError("the workload has no requests (raise --duration or --max-requests)")

    rows = _trace_rows(trace, n, process, rng_rows) if trace is not None else None
    in_lens = trace.input_tokens[rows] if trace is not None and trace.input_tokens is not None else None
    out_lens = trace.output_tokens[rows] if trace is not None and trace.output_tokens is not None else None
    if spec.input_len is not None:
        in_lens = np.full(n, spec.input_len)
    if spec.output_len is not None or out_lens is None:
        out_lens = np.full(n, spec.output_len or DEFAULT_OUTPUT_LEN)
    hash_ids = None
    if trace is not None and trace.hash_ids is not None and spec.input_len is None:
        hash_ids = [trace.hash_ids[i] for i in rows]

    cpt = chars_per_token or DEFAULT_CHARS_PER_TOKEN
    texts = load_dataset(spec.dataset if spec.dataset != RANDOM else "spec-bench")
    builder = PromptBuilder(texts, rng_prompts, tokenizer, cpt)
    prompts = build_prompts(builder, n, dataset=spec.dataset, input_lens=in_lens, output_lens=out_lens,
                            max_model_len=max_model_len, hash_ids=hash_ids)

    arrival = {"process": process, "request_rate": spec.request_rate,
               "burstiness": spec.burstiness if process in ("poisson", "gamma") else None,
               "time_scale": spec.time_scale if process == "trace" else None,
               "max_concurrency": spec.max_concurrency, "seed": spec.seed,
               "trace": None if trace is None else {
                   "source": trace_name, "format": trace.format, "start_s": spec.start_s,
                   "duration_s": trace.meta.get("duration_s"), "lengths_used": in_lens is not None
                   and spec.input_len is None, "rows": "in order" if process == "trace" else "random"}}
    targets = [p.target_tokens for p in prompts if p.target_tokens is not None]
    prompt_info = {
        "dataset": spec.dataset,
        "counting": counting or ("tokenizer" if tokenizer is not None else "estimate"),
        "chars_per_token": None if tokenizer is not None else cpt,
        "exact_length": tokenizer is not None,
        "num_clipped": sum(p.clipped for p in prompts), "max_model_len": max_model_len,
        "mean_target_tokens": float(np.mean(targets)) if targets else None,
        "mean_est_tokens": float(np.mean([p.tokens for p in prompts])),
        "num_length_misses": sum(p.target_tokens is not None and p.tokens != p.target_tokens
                                 for p in prompts),
    }
    if spec.dataset == STDLIB:   # the corpus is this Python's own library: note which one
        prompt_info["python_version"] = platform.python_version()
    return Workload(times, prompts, arrival, offered, prompt_info)
