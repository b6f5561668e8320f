"""Ray Serve request routers for the engine replicas: latency-model-aware (default) and power of two.

Ray calls `choose_replicas` for each request with the replicas that are up; it returns ranks of replicas
to try in order, and Ray's base class takes, within a rank, the replica with the shortest queue that still
accepts (its max_ongoing_requests). Both routers here also keep what every request needs whatever the
policy: a call pinned to one replica (the ingress's /health and /metrics fan-out) goes exactly there, a
retry avoids the replicas that already failed it, and a chat session stays on its replica.

The power-of-two router restates Ray's default procedure (two random replicas, the shorter queue) rather
than subclassing it: Ray's class hands a chosen replica to whichever request is first in line (FIFO), so a
pinned or session request could end up elsewhere; the base class used here matches each replica to the
request it was chosen for.

Ray pickles a router's module by value (RequestRouterConfig), so module globals here would be copies in
the process that routes: the shared book is reached through its own module, `book.BOOK`, as the ingress
reaches it.
"""
from __future__ import annotations

import random
import time

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from specserve.scaleout import book
from specserve.scaleout.hints import RouteHints
from specserve.scaleout.replica_choice import ReplicaLoad, UNFITTED, Coefficients, rank, sticky_replica


def hints_of(pending_request: PendingRequest | None) -> RouteHints | None:
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, RouteHints) else None


class _SpecserveRouting(RequestRouter):
    session_imbalance = 8

    def initialize_state(self, session_imbalance: int = 8, **kwargs) -> None:
        self.session_imbalance = session_imbalance

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        book.BOOK.set_replicas({r.replica_id.unique_id: dict(r.routing_stats or {}) for r in replicas})

    def order(self, loads: list[ReplicaLoad], hints: RouteHints | None) -> list[list[str]]:
        raise NotImplementedError

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Without this Ray retries at once when every replica refuses (all full): a busy loop.
            pending_request.routing_context.should_backoff = True
        hints = hints_of(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if hints is not None and hints.pin is not None:
            return [[by_id[hints.pin]]] if hints.pin in by_id else []
        ids = [i for i in by_id if hints is None or i not in hints.avoid] or list(by_id)
        cache = self.replica_queue_len_cache
        loads = [book.BOOK.load(i, by_id[i].routing_stats, cache.get(by_id[i].replica_id)) for i in ids]
        ranks = self.order(loads, hints)
        sticky = sticky_replica(book.BOOK.session_replica(hints.session if hints else None), loads,
                                self.session_imbalance)
        if sticky is not None:
            ranks = [[sticky]] + [[i for i in r if i != sticky] for r in ranks]
        if pending_request is not None and ranks and len(ranks[0]) == 1:  # a first choice Ray will take if it can
            book.BOOK.chosen(ranks[0][0], pending_request.metadata.internal_request_id, hints,
                             self._default_tokens(by_id[ranks[0][0]]))
        return [[by_id[i] for i in r] for r in ranks if r]

    @staticmethod
    def _default_tokens(replica: RunningReplica | None) -> float:
        stats = (replica.routing_stats if replica is not None else None) or {}
        return Coefficients.from_dict(stats.get("coefficients")).output_tokens if stats else UNFITTED.output_tokens

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        hints = hints_of(pending_request)
        if hints is not None and hints.pin is not None:
            return  # a health or metrics call, not load
        book.BOOK.started(replica_id.unique_id, pending_request.metadata.internal_request_id, hints,
                          self._default_tokens(self.curr_replicas.get(replica_id)))

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        book.BOOK.finished(replica_id.unique_id, internal_request_id)


class LatencyAwareRouter(_SpecserveRouting):
    """Every replica ranked by the request's predicted latency there (replica_choice.py)."""

    def order(self, loads, hints):
        return [[replica] for _, replica in rank(loads, hints, time.monotonic())]


class PowerOfTwoRouter(_SpecserveRouting):
    """Ray's default: two replicas at random, the one with the shorter queue."""

    def order(self, loads, hints):
        ids = [l.replica for l in loads]
        return [random.sample(ids, min(2, len(ids)))]


ROUTER_CLASSES = {"latency": LatencyAwareRouter, "pow2": PowerOfTwoRouter}
