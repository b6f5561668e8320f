"""The Ray request routers' choices, on stand-in replicas (no cluster): pinning, retries, sessions, order."""
import asyncio
from collections import namedtuple
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'specserve[scaleout]')")

from specserve.scaleout import book  # noqa: E402
from specserve.scaleout.hints import RouteHints, pinned  # noqa: E402
from specserve.scaleout.routers import LatencyAwareRouter, PowerOfTwoRouter  # noqa: E402


class Cache:
    def __init__(self, lengths):
        self.lengths = lengths

    def get(self, replica_id):
        return self.lengths.get(replica_id.unique_id)


ReplicaID = namedtuple("ReplicaID", "unique_id")  # hashable, as Ray's is


def replica(name, **stats):
    return SimpleNamespace(replica_id=ReplicaID(name), routing_stats=stats)


def request(hints, rid="r1"):
    return SimpleNamespace(args=[hints], kwargs={}, metadata=SimpleNamespace(internal_request_id=rid),
                           routing_context=SimpleNamespace(should_backoff=False))


def router(cls, queue_lengths=None, replicas=()):
    r = object.__new__(cls)  # the base constructor wants a live deployment; choose_replicas needs none of it
    r._replica_queue_len_cache = Cache(queue_lengths or {})
    r._replicas = {x.replica_id: x for x in replicas}
    return r


@pytest.fixture(autouse=True)
def fresh_book(monkeypatch):
    monkeypatch.setattr(book, "BOOK", book.Book())


def choose(r, replicas, pending):
    ranks = asyncio.run(r.choose_replicas(replicas, pending))
    return [[x.replica_id.unique_id for x in rank] for rank in ranks]


def test_latency_router_ranks_every_replica_and_always_backs_off():
    a, b = replica("a"), replica("b")
    pending = request(RouteHints("k", output_tokens=10))
    r = router(LatencyAwareRouter, {"a": 3, "b": 1})
    assert choose(r, [a, b], pending) == [["b"], ["a"]]  # others' requests count: b has fewer
    assert pending.routing_context.should_backoff  # never a busy loop when all refuse


def test_pinned_calls_go_exactly_there_or_nowhere():
    a, b = replica("a"), replica("b")
    for cls in (LatencyAwareRouter, PowerOfTwoRouter):
        assert choose(router(cls, {"a": 0, "b": 9}), [a, b], request(pinned("b"))) == [["b"]]
        assert choose(router(cls), [a, b], request(pinned("gone"))) == []


def test_a_retry_avoids_the_failed_replica_unless_it_is_the_only_one():
    a, b = replica("a"), replica("b")
    h = RouteHints("k", output_tokens=10).retry("a")
    assert choose(router(LatencyAwareRouter, {"a": 0, "b": 5}), [a, b], request(h)) == [["b"]]
    assert choose(router(PowerOfTwoRouter), [a, b], request(h)) == [["b"]]
    assert choose(router(LatencyAwareRouter), [a], request(h)) == [["a"]]


def test_power_of_two_offers_two_replicas_in_one_rank():
    reps = [replica(n) for n in "abcd"]
    ranks = choose(router(PowerOfTwoRouter), reps, request(RouteHints("k")))
    assert len(ranks) == 1 and len(set(ranks[0])) == 2


def test_a_session_sticks_to_the_replica_it_was_routed_to():
    a, b = replica("a"), replica("b")
    r = router(LatencyAwareRouter, {"a": 2, "b": 0}, [a, b])
    first = request(RouteHints("k1", output_tokens=10, session="chat-1"), "r1")
    r.on_request_routed(first, a.replica_id, None)  # as if it had gone to a (say, b was full)
    assert book.BOOK.session_replica("chat-1") == "a" and book.BOOK.replica_of("k1") == "a"
    later = request(RouteHints("k2", output_tokens=10, session="chat-1"), "r2")
    assert choose(r, [a, b], later)[0] == ["a"]  # though b is idle
    other = request(RouteHints("k3", output_tokens=10, session="chat-2"), "r3")
    assert choose(r, [a, b], other)[0] == ["b"]


def test_the_book_tracks_what_was_routed_and_finished():
    a = replica("a", coefficients={"c1": [0, 1], "c2": [0, 1], "output_tokens": 50})
    r = router(LatencyAwareRouter, replicas=[a])
    book.BOOK.set_replicas({"a": {}})
    r.on_request_routed(request(RouteHints("k"), "r1"), a.replica_id, None)
    r.on_request_routed(request(pinned("a"), "r2"), a.replica_id, None)  # fan-out calls are not load
    assert book.BOOK.in_flight() == {"a": 1} and book.BOOK.routed_counts() == {"a": 1}
    load = book.BOOK.load("a", a.routing_stats, None)
    assert load.running[0].output_tokens == 50  # no max_tokens: the replica's reference length
    r.on_request_completed(a.replica_id, "r1")
    assert book.BOOK.in_flight() == {"a": 0}


def test_requests_chosen_at_the_same_moment_count_each_other_before_ray_routes_them():
    """A burst reaching the serving process at once is ranked before Ray reports any of it routed: each
    first choice counts as company at once, so the burst spreads; Ray's actual choice then replaces it."""
    a, b = replica("a"), replica("b")
    r = router(LatencyAwareRouter, {"a": 0, "b": 0}, [a, b])
    book.BOOK.set_replicas({"a": {}, "b": {}})
    first = [rank[0] for rank in choose(r, [a, b], request(RouteHints("k1", output_tokens=10), "r1"))]
    second = [rank[0] for rank in choose(r, [a, b], request(RouteHints("k2", output_tokens=10), "r2"))]
    assert first[0] != second[0]
    r.on_request_routed(request(RouteHints("k1", output_tokens=10), "r1"), ReplicaID(second[0]), None)
    assert book.BOOK.in_flight() == {second[0]: 2, first[0]: 0} and book.BOOK.routed_counts() == {second[0]: 1}
