"""The latency-model-aware choice (specserve/scaleout/replica_choice.py): C1 + B·C2 with length-aware company."""
import random

import pytest

from specserve.scaleout.hints import RouteHints
from specserve.scaleout.replica_choice import (UNFITTED, Coefficients, ReplicaLoad, Running, SessionTable, company, predict,
                                       rank, remaining_tokens, sticky_replica)

NOW = 1000.0


def hints(g, chars=40, session=None):
    return RouteHints("k", prompt_chars=chars, output_tokens=g, session=session)


def running(*lengths, started=NOW):
    return tuple(Running(g, started) for g in lengths)


def test_coefficients_are_lines_in_output_length_with_a_prefill_shift():
    c = Coefficients(c1=(0.1, 0.02), c2=(0.01, 0.002), prefill_per_token=0.001, prompt_tokens=100)
    assert c.demands(100, 50) == pytest.approx((0.1 + 1.0, 0.01 + 0.1))
    assert c.demands(300, 50)[0] == pytest.approx(1.1 + 0.2)  # 200 more prompt tokens
    assert c.demands(0, 0)[0] == 0.0  # never below zero
    assert Coefficients.from_dict(c.to_dict()) == c
    assert Coefficients.from_dict(None) is UNFITTED


def test_a_co_resident_counts_only_for_the_tokens_it_shares():
    busy_long = ReplicaLoad("long", running=running(256, 256))
    busy_short = ReplicaLoad("short", running=running(16, 16, 16))
    # A long request meets the long ones for all of its life, the short ones for 16/256 of it.
    assert company(busy_long, 256, NOW) == pytest.approx(2.0)
    assert company(busy_short, 256, NOW) == pytest.approx(3 * 16 / 256)
    assert [r for _, r in rank([busy_long, busy_short], hints(256), NOW)] == ["short", "long"]
    # A short request meets everyone for all of its life: the replica with fewer wins.
    assert [r for _, r in rank([busy_long, busy_short], hints(16), NOW)] == ["long", "short"]


def test_progress_from_measured_time_per_token_shortens_what_is_left():
    r = Running(100, started=NOW - 1.1)
    assert remaining_tokens(r, NOW, None, None) == 100  # not measured yet: all of it
    assert remaining_tokens(r, NOW, tpot_s=0.01, ttft_s=0.1) == pytest.approx(0.0 + 1.0)  # done, at least 1
    assert remaining_tokens(r, NOW, tpot_s=0.02, ttft_s=0.1) == pytest.approx(50.0)


def test_requests_of_other_callers_count_as_full_company():
    load = ReplicaLoad("a", running=running(10), ongoing=4)
    assert company(load, 10, NOW) == pytest.approx(1 + 3)
    assert company(ReplicaLoad("a", running=running(10), ongoing=0), 10, NOW) == pytest.approx(1)


def test_fitted_coefficients_trade_speed_against_queue():
    fast = Coefficients(c1=(0.0, 0.01), c2=(0.0, 0.005), fitted=True)  # per output token: twice as fast
    slow = Coefficients(c1=(0.0, 0.02), c2=(0.0, 0.010), fitted=True)
    idle_slow = ReplicaLoad("slow", slow)
    for n, best in ((1, "fast"), (2, "slow"), (3, "slow")):
        # L(fast) = 0.01g(1 + n/2) against L(slow) = 0.02g: the fast one wins until it has 2 in flight.
        loads = [ReplicaLoad("fast", fast, running(100) * n), idle_slow]
        order = rank(loads, hints(100), NOW)
        assert order[0][1] == best, (n, order)
    assert predict(ReplicaLoad("fast", fast, running(100)), hints(100), NOW) == pytest.approx(1.5)


def test_prompt_characters_become_tokens_with_the_replicas_ratio():
    c = Coefficients(c1=(0.0, 0.0), c2=(0.0, 0.0), prefill_per_token=0.01, prompt_tokens=0.0)
    assert predict(ReplicaLoad("a", c, chars_per_token=4.0), hints(8, chars=400), NOW) == pytest.approx(1.0)
    assert predict(ReplicaLoad("a", c, chars_per_token=2.0), hints(8, chars=400), NOW) == pytest.approx(2.0)


def test_a_request_without_max_tokens_assumes_the_fitted_reference_length():
    c = Coefficients(c1=(0.0, 1.0), c2=(0.0, 0.0), output_tokens=64)
    assert predict(ReplicaLoad("a", c), RouteHints("k"), NOW) == pytest.approx(64)
    assert predict(ReplicaLoad("a", c), None, NOW) == pytest.approx(64)


def test_ties_go_to_fewer_in_flight_then_less_kv_then_chance():
    a = ReplicaLoad("a", kv_usage=0.5)
    b = ReplicaLoad("b", kv_usage=0.1)
    assert [r for _, r in rank([a, b], hints(10), NOW)] == ["b", "a"]
    firsts = {rank([ReplicaLoad("a"), ReplicaLoad("b")], hints(10), NOW, random.Random(seed))[0][1] for seed in range(20)}
    assert firsts == {"a", "b"}


def test_a_session_stays_until_its_replica_is_much_busier_or_gone():
    loads = [ReplicaLoad("a", running=running(*[10] * 3)), ReplicaLoad("b")]
    assert sticky_replica("a", loads, imbalance=8) == "a"
    assert sticky_replica("a", loads, imbalance=3) is None  # 3 more in flight than b
    assert sticky_replica("gone", loads, imbalance=8) is None
    assert sticky_replica(None, loads, imbalance=8) is None


def test_session_table_forgets_the_least_recently_used():
    t = SessionTable(max_entries=2)
    t.set("s1", "a")
    t.set("s2", "b")
    assert t.get("s1") == "a"  # s1 is now the most recent
    t.set("s3", "a")
    assert t.get("s2") is None and t.get("s1") == "a" and len(t) == 2
