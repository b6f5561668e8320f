"""Slots: a server that runs at most c requests at once and queues the rest.

llama.cpp's `llama-server -np c` has c fixed slots; vLLM's `--max-num-seqs` and ours cap the batch the same
way. Below the cap every request joins the batch, as docs/design.md §2.1 assumes; past it the newcomers wait
for a slot, and the batch stops growing, so the requests running are no slower than c of them make them.

The slots are then c servers in front of which requests queue first come, first served. A request holds
its slot for its service time S, the model's latency L(λ) while fewer than c share the batch, and at most
C1 + C2·(c − 1), what a full batch makes it:

    S = min(L(λ), C1 + C2·(c − 1)),    a = λ·S (slots busy on average),    saturated once a ≥ c,

and waits for a slot, on average, Allen and Cunneen's M/G/c approximation

    W = ErlangC(c, a) · S/(c − a) · (ca² + cs²)/2,

ErlangC(c, a) the probability that all c are busy when it arrives (exact for Poisson arrivals and
exponential service, ca = cs = 1), ca the arrival gaps' CV and cs the service times' (0 when every request
has the same length; from the lifetimes' spread otherwise). Requests of one length hold their slots for
nearly the same time, which halves Erlang's wait; a chain with memoryless service would instead spread
the number in flight far wider than a server's measured runs show (llama.cpp's at three quarters of its
saturation: variance 3.3 at mean 3.6, Poisson's, against the 8 such a chain gives; docs/latency.md).

The mean latency is then L + W below the cap (W ≈ 0 until the batch nears c) and S + W past it; TTFT
gains W (the wait comes before the first token) and the batch holds λ·(L − W) requests.
"""
from __future__ import annotations

import math

from specserve.errors import SpecServeError


def check_slots(slots: int | None) -> int | None:
    if slots is None:
        return None
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise SpecServeError(f"slots must be a positive integer (requests a server runs at once), got {slots!r}")
    return slots


def slot_saturation(c1: float, c2: float, slots: int) -> float:
    """The rate at which the slots are all busy, λ·S = c with S = min(C1/(1 − λ·C2), C1 + C2·(c − 1)):
    c/(C1 + C2·(c − 1)) where a full batch sets S there, else c/(C1 + c·C2), where the uncapped model's
    λ·L reaches c first."""
    full = c1 + c2 * (slots - 1)
    rate = slots / full
    if rate * c2 < 1.0 and c1 / (1.0 - rate * c2) >= full:
        return rate
    return slots / (c1 + slots * c2)


def erlang_c(slots: int, busy: float) -> float:
    """Probability that all `slots` servers are busy on an arrival, offered load `busy` < slots (M/M/c),
    from Erlang B's recurrence B(j) = a·B(j − 1)/(j + a·B(j − 1)), which stays finite for any c."""
    blocked = 1.0
    for j in range(1, slots + 1):
        blocked = busy * blocked / (j + busy * blocked)
    return slots * blocked / (slots - busy * (1.0 - blocked))


def slot_delay(latency: float, c1: float, c2: float, rate: float, slots: int | None, cv: float = 1.0,
               service_cv: float = 0.0) -> tuple[float, float]:
    """(latency the cap adds to the uncapped `latency` L(λ), mean wait for a slot); (0, 0) without a cap or
    load, (inf, inf) at or past the slots' saturation."""
    if slots is None or rate <= 0.0:
        return 0.0, 0.0
    if math.isinf(latency):
        return math.inf, math.inf
    service = min(latency, c1 + c2 * (slots - 1))
    busy = rate * service
    if busy >= slots:
        return math.inf, math.inf
    wait = erlang_c(slots, busy) * service / (slots - busy) * (cv ** 2 + service_cv ** 2) / 2.0
    return wait - (latency - service), wait  # S + W − L, exactly W while the batch stays under the cap
