"""Sweeps: every server configuration at every request rate, appended to one results file.

Rates are given, or are fractions of a saturation rate measured first with a burst of requests. A
configuration may carry a `launch` command: the sweep then starts that server, waits until it answers
/v1/models, measures it and stops it, so configurations that need different server flags run unattended.

By default each configuration runs all its rates in one block. `interleave=True` starts every server first
(each on its own URL; an idle server costs almost no CPU) and runs rounds in which every configuration
appears once, at a rate drawn from its own shuffled list: a machine whose speed drifts during the sweep
then spreads the drift over every configuration and rate as noise, instead of offsetting whichever
configuration held the machine during a slow spell (docs/latency.md, attempt 18).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from specserve.benchmark import arrival_schedules as arr
from specserve.benchmark.client import api_root
from specserve.benchmark.results import append_run, side_path
from specserve.benchmark.runner import RunOptions, Target, run_once
from specserve.benchmark.workload import DEFAULT_TRACE, DEFAULT_TRACE_WINDOW_S, WorkloadSpec
from specserve.errors import SpecServeError

DEFAULT_SWEEP_DURATION_S = 60.0


@dataclass
class Config:
    target: Target
    launch: str | None = None
    ready_timeout_s: float = 600.0


@dataclass
class SweepPlan:
    configs: list[Config]
    rates: list[float] | None = None
    fractions: list[float] | None = None
    saturation_requests: int = 64
    per_config_saturation: bool = False
    scale_trace: bool = False   # replay the trace, time-scaled to each rate, instead of Poisson/Gamma
    log_dir: Path = field(default_factory=Path)
    interleave: bool = False    # rounds of every configuration instead of one block per configuration
    seed: int = 0               # the interleaved order's shuffle
    probe_requests: int = 0     # lone requests to the first configuration before and after every run

    def __post_init__(self) -> None:
        if self.probe_requests < 0:
            raise SpecServeError("--probe must be >= 0")
        if self.probe_requests and not self.interleave:
            raise SpecServeError("--probe needs --interleave: the probes go to the first configuration, "
                                 "whose server stays up only in an interleaved sweep")


def parse_config_arg(text: str, defaults: Target) -> Config:
    """`label=URL[,k=4][,model=M][,endpoint=chat]` -> a configuration."""
    label, sep, rest = text.partition("=")
    if not sep or not rest or not label.strip():
        raise SpecServeError(f"--config {text!r}: expected label=URL[,k=N][,model=M]")
    url, *pairs = rest.split(",")
    target = replace(defaults, label=label.strip(), base_url=url.strip(), server_config={})
    for pair in pairs:
        key, _, value = pair.partition("=")
        key = key.strip()
        if key == "k":
            target.k = int(value)
            target.server_config["k"] = target.k
        elif key in ("model", "endpoint"):
            setattr(target, key, value.strip())
        else:
            target.server_config[key] = value.strip()
    return Config(target)


def load_config_file(path: str, defaults: Target) -> list[Config]:
    """A JSON list of {label, base_url, model?, k?, endpoint?, server_config?, launch?, ready_timeout_s?}."""
    try:
        items = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SpecServeError(f"--configs {path}: {e}") from None
    if not isinstance(items, list) or not items:
        raise SpecServeError(f"--configs {path}: expected a non-empty JSON list of configurations")
    configs = []
    for n, item in enumerate(items):
        if not isinstance(item, dict) or not item.get("label") or not item.get("base_url"):
            raise SpecServeError(f"--configs {path}: entry {n} needs 'label' and 'base_url'")
        target = replace(defaults, label=str(item["label"]), base_url=item["base_url"],
                         model=item.get("model", defaults.model), k=item.get("k"),
                         endpoint=item.get("endpoint", defaults.endpoint),
                         server_config=dict(item.get("server_config") or {}))
        configs.append(Config(target, item.get("launch"), float(item.get("ready_timeout_s", 600.0))))
    return configs


class LaunchedServer:
    """A server process started for one configuration, stopped (its whole process group) on exit."""

    def __init__(self, config: Config, log_dir: Path) -> None:
        self.config = config
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{config.target.label}.server.log"
        self.proc: subprocess.Popen | None = None

    async def __aenter__(self):
        # Its own session, so that stopping it reaches the workers it forks as well.
        with open(self.log_path, "ab") as log:
            try:
                self.proc = subprocess.Popen(shlex.split(self.config.launch), stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)
            except (OSError, ValueError) as e:
                raise SpecServeError(f"cannot launch {self.config.launch!r}: {e}") from None
        url = api_root(self.config.target.base_url) + "/models"
        deadline = time.monotonic() + self.config.ready_timeout_s
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise SpecServeError(f"server for {self.config.target.label!r} exited with code "
                                         f"{self.proc.returncode}; see {self.log_path}")
                try:
                    if (await http.get(url)).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(1.0)
        self._stop()
        raise SpecServeError(f"server for {self.config.target.label!r} not ready after "
                             f"{self.config.ready_timeout_s:.0f}s; see {self.log_path}")

    async def __aexit__(self, *exc):
        self._stop()

    def _stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


async def measure_saturation(target: Target, spec: WorkloadSpec, opts: RunOptions, n: int) -> float:
    """Throughput (req/s) when `n` requests arrive at once: the rate the server cannot exceed."""
    burst = replace(spec, request_rate=float("inf"), max_requests=n, max_concurrency=None, duration_s=None)
    record, _ = await run_once(target, burst, replace(opts, discard_first_s=0.0))
    rate = record["request_throughput_rps"]
    if not rate:
        raise SpecServeError(f"saturation run for {target.label!r} completed no request: {record['errors']}")
    return rate


def _spec_at_rate(spec: WorkloadSpec, rate: float, scale_trace: bool) -> WorkloadSpec:
    if not scale_trace:
        duration = spec.duration_s if spec.duration_s is not None or spec.max_requests else \
            DEFAULT_SWEEP_DURATION_S
        return replace(spec, request_rate=rate, duration_s=duration)
    # Replay the rate x --duration requests that follow --start in the trace, their clock scaled so that
    # they arrive at `rate` on average. Scaling by the trace's mean rate instead replays a window whose own
    # rate can be a fraction or a multiple of it: the Azure conversation trace's first seconds are sparse
    # (a 0.37 req/s target replayed 3 requests in 75 s), and its rate drifts over tens of seconds.
    wall_s = spec.duration_s or DEFAULT_TRACE_WINDOW_S
    n = max(2, round(rate * wall_s))
    if spec.max_requests:
        n = min(n, spec.max_requests)
    trace = arr.load_trace(spec.trace or DEFAULT_TRACE, spec.trace_format)
    times = trace.times_s[trace.times_s >= spec.start_s][:n]  # the trace's own clock: start_s is one of them
    span = float(times[-1] - times[0]) if len(times) else 0.0
    if len(times) < 2 or span <= 0:
        raise SpecServeError(f"the trace has fewer than two distinct arrivals after --start {spec.start_s} s")
    return replace(spec, request_rate=None, max_concurrency=None, start_s=float(times[0]),
                   time_scale=(len(times) - 1) / rate / span, duration_s=None, max_requests=len(times))


def interleaved_order(n_configs: int, n_rates: int, seed: int) -> list[tuple[int, int]]:
    """(configuration, rate index) pairs: n_rates rounds, each configuration once per round in a shuffled
    order, each configuration's rates in its own shuffled order (so rate is not tied to time either)."""
    rng = random.Random(seed)
    rates_of = [rng.sample(range(n_rates), n_rates) for _ in range(n_configs)]
    order = []
    for rnd in range(n_rates):
        order += [(c, rates_of[c][rnd]) for c in rng.sample(range(n_configs), n_configs)]
    return order


async def run_sweep(plan: SweepPlan, spec: WorkloadSpec, opts: RunOptions, results_path: str,
                    on_record=None) -> list[dict]:
    if plan.scale_trace and spec.trace is None:   # the saturation burst must use the trace's lengths too
        spec = replace(spec, trace=DEFAULT_TRACE)
    if plan.interleave:
        launched = [c.target.base_url for c in plan.configs if c.launch]
        if len(set(launched)) < len(launched):
            raise SpecServeError("an interleaved sweep keeps every launched server up at once: "
                                 "give each configuration its own base_url (port)")
    sweep = _Sweep(plan, spec, opts, results_path, on_record)
    if plan.interleave:
        async with contextlib.AsyncExitStack() as servers:
            rates = [await sweep.start(servers, config) for config in plan.configs]
            await sweep.probe()
            for c, i in interleaved_order(len(plan.configs), len(rates[0][0]), plan.seed):
                await sweep.run(c, i, *rates[c])
                await sweep.probe()
    else:
        for c, config in enumerate(plan.configs):
            async with contextlib.AsyncExitStack() as server:
                config_rates, saturation = await sweep.start(server, config)
                for i in range(len(config_rates)):
                    await sweep.run(c, i, config_rates, saturation)
    return sweep.records


class _Sweep:
    """The sweep's state: servers to start, saturation rates measured, runs appended to the results file."""

    def __init__(self, plan: SweepPlan, spec: WorkloadSpec, opts: RunOptions, results_path: str, on_record):
        self.plan, self.spec, self.opts, self.results_path = plan, spec, opts, results_path
        self.on_record = on_record
        self.shared_saturation: float | None = None
        self.records: list[dict] = []

    async def start(self, stack: contextlib.AsyncExitStack, config: Config) -> tuple[list[float], float | None]:
        """Launch the configuration's server (if it has a launch command) into `stack`; its rates."""
        plan = self.plan
        if config.launch:
            await stack.enter_async_context(LaunchedServer(config, plan.log_dir))
        if not plan.fractions:
            return plan.rates, None
        if plan.per_config_saturation or self.shared_saturation is None:
            saturation = await measure_saturation(config.target, self.spec, self.opts, plan.saturation_requests)
            self.shared_saturation = self.shared_saturation or saturation
        if not plan.per_config_saturation:
            saturation = self.shared_saturation
        return [f * saturation for f in plan.fractions], saturation

    async def run(self, c: int, i: int, rates: list[float], saturation: float | None) -> None:
        """Configuration c at its i-th rate."""
        info = {"index": i, "config_index": c, "rate": rates[i]}
        if saturation is not None:
            info.update(saturation_rate=saturation, fraction=self.plan.fractions[i])
        record, rows = await run_once(self.plan.configs[c].target,
                                      _spec_at_rate(self.spec, rates[i], self.plan.scale_trace),
                                      self.opts, sweep_info=info)
        append_run(self.results_path, record, rows)
        self.records.append(record)
        if self.on_record:
            self.on_record(record)

    async def probe(self) -> None:
        """Lone requests, one at a time (the same prompts every time), to the first configuration: its
        latency with no company, i.e. how fast the machine is now."""
        n = self.plan.probe_requests
        if not n:
            return
        target = self.plan.configs[0].target
        spec = replace(self.spec, request_rate=None, max_concurrency=1, max_requests=n, duration_s=None)
        record, rows = await run_once(replace(target, label=f"{target.label}/probe"), spec,
                                      replace(self.opts, discard_first_s=0.0), sweep_info={"probe": True})
        append_run(side_path(self.results_path, "probes"), record, rows)
