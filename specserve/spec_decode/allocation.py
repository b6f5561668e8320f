"""Goodput of one step and the draft lengths that maximise it (docs/design.md §3.1).

Request i drafting l_i tokens commits 1 + Σ_{j ≤ l_i} c_ij tokens in expectation, c_ij = a_i1 ··· a_ij the
probability that its first j drafts all survive. The step takes T = T_verify(rows) + Σ draft forwards.
Two corrections make this the right trade under load (the TPOT check keeps the whole T):
- a prefill chunk riding in the step is not the decodes' cost: they are charged T_0 − S for plain
  decoding, S the chunk's share (T_verify with it minus without it), so a second-long prefill does not
  make drafts look free;
- every second drafting adds to the step delays each request in the system, the m waiting or
  prefilling as well as the n decodes, while the tokens it buys are the decodes' alone: the added time
  is charged w = (n + m) / n times. Without a queue (w = 1) this is plain goodput; as a queue builds,
  drafting must buy w times more to be worth it, and stops first where it buys least.
So the charged time is T_0 − S + w (T − T_0), T_0 the step without drafts. (w also carries how much more
time drafting steps turned out to add than the cost model predicted: predictors.DraftingError.)
Adding the slot (i, j) is worth c_ij tokens; slots are added in order of falling survival (which keeps
each request's slots a prefix: c_ij falls with j), and the best prefix of that order is the allocation.
All prefixes are evaluated at once with numpy, so a plan costs tens of microseconds at 64 requests.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specserve.spec_decode.config import FREE


@dataclass(slots=True)
class StepCosts:
    """A step's cost curves, tabulated for the rows it may carry."""
    verify: np.ndarray              # [max rows + 1] seconds of the target forward with n rows
    draft: dict[str, np.ndarray]    # per draft: [max rows + 1] seconds of one draft forward with r rows
    base_rows: int                  # rows the target runs whatever is drafted (decodes' own + prefill)
    shared: float = 0.0             # S: seconds of the step a prefill chunk in it costs (not the decodes')
    weight: float = 1.0             # w: requests each added second delays, per decode ((n + m) / n), times
                                    # the measured over predicted added time of drafting steps (DraftingError)


@dataclass(slots=True)
class Allocation:
    lengths: list[int]
    tokens: float        # expected committed tokens A
    seconds: float       # predicted step time charged to the decodes, T_0 − S + w (T − T_0)
    plain_tokens: float  # the same for no drafting at all
    plain_seconds: float
    drafting_rate: float = 0.0  # when nothing is drafted: the best tokens per second drafting would add (any
                                # allocation) over plain decoding's; < 1, drafting lowers goodput (0: none could)

    @property
    def goodput(self) -> float:
        return self.tokens / self.seconds

    @property
    def gain(self) -> float:
        """Predicted goodput over plain decoding's (1 = no better)."""
        return self.goodput / (self.plain_tokens / self.plain_seconds)


def survival(acceptance: np.ndarray) -> np.ndarray:
    """[B, K] per-position acceptance a_ij -> survival c_ij = a_i1 ··· a_ij."""
    return np.cumprod(acceptance, axis=1)


def allocate(c: np.ndarray, drafts: list[str | None], limits: list[int], costs: StepCosts,
             tpot_slos: list[float | None] | None = None, first_rows: list[int] | None = None) -> Allocation:
    """The best-goodput lengths (l_i <= limits[i]) for survival probabilities c [B, K].
    first_rows: per request, the rows its first draft step runs (1; more when its draft cache must catch up;
    default 1 each). tpot_slos: per request, the seconds per output token it must get: T / A_i, the step's
    time over its own expected tokens, stays under it (every request waits for the whole step, but commits
    only its own tokens); where no allocation meets every objective, the one violating them least."""
    b, k = c.shape
    cols = np.arange(k)
    allowed = cols[None, :] < np.asarray(limits)[:, None]
    req, pos = np.nonzero(allowed)
    value = c[req, pos]
    order = np.lexsort((pos, -value))  # falling survival; a request's positions in order on ties
    req, pos, value = req[order], pos[order], value[order]
    tokens = b + np.concatenate([[0.0], np.cumsum(value)])
    rows = np.minimum(costs.base_rows + np.arange(len(value) + 1), len(costs.verify) - 1)
    step = costs.verify[rows].copy()  # T of each prefix
    if len(value):
        step[1:] += np.cumsum(_draft_increments(req, pos, drafts, k, costs, first_rows))
    seconds = _charged(step, costs)
    score = tokens / seconds
    bound = [i for i, slo in enumerate(tpot_slos or []) if slo]
    if bound:
        # own[i, p]: request i's expected tokens after the first p slots
        mine = (req[None, :] == np.array(bound)[:, None]) * value[None, :]
        own = 1 + np.concatenate([np.zeros((len(bound), 1)), np.cumsum(mine, axis=1)], axis=1)
        slos = np.array([tpot_slos[i] for i in bound])[:, None]
        violation = (step[None, :] / (own * slos)).max(axis=0)  # <= 1: every objective met
        feasible = violation <= 1
        score = np.where(feasible, score, -violation) if feasible.any() else -violation
    best = int(np.argmax(score))  # first maximum: the shortest of equally good prefixes
    lengths = np.zeros(b, dtype=int)
    np.add.at(lengths, req[:best], 1)
    drafting = 0.0
    if best == 0 and len(value) and not bound:  # (what the adaptive policy's quiet steps read)
        added = seconds[1:] - seconds[0]  # <= 0: the slots cost nothing, drafting pays whatever its rate
        rate = np.where(added > 0, (tokens[1:] - tokens[0]) / np.maximum(added, 1e-12), np.inf)
        drafting = float(rate.max() / (tokens[0] / seconds[0]))
    return Allocation(lengths.tolist(), float(tokens[best]), float(seconds[best]), float(tokens[0]), float(seconds[0]),
                      drafting)


def evaluate(c: np.ndarray, lengths: list[int], drafts: list[str | None], costs: StepCosts,
             first_rows: list[int] | None = None) -> Allocation:
    """Expected tokens and predicted time of given lengths (plain decoding's alongside)."""
    b, k = c.shape
    lengths = [min(int(n), k) for n in lengths]
    req = np.repeat(np.arange(b), lengths)
    pos = np.concatenate([np.arange(n) for n in lengths]) if req.size else req
    tokens = b + float(c[req, pos].sum()) if req.size else float(b)
    rows = min(costs.base_rows + int(sum(lengths)), len(costs.verify) - 1)
    step = float(costs.verify[rows])
    if req.size:
        step += float(_draft_increments(req, pos, drafts, k, costs, first_rows).sum())
    return Allocation(lengths, tokens, float(_charged(np.array([step]), costs)[0]), float(b),
                      float(_charged(np.array([_plain_step(costs)]), costs)[0]))


def _plain_step(costs: StepCosts) -> float:
    """T_0: the step without drafts."""
    return float(costs.verify[min(costs.base_rows, len(costs.verify) - 1)])


def _charged(step: np.ndarray, costs: StepCosts) -> np.ndarray:
    """The decodes' charge for steps of T seconds: T_0 − S + w (T − T_0)."""
    t0 = _plain_step(costs)
    return np.maximum(t0 - costs.shared + costs.weight * (step - t0), 1e-9)


def _draft_increments(req, pos, drafts, k, costs, first_rows=None) -> np.ndarray:
    """Extra draft seconds of each slot in order: the slot (i, j) adds its rows to draft step j of request
    i's draft (one row; at j = 0 the request's first_rows, catch-up included), costing t(r + rows) - t(r)
    where r rows were already there (t(0) = 0: a new draft step)."""
    if not len(req):
        return np.zeros(0)
    names = sorted(costs.draft)  # a request no draft has served yet is costed as the first draft's
    draft_of = np.array([names.index(d) if d in costs.draft else (0 if names and d not in FREE else -1)
                         for d in drafts])[req]
    key = np.where(draft_of >= 0, draft_of * k + pos, -1)
    rows = np.ones(len(key), dtype=int)
    if first_rows is not None:
        rows = np.where(pos == 0, np.maximum(np.asarray(first_rows)[req], 1), 1)
    # rows already in that draft step before each slot: the rows of the earlier slots of the same key
    order = np.argsort(key, kind="stable")
    sorted_key, sorted_rows = key[order], rows[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_key)) + 1]
    before = np.cumsum(sorted_rows) - sorted_rows
    before -= np.repeat(before[starts], np.diff(np.r_[starts, len(key)]))
    already = np.empty(len(key), dtype=int)
    already[order] = before
    out = np.zeros(len(key))
    for d, name in enumerate(names):
        sel = draft_of == d
        table = costs.draft[name]
        top = len(table) - 1
        out[sel] = table[np.minimum(already[sel] + rows[sel], top)] - table[np.minimum(already[sel], top)]
    return out
