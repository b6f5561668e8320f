"""Prometheus metrics in vLLM's naming (docs/server.md#metrics) with the prefix `specserve:`.

Counters and histograms are fed by the engine's listeners on the step thread (prometheus_client is
thread-safe); the running/waiting/KV gauges are read at scrape time, so they are right even while the
engine is idle between steps. Each app has its own registry, so several apps in one process (tests)
never share or clash.
"""
from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specserve.engine.async_engine import AsyncLLMEngine
from specserve.engine.outputs import RequestOutput, StepStats

P = "specserve:"
log = logging.getLogger("specserve.server")

# Seconds; wide enough for a CPU server under overload, fine enough for a GPU at batch 1.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                     0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
DRAFT_LENGTH_BUCKETS = tuple(range(0, 17))  # draft lengths are integers below MAX_SPECULATIVE_TOKENS


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.registry = r = CollectorRegistry()
        m = ["model_name"]
        self._model = model_name
        self.requests = Counter(P + "request_success", "Finished requests by finish reason (abort = "
                                "client went away)", m + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of requests that started "
                                     "generating", m, registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens", m, registry=r)
        self.preemptions = Counter(P + "num_preemptions", "Requests preempted (KV dropped, recomputed later)",
                                   m, registry=r)
        self.cache_queries = Counter(P + "prefix_cache_queries", "Prefix cache queries, in prompt tokens of "
                                     "admitted requests", m, registry=r)
        self.cache_hits = Counter(P + "prefix_cache_hits", "Prefix cache hits, in prompt tokens whose KV the "
                                  "cache held", m, registry=r)
        self.restarts = Counter(P + "engine_restarts", "Engine processes started after the engine died or hung",
                                m, registry=r)
        for name, doc, read in (
                ("num_requests_running", "Requests in the running batch", lambda: engine.num_running),
                ("num_requests_waiting", "Requests waiting for admission", lambda: engine.num_waiting),
                ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1)",
                 lambda: engine.kv_usage)):
            Gauge(P + name, doc, m, registry=r).labels(model_name).set_function(read)

        def hist(name, doc, buckets, labels=m):
            return Histogram(P + name, doc, labels, buckets=buckets, registry=r)
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token", LATENCY_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Per request: (finish - first token) / "
                         "(output tokens - 1)", TOKEN_GAP_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Gap between consecutive outputs of a request "
                        "(one output may carry several tokens when drafts are accepted)", TOKEN_GAP_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish", LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled", LATENCY_BUCKETS)
        self.spec_drafts = Counter(P + "spec_decode_num_drafts", "Verifications that carried at least one "
                                   "draft token", m, registry=r)
        self.spec_draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "Draft tokens proposed", m, registry=r)
        self.spec_accepted = Counter(P + "spec_decode_num_accepted_tokens", "Draft tokens accepted", m, registry=r)
        self.spec_per_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at "
                                    "each draft position (0 = first)", m + ["position"], registry=r)
        self.draft_length = hist("spec_decode_draft_length", "Draft length of each decode in each step "
                                 "(0 = no drafting for that request)", DRAFT_LENGTH_BUCKETS)
        self.step_draft_length = hist("spec_decode_step_draft_length", "Longest draft of each step with "
                                      "decodes: the speculation length the step used", DRAFT_LENGTH_BUCKETS)
        # The speculation policy and what it predicts with (docs/design.md §3): the step time the cost model
        # predicted against the measured one, its running relative error, and the acceptance model's
        # calibration error (expected calibration error of its recent predictions).
        Gauge(P + "spec_decode_policy_info", "The speculation policy (value 1)", m + ["policy"],
              registry=r).labels(model_name, engine.policy_name or "none").set(1)
        self.step_time = hist("spec_decode_step_time_seconds", "Draft + target forward time of each step with "
                              "decodes: measured, and as the step cost model predicted it", LATENCY_BUCKETS,
                              m + ["kind"])
        for name, doc, read in (
                ("spec_decode_cost_model_relative_error", "Running mean |predicted - measured| / measured step "
                 "time (NaN until the cost model runs)", lambda: engine.cost_model_error),
                ("spec_decode_acceptance_calibration_error", "Expected calibration error of the acceptance "
                 "model's recent predictions (NaN until drafts with confidences are verified)",
                 lambda: engine.calibration_error),
                ("spec_decode_drafting_cost_factor", "Measured over predicted time that drafting added to "
                 "recent steps, which the adaptive policy charges drafting (1 until measured; NaN without a "
                 "cost model)", lambda: engine.drafting_cost_factor)):
            Gauge(P + name, doc, m, registry=r).labels(model_name).set_function(
                lambda read=read: float("nan") if read() is None else read())
        # Requests with objectives (SLOs): how many met each, counted when they finish.
        self.slo = Counter(P + "slo_requests", "Finished requests with an objective, by objective and whether "
                           "it was met", m + ["objective", "met"], registry=r)
        for objective in ("ttft", "tpot"):
            for met in ("true", "false"):
                self.slo.labels(model_name, objective, met)
        # With several drafts routed per request (spec_decode/router.py): each draft's share of the traffic and its
        # acceptance (1 + accepted / drafts), counted when a request finishes.
        self._routed = tuple(Counter(P + "spec_decode_draft_" + name, doc, m + ["draft"], registry=r) for name, doc in (
            ("requests", "Finished requests each draft served"),
            ("num_drafts", "spec_decode_num_drafts by draft"),
            ("num_draft_tokens", "spec_decode_num_draft_tokens by draft"),
            ("num_accepted_tokens", "spec_decode_num_accepted_tokens by draft")))
        # Create every series now, so a scraper sees 0 rather than no series before the first event.
        for metric in (self.prompt_tokens, self.generation_tokens, self.preemptions, self.restarts,
                       self.cache_queries, self.cache_hits, self.ttft,
                       self.tpot, self.itl, self.e2e, self.queue, self.spec_drafts, self.spec_draft_tokens,
                       self.spec_accepted, self.draft_length, self.step_draft_length):
            metric.labels(model_name)
        for draft in engine.draft_names:
            for metric in self._routed:
                metric.labels(model_name, draft)
        for reason in ("stop", "length", "abort"):
            self.requests.labels(model_name, reason)
        self._last_output: dict[str, float] = {}  # request id -> time of its previous output (step thread only)
        engine.step_listeners.append(self._guarded(self.on_step))
        engine.output_listeners.append(self._guarded(self.on_output))
        engine.restart_listeners.append(self._guarded(lambda _: self.restarts.labels(model_name).inc()))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    @staticmethod
    def _guarded(fn):
        # A listener runs inside the engine's step loop: a bug in bookkeeping must not stop generation.
        def call(arg):
            try:
                fn(arg)
            except Exception:
                log.exception("metrics listener failed")
        return call

    def on_step(self, s: StepStats) -> None:
        model = self._model
        if s.num_preempted:
            self.preemptions.labels(model).inc(s.num_preempted)
        if s.prefix_cache_queries:
            self.cache_queries.labels(model).inc(s.prefix_cache_queries)
            self.cache_hits.labels(model).inc(s.prefix_cache_hits)
        if s.num_drafts:
            self.spec_drafts.labels(model).inc(s.num_drafts)
            self.spec_draft_tokens.labels(model).inc(s.num_draft_tokens)
            self.spec_accepted.labels(model).inc(s.num_accepted_tokens)
        for pos, n in enumerate(s.accepted_per_position):
            # Touch zero positions too, so every drafted position has a series (acceptance rate = 0 is data).
            self.spec_per_pos.labels(model, str(pos)).inc(n)
        for length in s.draft_lengths:
            self.draft_length.labels(model).observe(length)
        if s.draft_lengths:
            self.step_draft_length.labels(model).observe(max(s.draft_lengths))
            self.step_time.labels(model, "measured").observe(s.t_draft + s.t_forward)
            if s.t_predicted is not None:
                self.step_time.labels(model, "predicted").observe(s.t_predicted)

    def on_output(self, out: RequestOutput) -> None:
        model, now, t = self._model, time.monotonic(), out.metrics
        new = len(out.delta_token_ids)
        if new:
            self.generation_tokens.labels(model).inc(new)
            previous = self._last_output.get(out.request_id)
            if previous is None:
                self.prompt_tokens.labels(model).inc(out.num_prompt_tokens)
            else:
                self.itl.labels(model).observe(now - previous)
            self._last_output[out.request_id] = now
        if not out.finished:
            return
        self._last_output.pop(out.request_id, None)
        self.requests.labels(model, out.finish_reason or "unknown").inc()
        spec = out.spec
        if spec.get("draft") is not None:
            for metric, n in zip(self._routed, (1, spec["num_drafts"], spec["num_draft_tokens"],
                                                spec["num_accepted_tokens"])):
                metric.labels(model, spec["draft"]).inc(n)
        if out.finish_reason == "abort":
            return  # cut short by the client: its latencies describe the client, not the server
        arrival, first, done = t["arrival_time"], t["first_token_time"], t["finished_time"]
        if t["first_scheduled_time"] is not None:
            self.queue.labels(model).observe(t["first_scheduled_time"] - arrival)
        if first is not None:
            self.ttft.labels(model).observe(first - arrival)
            if t["slo_ttft"]:
                self.slo.labels(model, "ttft", str(first - arrival <= t["slo_ttft"]).lower()).inc()
            if out.num_output_tokens > 1:
                tpot = (done - first) / (out.num_output_tokens - 1)
                self.tpot.labels(model).observe(tpot)
                if t["slo_tpot"]:
                    self.slo.labels(model, "tpot", str(tpot <= t["slo_tpot"]).lower()).inc()
        self.e2e.labels(model).observe(done - arrival)
