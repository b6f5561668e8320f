"""The latency-model-aware choice of a replica: pure functions over snapshots of each replica's load.

The request-level model of docs/design.md §2 says a request's latency is L = C1 + B·C2: C1 its own demand
(a lone request's latency), C2 what each request in flight beside it adds, both functions of the request's
prompt and output lengths at the replica's draft length k and acceptance E. The router predicts L on every
replica, with that replica's coefficients and its company B, and sends the request where L is lowest.

B is counted the way the model charges it: a co-resident costs C2 only while both are in flight, so one
with r tokens left counts min(1, r/g) for a request of g tokens. That is where this differs from power of
two choices on queue length: a long request avoids replicas busy with other long ones, and a short one
does not mind a replica whose requests are all about to finish. r is the co-resident's max_tokens less
what the replica's measured time per output token says it has generated since it started.
Requests other callers sent (Ray's count of the replica's ongoing requests beyond this router's own) count
as full company. Without a fitted model every replica gets C1 = C2 = g (relative units): the choice is
then the least in-flight work.
"""
from __future__ import annotations

import math
import random
from collections import OrderedDict
from dataclasses import asdict, dataclass

from specserve.scaleout.hints import RouteHints


@dataclass(frozen=True)
class Coefficients:
    """A replica's demands for one request of p prompt and g output tokens (seconds when fitted):
    C1 = c1[0] + c1[1]·g + prefill_per_token·(p − prompt_tokens), at least 0;  C2 = c2[0] + c2[1]·g."""
    c1: tuple[float, float] = (0.0, 1.0)
    c2: tuple[float, float] = (0.0, 1.0)
    prefill_per_token: float = 0.0
    prompt_tokens: float = 0.0  # the fitted runs' mean prompt: where the prefill shift is zero
    output_tokens: float = 128.0  # assumed for a request that does not say (no max_tokens)
    k: int = 0
    acceptance_length: float = 1.0
    fitted: bool = False
    source: str = "none"

    def demands(self, p: float, g: float) -> tuple[float, float]:
        c1 = max(self.c1[0] + self.c1[1] * g + self.prefill_per_token * (p - self.prompt_tokens), 0.0)
        return c1, self.c2[0] + self.c2[1] * g

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "Coefficients":
        if not d:
            return UNFITTED
        d = dict(d)
        d["c1"], d["c2"] = tuple(d["c1"]), tuple(d["c2"])
        return cls(**d)


UNFITTED = Coefficients()


@dataclass(frozen=True)
class Running:
    """A request this router sent to a replica and has not seen finish."""
    output_tokens: float
    started: float  # time.monotonic() when it was routed


@dataclass(frozen=True)
class ReplicaLoad:
    replica: str
    coefficients: Coefficients = UNFITTED
    running: tuple[Running, ...] = ()
    ongoing: int | None = None  # the replica's ongoing requests from every caller, as Ray last counted
    tpot_s: float | None = None  # its recent mean time per output token (None: not measured yet)
    ttft_s: float | None = None  # its recent mean time to first token
    chars_per_token: float = 4.0
    kv_usage: float = 0.0


def remaining_tokens(r: Running, now: float, tpot_s: float | None, ttft_s: float | None) -> float:
    """Output tokens r still has to generate; at least 1 while it is in flight."""
    done = 0.0
    if tpot_s and tpot_s > 0:
        done = max(0.0, now - r.started - (ttft_s or 0.0)) / tpot_s
    return max(r.output_tokens - done, 1.0)


def company(load: ReplicaLoad, g: float, now: float) -> float:
    """B for a new request of g output tokens on this replica (see the module docstring)."""
    own = sum(min(1.0, remaining_tokens(r, now, load.tpot_s, load.ttft_s) / g) for r in load.running)
    foreign = max(0, load.ongoing - len(load.running)) if load.ongoing is not None else 0
    return own + foreign


def request_lengths(load: ReplicaLoad, hints: RouteHints | None) -> tuple[float, float]:
    c = load.coefficients
    if hints is None:
        return c.prompt_tokens, c.output_tokens
    return hints.prompt_tokens(load.chars_per_token), float(hints.output_tokens or c.output_tokens)


def predict(load: ReplicaLoad, hints: RouteHints | None, now: float) -> float:
    """Predicted latency of this request on this replica: C1 + B·C2."""
    p, g = request_lengths(load, hints)
    c1, c2 = load.coefficients.demands(p, g)
    return c1 + company(load, max(g, 1.0), now) * c2


def rank(loads: list[ReplicaLoad], hints: RouteHints | None, now: float,
         rng: random.Random | None = None) -> list[tuple[float, str]]:
    """(predicted latency, replica), best first; ties go to fewer requests in flight, then less KV use,
    then chance (so that an idle deployment does not send everything to one replica)."""
    rng = rng or random
    scored = [(predict(l, hints, now), len(l.running), l.kv_usage, rng.random(), l.replica) for l in loads]
    scored.sort(key=lambda s: (s[0] if math.isfinite(s[0]) else math.inf, s[1], s[2], s[3]))
    return [(s[0], s[4]) for s in scored]


class SessionTable:
    """Session -> replica, least recently used first out, so a long-running router stays bounded."""

    def __init__(self, max_entries: int = 65536):
        self.max_entries = max_entries
        self._table: OrderedDict[str, str] = OrderedDict()

    def get(self, session: str) -> str | None:
        replica = self._table.get(session)
        if replica is not None:
            self._table.move_to_end(session)
        return replica

    def set(self, session: str, replica: str) -> None:
        self._table[session] = replica
        self._table.move_to_end(session)
        while len(self._table) > self.max_entries:
            self._table.popitem(last=False)

    def __len__(self) -> int:
        return len(self._table)


def sticky_replica(replica: str | None, loads: list[ReplicaLoad], imbalance: int) -> str | None:
    """`replica`, the one this request's session is on, while it is up and not `imbalance` requests busier
    than the least busy one (the chat then moves: its cached prefix is worth less than that queue)."""
    busy = {l.replica: max(len(l.running), l.ongoing or 0) for l in loads}
    if replica not in busy or busy[replica] - min(busy.values()) >= imbalance:
        return None
    return replica
