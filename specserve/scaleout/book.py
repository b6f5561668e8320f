"""Bookkeeping that the request router and the ingress share: one `Book` per process.

Ray runs a deployment handle's request router inside the caller's process, here the ingress, possibly on
its own event-loop thread; so the router writes what it routed and the ingress reads which replicas exist
(to fan /health and /metrics out), where a failed request was (to retry it elsewhere) and how many
requests each replica got. A lock guards every access.
"""
from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict

from specserve.scaleout.hints import RouteHints
from specserve.scaleout.replica_choice import Coefficients, ReplicaLoad, Running, SessionTable

MAX_REMEMBERED = 65536  # request keys remembered for retries (a retry comes within seconds)


class Book:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._replicas: dict[str, dict] = {}  # replica id -> its last routing stats
        self._running: dict[str, dict[str, tuple[str, Running]]] = {}  # replica -> ray request id -> (key, r)
        self._where: OrderedDict[str, str] = OrderedDict()  # request key -> replica it was sent to
        self.routed: Counter = Counter()  # replica -> requests sent (ever)
        self.sessions = SessionTable()

    def set_replicas(self, stats: dict[str, dict]) -> None:
        with self._lock:
            self._replicas = dict(stats)
            for gone in set(self._running) - set(stats):
                del self._running[gone]

    def replicas(self) -> list[str]:
        with self._lock:
            return sorted(self._replicas)

    def _run(self, replica: str, request_id: str, hints: RouteHints | None, default_tokens: float) -> None:
        """Count the request in flight on `replica` alone (lock held)."""
        output = float(hints.output_tokens) if hints and hints.output_tokens else default_tokens
        for running in self._running.values():
            running.pop(request_id, None)
        self._running.setdefault(replica, {})[request_id] = (
            hints.key if hints else request_id, Running(output, time.monotonic()))

    def chosen(self, replica: str, request_id: str, hints: RouteHints | None, default_tokens: float) -> None:
        """The router ranked `replica` first for this request: count it there already, so that requests
        routed at the same moment (a burst reaching the serving process at once) see it as company instead of
        all taking the same replica; `started` moves it where Ray did send it. One never sent ages out of the
        company count with its expected length (replica_choice: r tokens left)."""
        with self._lock:
            self._run(replica, request_id, hints, default_tokens)

    def started(self, replica: str, request_id: str, hints: RouteHints | None, default_tokens: float) -> None:
        with self._lock:
            self._run(replica, request_id, hints, default_tokens)
            self.routed[replica] += 1
            if hints is not None:
                self._where[hints.key] = replica
                while len(self._where) > MAX_REMEMBERED:
                    self._where.popitem(last=False)
                if hints.session is not None:
                    self.sessions.set(hints.session, replica)

    def finished(self, replica: str, request_id: str) -> None:
        with self._lock:
            self._running.get(replica, {}).pop(request_id, None)

    def session_replica(self, session: str | None) -> str | None:
        if session is None:
            return None
        with self._lock:
            return self.sessions.get(session)

    def replica_of(self, key: str) -> str | None:
        with self._lock:
            return self._where.get(key)

    def routed_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.routed)

    def in_flight(self) -> dict[str, int]:
        with self._lock:
            return {r: len(self._running.get(r, {})) for r in self._replicas}

    def load(self, replica: str, stats: dict | None, ongoing: int | None) -> ReplicaLoad:
        """A snapshot for policy.rank: this router's requests on the replica plus what it exports."""
        stats = stats or {}
        with self._lock:
            running = tuple(r for _, r in self._running.get(replica, {}).values())
        return ReplicaLoad(replica, Coefficients.from_dict(stats.get("coefficients")), running, ongoing,
                           stats.get("tpot_s"), stats.get("ttft_s"), stats.get("chars_per_token") or 4.0,
                           stats.get("kv_usage") or 0.0)


BOOK = Book()
