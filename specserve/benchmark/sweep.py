"""Sweeps: every server configuration at every request rate, appended to one results file.

Rates are given, or are fractions of a saturation rate measured first with a burst of requests. A
configuration may carry a `launch` command: the sweep then starts that server, waits until it answers
/v1/models, measures it and stops it, so configurations that need different server flags run unattended.
"""
from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from specserve.benchmark import arrivals as arr
from specserve.benchmark.client import api_root
from specserve.benchmark.results import append_run
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
    # Replay the trace with its clock scaled so that its mean rate (from --start to its end) becomes
    # `rate`, over --duration seconds of wall time: the trace window is --duration / scale long.
    wall_s = spec.duration_s or DEFAULT_TRACE_WINDOW_S
    base = arr.window(arr.load_trace(spec.trace or DEFAULT_TRACE, spec.trace_format), spec.start_s)
    scale = base.mean_rate / rate
    return replace(spec, request_rate=None, max_concurrency=None, time_scale=scale, duration_s=wall_s / scale)


async def run_sweep(plan: SweepPlan, spec: WorkloadSpec, opts: RunOptions, results_path: str,
                    on_record=None) -> list[dict]:
    records = []
    shared_saturation = None
    if plan.scale_trace and spec.trace is None:   # the saturation burst must use the trace's lengths too
        spec = replace(spec, trace=DEFAULT_TRACE)
    for index, config in enumerate(plan.configs):
        launched = LaunchedServer(config, plan.log_dir) if config.launch else None
        if launched:
            await launched.__aenter__()
        try:
            rates, saturation = plan.rates, None
            if plan.fractions:
                if plan.per_config_saturation or shared_saturation is None:
                    saturation = await measure_saturation(config.target, spec, opts,
                                                          plan.saturation_requests)
                    if shared_saturation is None:
                        shared_saturation = saturation
                saturation = saturation if plan.per_config_saturation else shared_saturation
                rates = [f * saturation for f in plan.fractions]
            for i, rate in enumerate(rates):
                info = {"index": i, "config_index": index, "rate": rate}
                if saturation is not None:
                    info.update(saturation_rate=saturation, fraction=plan.fractions[i])
                record, rows = await run_once(config.target, _spec_at_rate(spec, rate, plan.scale_trace),
                                              opts, sweep_info=info)
                append_run(results_path, record, rows)
                records.append(record)
                if on_record:
                    on_record(record)
        finally:
            if launched:
                await launched.__aexit__()
    return records
