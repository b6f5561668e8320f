"""The acceptance model: the probability that the target accepts a drafted token, given that the tokens
before it were accepted (docs/design.md §3.3).

The draft's own probability of the token (its confidence) is the prior, as in SpecServe; unlike SpecServe,
it is calibrated online against what the target actually accepted: per draft (prompt lookup is a draft
of its own, with confidence 1) and per draft position, a confidence histogram of accepted and tested
tokens, made monotone by pooling adjacent violators (isotonic regression on the bins). Each bin starts from
a weak prior at its own confidence, so an unseen draft trusts its confidences until the target speaks.

Before a position is drafted there is no confidence yet: the position's measured acceptance stands in.
A request's own history moves its prediction (a request that repeats itself is accepted more than the
average): its accepted / tested ratio with that draft, shrunk towards the draft's global one by PRIOR_TESTS
pseudo-tests (per draft: how a request fares with prompt lookup says little of how it fares with a model).
"""
from __future__ import annotations

from collections import deque

import numpy as np

from specserve.step_types import DraftOutcome

BINS = 10
PRIOR_WEIGHT = 2.0       # pseudo-tests per bin at its own confidence (the prior)
PRIOR_TESTS = 8.0        # pseudo-tests pulling a request's own acceptance towards the global one
DEFAULT_ACCEPTANCE = 0.6  # SpecServe's starting point for a position nobody has measured
WINDOW = 4096            # recent (predicted, outcome) pairs behind the calibration error


def pav(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Pool adjacent violators: the non-decreasing sequence closest to `values` in weighted squares."""
    blocks = []  # [value, weight, count]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks[-1]
            blocks[-1] = [(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2]
    return np.concatenate([np.full(c, v) for v, _, c in blocks])


class Calibration:
    """Accepted / tested counts of one (draft, position) by confidence bin."""

    def __init__(self):
        centers = (np.arange(BINS) + 0.5) / BINS
        self.accepted = centers * PRIOR_WEIGHT
        self.tested = np.full(BINS, PRIOR_WEIGHT)
        self._curve: np.ndarray | None = None

    def add(self, confidence: float, accepted: bool) -> None:
        b = min(int(confidence * BINS), BINS - 1)
        self.tested[b] += 1
        self.accepted[b] += accepted
        self._curve = None

    def __call__(self, confidence) -> np.ndarray:
        if self._curve is None:
            self._curve = pav(self.accepted / self.tested, self.tested)
        b = np.minimum((np.asarray(confidence) * BINS).astype(int), BINS - 1)
        return self._curve[b]


class AcceptanceModel:
    def __init__(self, max_positions: int):
        self.max_positions = max(max_positions, 1)
        self.calibrations: dict[tuple[str, int], Calibration] = {}
        self.position_counts: dict[str, np.ndarray] = {}  # draft -> [2, K] accepted, tested per position
        self.requests: dict[str, dict[str, list[float]]] = {}  # request id -> draft -> [accepted, tested]
        self.recent: deque[tuple[float, bool]] = deque(maxlen=WINDOW)
        self.version = 0  # counts observations: predictions made at one version stay valid until the next

    # ---- predictions -------------------------------------------------------------------------------
    def position_acceptance(self, draft: str | None) -> np.ndarray:
        """[K] measured acceptance of each draft position (before the token is drafted). A request no
        proposer has served yet (draft None) gets every draft's counts pooled, position by position: a
        flat global rate would promise its sixth token as much as its first."""
        if draft is None and self.position_counts:
            counts = sum(self.position_counts.values())
        else:
            counts = self.position_counts.get(draft)
        if counts is None:
            return np.full(self.max_positions, self.global_acceptance(draft))
        return (counts[0] + DEFAULT_ACCEPTANCE * PRIOR_WEIGHT) / (counts[1] + PRIOR_WEIGHT)

    def global_acceptance(self, draft: str | None = None) -> float:
        counts = [c for d, c in self.position_counts.items() if draft is None or d == draft]
        accepted = sum(float(c[0].sum()) for c in counts)
        tested = sum(float(c[1].sum()) for c in counts)
        return (accepted + DEFAULT_ACCEPTANCE * PRIOR_TESTS) / (tested + PRIOR_TESTS)

    def request_factor(self, request_id: str, draft: str | None, base: float | None = None) -> float:
        """The request's own acceptance relative to its draft's (1 for a new request); `base`: the draft's
        global_acceptance, if already known."""
        own = self.requests.get(request_id, {}).get(draft or "")
        if own is None:
            return 1.0
        base = self.global_acceptance(draft) if base is None else base
        return ((own[0] + base * PRIOR_TESTS) / (own[1] + PRIOR_TESTS)) / base

    def predict(self, request_id: str, draft: str | None, confidences=None) -> np.ndarray:
        """[K] a_m for positions 1..K: calibrated where `confidences` (the draft's, for the first
        len(confidences) positions) are known, the positions' measured acceptance after that."""
        a = self.position_acceptance(draft).copy()
        if confidences is not None and len(confidences):
            n = min(len(confidences), self.max_positions)
            a[:n] = [self.calibration(draft, m)(c) for m, c in enumerate(confidences[:n])]
        return np.clip(a * self.request_factor(request_id, draft), 0.0, 0.99)

    def predict_batch(self, requests: list[tuple[str, str | None]]) -> np.ndarray:
        """[B, K] predict() of each (request id, draft) before anything is drafted, each draft's counts read
        once for the batch (a plan asks this for every running request every step)."""
        per_draft = {}
        for draft in {d for _, d in requests}:
            per_draft[draft] = (self.position_acceptance(draft), self.global_acceptance(draft))
        out = np.empty((len(requests), self.max_positions))
        for i, (request_id, draft) in enumerate(requests):
            positions, base = per_draft[draft]
            out[i] = positions * self.request_factor(request_id, draft, base)
        return np.clip(out, 0.0, 0.99)

    def calibration(self, draft: str | None, position: int) -> Calibration:
        key = (draft or "", min(position, self.max_positions - 1))
        if key not in self.calibrations:
            self.calibrations[key] = Calibration()
        return self.calibrations[key]

    # ---- feedback -----------------------------------------------------------------------------------
    def observe(self, outcome: DraftOutcome) -> None:
        """What the target did with one request's draft."""
        if not outcome.num_drafted:
            return
        self.version += 1
        draft = outcome.draft or ""
        if outcome.confidences is None:  # what a plan predicted for these positions, before the outcome
            predicted = self.predict(outcome.request_id, draft)
        counts = self.position_counts.setdefault(draft, np.zeros((2, self.max_positions)))
        tested = outcome.outcomes
        own = self.requests.setdefault(outcome.request_id, {}).setdefault(draft, [0.0, 0.0])
        own[0] += outcome.num_accepted
        own[1] += len(tested)
        for m, accepted in enumerate(tested):
            m_ = min(m, self.max_positions - 1)
            counts[0, m_] += accepted
            counts[1, m_] += 1
            if outcome.confidences is not None:
                calibration = self.calibration(draft, m)
                self.recent.append((float(calibration(outcome.confidences[m])), accepted))
                calibration.add(outcome.confidences[m], accepted)
            else:
                self.recent.append((float(predicted[m_]), accepted))

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    @property
    def calibration_error(self) -> float | None:
        """Expected calibration error of recent predictions (made before each outcome was known, from the
        draft's confidence where the policy asked for confidences, else from the position): the
        |mean predicted - mean observed| of each predicted-probability bin, weighted by its share."""
        if not self.recent:
            return None
        pred = np.array([p for p, _ in self.recent])
        obs = np.array([o for _, o in self.recent], dtype=float)
        bins = np.minimum((pred * BINS).astype(int), BINS - 1)
        error = 0.0
        for b in np.unique(bins):
            sel = bins == b
            error += sel.mean() * abs(pred[sel].mean() - obs[sel].mean())
        return float(error)
