"""One engine replica: the unchanged specserve app (server/app.py) around its own AsyncLLMEngine.

The ingress forwards each HTTP request here (`handle`, through bridge.py), so every OpenAI detail (errors,
streaming, logprobs, the API key, the queue limit) is the single-process server's. Besides, a replica tells
the router what it needs (`record_routing_stats`, which Ray calls every few seconds): its live load, the
latency model's coefficients for its configuration, its tokenizer's characters per token and its recent
TTFT and time per output token; and it answers the ingress's pinned `scrape` and `health` calls.
"""
from __future__ import annotations

import logging
import os
from types import SimpleNamespace

from specserve.scaleout.bridge import call_asgi
from specserve.scaleout.hints import RouteHints
from specserve.scaleout.replica_choice import UNFITTED, Coefficients
from specserve.scaleout.settings import ScaleoutSettings

log = logging.getLogger("specserve.scaleout")

# A fixed English sample for the tokenizer's characters per token: the ingress counts prompt characters.
CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts a few tokens with a small "
    "model and verifies them with the large one in a single pass; under load, the drafted tokens compete "
    "with every other request for the same batch. def fibonacci(n):\n    return n if n < 2 else "
    "fibonacci(n - 1) + fibonacci(n - 2)\n") * 4
EWMA_WEIGHT = 0.2  # weight of the newest finished request in the recent TTFT / TPOT means


class RecentLatency:
    """Exponentially weighted mean TTFT and time per output token of finished requests (step thread)."""

    def __init__(self) -> None:
        self.ttft_s: float | None = None
        self.tpot_s: float | None = None

    @staticmethod
    def _mix(old: float | None, new: float) -> float:
        return new if old is None else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * new

    def on_output(self, out) -> None:
        if not out.finished or out.finish_reason == "abort" or not out.metrics:
            return
        t = out.metrics
        first, done, arrival = t.get("first_token_time"), t.get("finished_time"), t.get("arrival_time")
        if first is None or done is None or arrival is None:
            return
        self.ttft_s = self._mix(self.ttft_s, first - arrival)
        if out.num_output_tokens > 1:
            self.tpot_s = self._mix(self.tpot_s, (done - first) / (out.num_output_tokens - 1))


class EngineReplica:
    def __init__(self, settings: dict):
        import prometheus_client
        from ray import serve

        from specserve.engine.args import engine_config_from_args
        from specserve.engine.async_engine import AsyncLLMEngine
        from specserve.server.app import build_app
        from specserve.server.generation_config import resolve

        prometheus_client.disable_created_metrics()  # as `specserve serve` does (server/cli.py)
        s = ScaleoutSettings.from_dict(settings)
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.rank = getattr(context.rank, "rank", context.rank)
        self.engine = AsyncLLMEngine(engine_config_from_args(SimpleNamespace(**s.engine)),
                                     stall_timeout=s.engine_stall_timeout)
        self.app = build_app(self.engine, list(s.served_model_names), s.api_key, s.max_queue,
                             max_request_bytes=s.max_request_bytes, timeout_read=s.timeout_read,
                             sampling_defaults=resolve(s.generation_config, s.engine["model"])[0],
                             tool_call_parser=s.tool_call_parser)
        self.engine.start()  # what the app's lifespan would do: the bridge calls the app without one
        self.recent = RecentLatency()
        self.engine.output_listeners.append(self.recent.on_output)
        self.coefficients = self._coefficients(s)
        ids = self.engine.tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)
        self.chars_per_token = len(CALIBRATION_TEXT) / max(len(ids), 1)
        log.info("replica %s (rank %s, pid %d): %d thread(s), coefficients from %s, %.2f chars/token",
                 self.replica_id, self.rank, os.getpid(), s.num_threads, self.coefficients.source,
                 self.chars_per_token)

    @staticmethod
    def _coefficients(s: ScaleoutSettings) -> Coefficients:
        if not s.latency_model:
            return UNFITTED
        from specserve.scaleout.coefficients import from_model_file
        return from_model_file(s.latency_model, s.speculative_k)

    async def handle(self, hints: RouteHints, method: str, path: str, query: bytes,
                     headers: list[tuple[bytes, bytes]], body: bytes):
        """The response to one forwarded request: its start (with this replica's id), then body pieces."""
        async for item in call_asgi(self.app, method, path, query, headers, body):
            if "status" in item:
                item["replica"] = self.replica_id
            yield item

    def load(self) -> dict:
        return {"replica": self.replica_id, "rank": self.rank, "pid": os.getpid(), "running": self.engine.num_running,
                "waiting": self.engine.num_waiting, "kv_usage": self.engine.kv_usage}

    async def scrape(self, hints: RouteHints) -> tuple[str, str]:
        """(replica id, this replica's Prometheus text)."""
        return self.replica_id, self.app.state.metrics.render().decode()

    async def health(self, hints: RouteHints) -> dict:
        problem = self.engine.health_problem()  # a dead or hung step loop, as the server's /health says
        status = "draining" if self.app.state.serving.draining else ("unhealthy" if problem else "ok")
        return dict(self.load(), status=status, problem=problem,
                    latency_model=self.coefficients.source, chars_per_token=self.chars_per_token)

    def record_routing_stats(self) -> dict:
        return dict(self.load(), coefficients=self.coefficients.to_dict(), chars_per_token=self.chars_per_token,
                    tpot_s=self.recent.tpot_s, ttft_s=self.recent.ttft_s)

    def check_health(self) -> None:
        """Ray restarts a replica whose health check raises: here, one whose engine loop died or hung."""
        problem = self.engine.health_problem()
        if problem is not None:
            raise RuntimeError(f"replica {self.replica_id}: {problem}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
