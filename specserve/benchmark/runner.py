"""One benchmark run against one server: warm up, send requests on schedule, collect, summarise."""
from __future__ import annotations

import asyncio
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone

import httpx

from specserve.benchmark import server_metrics
from specserve.benchmark.client import (RequestResult, StreamingClient, list_models, make_http_client,
                                        monotonic_clock)
from specserve.benchmark.conversations import build_conversations, execute_conversations, per_turn
from specserve.benchmark.summary import build_record, request_row
from specserve.benchmark.workload import Workload, WorkloadSpec, make_workload
from specserve.errors import SpecServeError

# Warm-up requests generate at most this many tokens: they exist to trigger compilation, allocation and
# caches on the server, not to measure anything.
WARMUP_MAX_TOKENS = 16
# Text sent once to learn the server's characters per token when we have no tokenizer: long enough that
# the BOS/template tokens the server adds shift the ratio by well under 1 %.
CALIBRATION_CHARS = 4000


@dataclass
class Target:
    """One server configuration to measure."""
    base_url: str
    model: str | None = None
    label: str = "default"
    k: int | None = None
    server_config: dict = field(default_factory=dict)
    endpoint: str = "completions"
    api_key: str | None = None


@dataclass
class RunOptions:
    warmup_requests: int = 2
    discard_first_s: float = 0.0   # requests arriving earlier are sent but excluded (queue fill-up)
    slo: dict | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: dict | None = None
    request_timeout_s: float = 600.0
    progress: bool = True
    tokenizer: object | None = None
    max_model_len: int | None = None


@dataclass
class ServerInfo:
    model: str
    max_model_len: int | None
    chars_per_token: float | None
    counting: str


async def probe_server(http: httpx.AsyncClient, target: Target, opts: RunOptions,
                       dataset: str = "spec-bench") -> ServerInfo:
    """Model name and maximum length from /v1/models; characters per token from one request if needed.

    The calibration text comes from the run's own data set: code and prose differ by ~30 % in
    characters per token.
    """
    models = await list_models(http, target.base_url, target.api_key)
    model = target.model
    if model is None:
        if not models:
            raise SpecServeError(f"{target.base_url}: /v1/models lists no model; pass --model")
        model = models[0]["id"]
    entry = next((m for m in models if m.get("id") == model), models[0] if len(models) == 1 else {})
    # vLLM and specserve say max_model_len; llama-server gives each slot's context as meta.n_ctx
    max_len = (opts.max_model_len or entry.get("max_model_len") or (entry.get("meta") or {}).get("n_ctx")
               or None)
    if opts.tokenizer is not None:
        return ServerInfo(model, max_len, None, "tokenizer")
    from specserve.benchmark.prompts import RANDOM, load_dataset

    # At most about half the server's context (at a generous 2 characters per token), so it is accepted.
    limit = min(CALIBRATION_CHARS, max_len or CALIBRATION_CHARS)
    text = ""
    for t in load_dataset(dataset if dataset != RANDOM else "spec-bench"):
        if len(text) >= limit:
            break
        text += t + "\n\n"
    text = text[:limit]
    client = StreamingClient(http, target.base_url, model, target.endpoint, target.api_key,
                             ignore_eos=False, temperature=opts.temperature, extra_body=opts.extra_body,
                             timeout_s=opts.request_timeout_s)
    r = await client.send(RequestResult(id=-1, arrival_s=0.0, max_tokens=1), text, monotonic_clock())
    if r.prompt_tokens:
        return ServerInfo(model, max_len, len(text) / r.prompt_tokens, "server-calibrated estimate")
    return ServerInfo(model, max_len, None, "estimate")


class _Progress:
    """A rich progress bar of completed requests, or nothing."""

    def __init__(self, enabled: bool, total: int, label: str) -> None:
        self.bar = None
        if enabled:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn)

            from specserve.console import console
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn(),
                                transient=False, console=console())
            self.task = self.bar.add_task(label, total=total, failed=0)
        self.failed = 0

    def __enter__(self):
        if self.bar:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar:
            self.bar.stop()

    def advance(self, ok: bool) -> None:
        self.failed += not ok
        if self.bar:
            self.bar.update(self.task, advance=1, failed=self.failed)


async def execute(client: StreamingClient, workload: Workload, opts: RunOptions,
                  max_concurrency: int | None, label: str) -> list[RequestResult]:
    """Send every request at its arrival time (and, with a concurrency cap, when a slot frees up)."""
    clock = monotonic_clock()
    results = [RequestResult(id=i, arrival_s=float(t), measured=float(t) >= opts.discard_first_s,
                             target_prompt_tokens=p.target_tokens, est_prompt_tokens=p.tokens,
                             max_tokens=p.max_tokens)
               for i, (t, p) in enumerate(zip(workload.arrival_s, workload.prompts))]
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(r: RequestResult, progress: _Progress) -> None:
        async with slots if slots else nullcontext():
            await client.send(r, workload.prompts[r.id].text, clock)
        progress.advance(r.ok)

    with _Progress(opts.progress, len(results), label) as progress:
        tasks = []
        for r in results:
            delay = r.arrival_s - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(r, progress)))
        await asyncio.gather(*tasks)
    return results


async def run_once(target: Target, spec: WorkloadSpec, opts: RunOptions,
                   http: httpx.AsyncClient | None = None, sweep_info: dict | None = None
                   ) -> tuple[dict, list[dict]]:
    """Measure one configuration under one workload; returns the run record and per-request rows."""
    own = http is None
    if own:
        http = make_http_client(target.base_url, opts.request_timeout_s)
    try:
        info = await probe_server(http, target, opts, spec.dataset)
        workload = make_workload(spec, tokenizer=opts.tokenizer, chars_per_token=info.chars_per_token,
                                 max_model_len=info.max_model_len, counting=info.counting)
        client = StreamingClient(http, target.base_url, info.model, target.endpoint, target.api_key,
                                 opts.ignore_eos, opts.temperature, opts.extra_body, opts.request_timeout_s)
        warm_clock = monotonic_clock()
        for i in range(min(opts.warmup_requests, len(workload.prompts))):
            p = workload.prompts[i]
            await client.send(RequestResult(id=-1, arrival_s=0.0, max_tokens=min(p.max_tokens,
                                                                                 WARMUP_MAX_TOKENS)),
                              p.text, warm_clock)
        before = await server_metrics.scrape(http, target.base_url)
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        if spec.turns:
            conversations = build_conversations(len(workload.arrival_s), spec.turns, spec.seed, spec.dataset)
            with _Progress(opts.progress, len(conversations) * spec.turns, target.label) as progress:
                results = await execute_conversations(client, conversations, workload.arrival_s,
                                                      workload.prompts[0].max_tokens, spec.think_time_s, progress)
        else:
            results = await execute(client, workload, opts, spec.max_concurrency, target.label)
        after = await server_metrics.scrape(http, target.base_url)
    finally:
        if own:
            await http.aclose()
    run_id = f"{target.label}-{started_at}-{uuid.uuid4().hex[:6]}"
    record = build_record(results, run_id=run_id, label=target.label, k=target.k,
                          server_config=target.server_config, base_url=target.base_url,
                          model=info.model, endpoint=target.endpoint, arrival=workload.arrival,
                          offered_rate=workload.offered_rate, slo=opts.slo,
                          server_delta=server_metrics.delta(before, after),
                          prompt_info=workload.prompt_info, started_at=started_at)
    record["warmup"] = {"requests": opts.warmup_requests, "discard_first_s": opts.discard_first_s,
                        "num_discarded": sum(not r.measured for r in results)}
    if spec.turns:
        record["turns"] = per_turn(results)
        record["think_time_s"] = spec.think_time_s
    if sweep_info:
        record["sweep"] = sweep_info
    return record, [request_row(r) for r in results]
