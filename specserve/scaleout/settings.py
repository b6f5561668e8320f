"""What a scale-out deployment is made of: engine flags, replica count and resources, router, retries.

One flat, JSON-able record, built from `specserve serve --replicas N ...` or from the `args:` block of a
Ray Serve config file (docs/scaleout.md), and handed to every replica and to the ingress as a dict.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field, fields

from specserve.errors import SpecServeError

ROUTERS = ("pow2", "latency")
FRONTS = ("process", "ray")  # who answers HTTP: the serving process itself, or Ray Serve's proxy
DEFAULT_SESSION_FIELDS = ("session_id", "user")
APP_NAME = "specserve"


def engine_defaults() -> dict:
    """The engine flags and their defaults, from the very parser `specserve serve` uses (engine/args.py),
    so that both paths agree and a new engine flag reaches the replicas without a change here."""
    from specserve.engine.args import add_engine_args
    from specserve.engine.config import SERVER_MAX_NUM_BATCHED_TOKENS

    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p, SERVER_MAX_NUM_BATCHED_TOKENS)
    return vars(p.parse_args([]))


ENGINE_KEYS = tuple(engine_defaults())


@dataclass
class ScaleoutSettings:
    engine: dict = field(default_factory=engine_defaults)
    replicas: int = 2
    router: str = "pow2"  # the latency router did not beat it on the measured mix (docs/scaleout.md)
    front: str = "process"
    latency_model: str | None = None  # model.json from `specserve latency fit`: the replicas' coefficients
    session_fields: tuple[str, ...] = DEFAULT_SESSION_FIELDS  # request fields that pin a session to a replica
    session_imbalance: int = 8  # a session leaves its replica when that one has this many more in flight
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    max_queue: int | None = None
    max_retries: int = 2  # attempts on another replica when one dies (or is full) before answering
    max_ongoing_requests: int | None = None  # per replica, Ray's cap; default 4 x max_num_seqs
    gpus_per_replica: float = 0.0
    drain_timeout: float = 30.0
    stats_period_s: float = 1.0  # how often each replica's load and coefficients reach the router
    # The single-process server's limits (server/limits.py, docs/server.md), applied per replica and, for
    # the body size, by the ingress before it forwards anything.
    max_request_bytes: int = 4 << 20
    timeout_read: float = 15.0
    timeout_keep_alive: float = 5.0
    engine_stall_timeout: float = 60.0
    generation_config: str = "auto"  # the replicas' sampling defaults (server/generation_config.py)
    tool_call_parser: str = "auto"  # server/tool_parsers.py

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise SpecServeError(f"--replicas must be at least 1, got {self.replicas}")
        if self.router not in ROUTERS:
            raise SpecServeError(f"--router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.front not in FRONTS:
            raise SpecServeError(f"--front must be one of {', '.join(FRONTS)}, got {self.front!r}")
        if self.max_retries < 0:
            raise SpecServeError(f"--max-retries must be >= 0, got {self.max_retries}")
        if self.gpus_per_replica < 0:
            raise SpecServeError(f"--gpus-per-replica must be >= 0, got {self.gpus_per_replica}")
        unknown = set(self.engine) - set(ENGINE_KEYS)
        if unknown:
            raise SpecServeError(f"unknown engine settings: {', '.join(sorted(unknown))}")
        self.session_fields = tuple(self.session_fields)
        self.served_model_names = tuple(self.served_model_names or (self.engine["model"],))

    @property
    def num_threads(self) -> int:
        return self.engine.get("num_threads") or 1

    @property
    def speculative_k(self) -> int:
        """The draft length the replicas run (0 without speculation): which k of a fitted model applies."""
        from specserve.spec_decode.config import SpeculativeConfig
        spec = SpeculativeConfig.parse(self.engine.get("speculative_config"))
        return 0 if spec is None else int(spec.num_speculative_tokens)

    @property
    def ongoing_cap(self) -> int:
        return self.max_ongoing_requests or 4 * int(self.engine["max_num_seqs"])

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ScaleoutSettings":
        """From `to_dict()` or from a Serve config's flat `args:` (engine flags beside the others, dashes
        or underscores), e.g. {"model": "smollm2-135m", "replicas": 2, "num-threads": 1}."""
        d = {str(k).replace("-", "_"): v for k, v in d.items()}
        engine = dict(engine_defaults(), **d.pop("engine", {}))
        for key in ENGINE_KEYS:
            if key in d:
                engine[key] = d.pop(key)
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise SpecServeError(f"unknown scale-out settings: {', '.join(sorted(unknown))} "
                                 f"(known: {', '.join(sorted(known - {'engine'}) + list(ENGINE_KEYS))})")
        if isinstance(d.get("session_fields"), str):
            d["session_fields"] = parse_session_fields(d["session_fields"])
        if isinstance(d.get("served_model_names"), str):
            d["served_model_names"] = (d["served_model_names"],)
        return cls(engine=engine, **d)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ScaleoutSettings":
        """From `specserve serve --replicas N ...` (after the speculative default has been chosen)."""
        return cls(engine={k: getattr(args, k) for k in ENGINE_KEYS}, replicas=args.replicas, router=args.router,
                   front=args.front, latency_model=args.latency_model,
                   session_fields=parse_session_fields(args.session_field),
                   served_model_names=tuple(args.served_model_name or ()), api_key=args.api_key,
                   max_queue=args.max_queue, max_retries=args.max_retries,
                   gpus_per_replica=args.gpus_per_replica, drain_timeout=args.drain_timeout,
                   max_request_bytes=args.max_request_bytes, timeout_read=args.timeout_read,
                   timeout_keep_alive=args.timeout_keep_alive, engine_stall_timeout=args.engine_stall_timeout,
                   generation_config=args.generation_config, tool_call_parser=args.tool_call_parser)


def parse_session_fields(text: str | None) -> tuple[str, ...]:
    """'session_id,user' -> ('session_id', 'user'); 'none' or '' -> no session affinity."""
    if text is None:
        return DEFAULT_SESSION_FIELDS
    if text.strip().lower() in ("", "none", "off"):
        return ()
    return tuple(f.strip() for f in text.split(",") if f.strip())
