"""The step cost model: how long a target forward over N token rows and a draft step over r rows take on
this machine (docs/design.md §3.2).

Both are linear in their parameters: a piecewise-linear curve in the row count (hat functions on
knots, so the weight of a knot is the time at that many rows: flat while weights are read once for all
rows, rising once arithmetic dominates) plus a term in the KV tokens the step's attention reads. The knots
are every row count up to 8, where drafting decisions are made and the CPU kernels' row tiles make the
curve a staircase (here 3 rows cost what 2 do, 4 rows 1.6 times as much): interpolated between powers of two,
4- and 5-row verify steps came out 15-25% cheaper than measured and the policy drafted where it did not pay
(docs/experiments/engine-kernels-adaptive-2026-11.md); then roughly every factor 1.5 to 64, then powers of two.
A short profile at startup fixes the curve (least squares; cached per model pair, device, dtype and
threads), then an exponentially weighted least-squares refit anchored to the profile follows the machine from
every step's measured phase times. Its running error is exported (`relative_error`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.step_types import ForwardItem
from specserve.cache import cache_dir
from specserve.spec_decode.config import FREE

log = logging.getLogger("specserve.cost")

KNOTS = np.array([1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512, 1024, 2048, 4096], dtype=float)
KV_SCALE = 1e-3  # the KV feature in thousands of tokens, so weights are of similar size
PROFILE_VERSION = 3  # bumped when the profile's shapes or columns change: older cached profiles are not read
REFRESH = 4  # observations between solves of the weights (LinearCost._aged)
MAX_PROFILED_ROWS = 512  # larger steps (long prefill chunks) continue the last profiled slope: compute-bound


def _row_basis(rows) -> np.ndarray:
    r = np.clip(np.atleast_1d(np.asarray(rows, dtype=float)), KNOTS[0], None)
    out = np.zeros((len(r), len(KNOTS) + 1))
    idx = np.clip(np.searchsorted(KNOTS, r, side="right") - 1, 0, len(KNOTS) - 2)
    frac = np.clip((r - KNOTS[idx]) / (KNOTS[idx + 1] - KNOTS[idx]), 0.0, 1.0)
    out[np.arange(len(r)), idx] = 1 - frac
    out[np.arange(len(r)), idx + 1] = frac
    out[:, -1] = np.maximum(r - KNOTS[-1], 0.0) / KNOTS[-1]
    return out


# Every whole row count a step can have, computed once: the policies ask for these curves every step, and
# small numpy operations cost more in dispatch than in arithmetic, so a lookup beats rebuilding them.
_TABLE = _row_basis(np.arange(int(KNOTS[-1]) + 1))


def row_basis(rows) -> np.ndarray:
    """[n, len(KNOTS) + 1]: hat functions of the row count on KNOTS, plus a ramp past the last knot."""
    r = np.atleast_1d(np.asarray(rows))
    if r.dtype.kind in "iu" and r.size and 0 <= r.min() and r.max() < len(_TABLE):
        return _TABLE[r]
    return _row_basis(r)


def features(rows, kv_tokens) -> np.ndarray:
    """[n, d] features of n forwards: the row basis and the KV tokens attention reads."""
    basis = row_basis(rows)
    kv = np.broadcast_to(np.asarray(kv_tokens, dtype=float), (len(basis),))[:, None] * KV_SCALE
    return np.hstack([basis, kv])


class LinearCost:
    """y = f · w, fitted by least squares on a profile, then refitted after every observation by
    exponentially weighted least squares anchored to that profile:

        w = argmin  Σ_t λ^(age t) (f_t · w − y_t)²  +  (w − s·w0)ᵀ R (w − s·w0)

    R is the profile's information (its FᵀF; `prior` ⁻¹ I without a profile), w0 its weights, s the
    machine's speed relative to the profile (the geometric mean ratio of measured to profiled time over
    the same recent steps). Recent steps decide the weights along the directions they excite; the
    profile keeps the shape of the rest, at the speed the machine runs now. Without s, a profile taken
    while the machine was slow keeps the knots no step exercises at their slow times: a policy that
    believes drafting too dear never drafts, so it never learns otherwise (a batch-1 server whose 1-row
    steps ran at 23 ms against a 40 ms profile drafted nothing). (Recursive least squares with forgetting
    computes the same thing through a covariance that grows without bound along directions no step
    excites, and diverged after a few thousand steps of a steady load: docs/experiments/engine-kernels-adaptive-2026-11.md.)
    A d x d solve (d = 15) when the weights are read after new evidence, not per observation."""

    def __init__(self, weights: np.ndarray, forgetting: float = 0.995, prior: float = 1.0,
                 information: np.ndarray | None = None, prior_steps: float = 5.0):
        self.w0 = np.asarray(weights, dtype=float)
        self._w: np.ndarray | None = self.w0.copy()  # solved when read: unused drafts age without a solve
        self._unsolved = REFRESH - 1  # observations since the last solve (re-solved every REFRESH; the first at once)
        d = len(self.w0)
        self.R = np.eye(d) / prior if information is None else information
        self.forgetting = forgetting
        self.A = np.zeros((d, d))  # Σ λ^age f fᵀ of the observed steps
        self.b = np.zeros(d)       # Σ λ^age f y
        self._log_speed = self._steps = 0.0  # Σ λ^age log(y / f·w0), Σ λ^age: s, their weighted mean
        self.prior_steps = prior_steps       # pseudo-steps at the profile's speed: one outlier is not a speed

    @classmethod
    def fit(cls, f: np.ndarray, y: np.ndarray, ridge: float = 1e-6) -> "LinearCost":
        a = f.T @ f + ridge * np.eye(f.shape[1])
        return cls(np.linalg.solve(a, f.T @ y), information=a)

    def predict(self, f: np.ndarray) -> np.ndarray:
        return f @ self.w

    def by_rows(self, rows: np.ndarray, kv_tokens) -> np.ndarray:
        """predict(features(rows, kv_tokens)) for whole row counts: the rows' hat functions read from the
        precomputed basis table, two numpy operations (the policies ask for a curve over every row count a
        step may carry, each step, after the weights changed; building the features took most of a plan)."""
        rows, w = np.atleast_1d(np.asarray(rows)), self.w
        if rows.size and (rows.dtype.kind not in "iu" or rows.min() < 0 or rows.max() >= len(_TABLE)):
            return self.predict(features(rows, kv_tokens))
        return _TABLE[rows] @ w[:-1] + np.asarray(kv_tokens, dtype=float) * (KV_SCALE * w[-1])

    def update(self, f: np.ndarray, y: float) -> None:
        """Learn from one observation (f [d], y)."""
        self.A = self.forgetting * self.A + np.outer(f, f)
        self.b = self.forgetting * self.b + f * y
        profiled = float(f @ self.w0)
        if profiled > 0 and y > 0:
            self._log_speed = self.forgetting * self._log_speed + np.log(y / profiled)
            self._steps = self.forgetting * self._steps + 1.0
        self._aged()

    def decay(self) -> None:
        """A step that did not run this forward: its evidence ages all the same, so that an outlier (a
        slow first call) cannot keep a forward looking dear for ever once the policy stops running it."""
        self.A *= self.forgetting
        self.b *= self.forgetting
        self._log_speed *= self.forgetting
        self._steps *= self.forgetting
        self._aged()

    def _aged(self) -> None:
        """New evidence: solve again once REFRESH observations have come in. A solve every step cost more
        than the plan it fed (a cold 21 x 21 solve after each forward), and a few steps change little in
        weights that remember ~200."""
        self._unsolved += 1
        if self._unsolved >= REFRESH:
            self._w, self._unsolved = None, 0

    @property
    def w(self) -> np.ndarray:
        if self._w is None:
            self._w = np.linalg.solve(self.A + self.R, self.b + self.R @ (self.speed * self.w0))
        return self._w

    @property
    def speed(self) -> float:
        """Measured over profiled time of the recent steps, their geometric mean: every step counts the
        same, so that a few long prefill steps do not outvote the many decode steps whose neighbours the
        policies ask about (1 before any step; kept within 0.1-10x)."""
        return float(np.clip(np.exp(self._log_speed / (self._steps + self.prior_steps)), 0.1, 10.0))


@dataclass
class StepCostModel:
    verify: LinearCost                  # one target forward: rows (all tokens of the step), KV tokens read
    drafts: dict[str, LinearCost]       # one draft forward of each draft model, by draft name
    relative_error: float = 0.0         # running mean |predicted - measured| / measured of step time
    observed: int = 0
    _ewma: float = field(default=0.05, repr=False)

    def verify_time(self, rows, kv_tokens) -> np.ndarray:
        return self.verify.by_rows(rows, kv_tokens)

    def verify_curve(self, rows: np.ndarray, kv_tokens) -> np.ndarray:
        """verify_time over increasing `rows`, made non-decreasing: a step never gets cheaper with more rows,
        and a policy must not be able to exploit a fit that says otherwise."""
        return np.maximum.accumulate(self.verify_time(rows, kv_tokens))

    def draft_time(self, draft: str | None, rows, kv_tokens) -> np.ndarray:
        """Seconds of one draft forward over `rows` rows (0 for prompt lookup and suffix decoding: no model)."""
        cost = self.drafts.get(draft) if draft is not None else None
        if cost is None:
            cost = next(iter(self.drafts.values()), None) if draft not in FREE else None
        rows = np.atleast_1d(np.asarray(rows))
        if cost is None:
            return np.zeros(len(rows))
        return np.where(rows > 0, cost.by_rows(rows, kv_tokens), 0.0)

    def observe(self, verify_rows: int, verify_kv: int, forward_s: float,
                draft_forwards: list[tuple[str, int, int]], draft_s: float) -> float:
        """One step's measured phases: the target forward, and the draft forwards [(draft, rows, kv)].
        Returns what the model predicted for them before learning from this step."""
        f = features(verify_rows, verify_kv)[0]
        predicted = float(f @ self.verify.w)
        self.verify.update(f, forward_s)
        by_draft: dict[str, np.ndarray] = {}
        for draft, rows, kv in draft_forwards:
            if draft in self.drafts:
                by_draft[draft] = by_draft.get(draft, 0) + features(rows, kv)[0]
        for draft, fd in by_draft.items():
            predicted += float(fd @ self.drafts[draft].w)
        learned = None
        if len(by_draft) == 1:  # the draft phase is timed as a whole: attributable to one draft only
            (learned, fd), = by_draft.items()
            self.drafts[learned].update(fd, draft_s)
        for name, cost in self.drafts.items():
            if name != learned:
                cost.decay()
        measured = forward_s + (draft_s if by_draft else 0.0)
        if measured > 0:
            error = abs(predicted - measured) / measured
            self.relative_error = error if not self.observed else (
                (1 - self._ewma) * self.relative_error + self._ewma * error)
            self.observed += 1
        return predicted

    # ---- startup profile -------------------------------------------------------------------------
    @classmethod
    def profile(cls, target_runner, draft_runners: dict, max_rows: int, key: str) -> "StepCostModel":
        """Time a grid of forwards (cached on disk under `key`) and fit both curves."""
        key = f"{key}|profile v{PROFILE_VERSION}"
        path = cache_dir() / "cost_profiles" / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")
        if path.exists():
            data = json.loads(path.read_text())
        else:
            log.info("profiling the step cost of this machine (once: the result is cached)")
            t0 = time.perf_counter()
            data = {"verify": _time_grid(target_runner, max_rows),
                    "drafts": {name: _time_grid(runner, 64) for name, runner in draft_runners.items()}}
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(data))
            log.info("step cost profile: %.1f s (cached in %s)", time.perf_counter() - t0, path)
        return cls(_fit(data["verify"]), {name: _fit(rows) for name, rows in data["drafts"].items()})


def _fit(samples: list[list[float]]) -> LinearCost:
    """Least squares on (rows, kv, seconds) samples; knots past the largest profiled row count continue the
    last profiled slope (a step never carries more rows than profiled, but interpolation may touch them)."""
    data = np.array(samples)
    cost = LinearCost.fit(features(data[:, 0], data[:, 1]), data[:, 2])
    last = int(np.searchsorted(KNOTS, data[:, 0].max(), side="right")) - 1
    if last >= 1:
        slope = (cost.w[last] - cost.w[last - 1]) / (KNOTS[last] - KNOTS[last - 1])
        for k in range(last + 1, len(KNOTS)):
            cost.w[k] = cost.w[last] + slope * (KNOTS[k] - KNOTS[last])
        cost.w[len(KNOTS)] = slope * KNOTS[-1]
    return cost


def _time_grid(runner, max_rows: int, context: int = 128, long_context: int = 1024) -> list[list[float]]:
    """[(rows, kv tokens, seconds)] for decode/verify-shaped forwards at every knot up to max_rows, and a few
    at a long context for the KV term. Uses cache blocks from 0 up: run before any request exists."""
    block = runner.block_size
    num_blocks = runner.num_blocks
    max_rows = min(max_rows, MAX_PROFILED_ROWS)
    shapes = [(n, context) for n in KNOTS if n <= max_rows]
    shapes += [(max_rows, context)] if max_rows not in KNOTS else []
    shapes += [(n, long_context) for n in (1, 32) if n <= max_rows]
    rows = []
    for n, ctx in shapes:
        n = int(n)
        seqs = min(n, 32)
        q = -(-n // seqs)
        ctx = min(ctx, runner.config.max_position_embeddings - q)
        per = -(-(ctx + q) // block)
        seqs = min(seqs, num_blocks // per)
        if seqs < 1:
            continue
        items = [ForwardItem([1] * q, ctx + q, list(range(i * per, (i + 1) * per)), 1) for i in range(seqs)]
        features_in = None
        if runner.model.fc is not None:  # an EAGLE draft reads a target feature per token
            features_in = torch.zeros(seqs * q, runner.config.hidden_size, dtype=runner.dtype, device=runner.device)
        def timed() -> float:
            t0 = time.perf_counter()
            runner.forward(items, features_in)
            if runner.device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t0
        # A short forward is repeated and the fastest kept (a neighbour's burst only ever slows a run, and a
        # new shape's first run pays one-time costs); a long one is timed once: those costs are then small,
        # and repeating the largest shapes would be most of the startup time.
        times = [timed()]
        while len(times) < 3 and sum(times) < 0.3:
            times.append(timed())
        rows.append([seqs * q, seqs * (ctx + q), min(times[1:] or times)])
    return rows
