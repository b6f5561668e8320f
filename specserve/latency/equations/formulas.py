"""docs/design.md §2.1–2.3 as pure functions: L = C1/(1 − λ·C2), the six SD coefficients, speedup, break-even,
best k.

Conventions: rates in requests/s, times in seconds. A rate at or beyond saturation (λ·C2 ≥ 1) has no steady
state: latency is `inf` there, never a negative or wrapped-around number.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

from specserve.errors import SpecServeError
from specserve.latency.equations.acceptance import check_k, expected_tokens, expected_tokens_positional


def check_rate(rate: float) -> float:
    r = float(rate)
    if not (r >= 0.0 and math.isfinite(r)):
        raise SpecServeError(f"request rate must be a finite number >= 0, got {rate!r}")
    return r


def _check_coefficient(name: str, value: float, positive: bool = False) -> float:
    v = float(value)
    if not math.isfinite(v) or v < 0.0 or (positive and v == 0.0):
        need = "> 0" if positive else ">= 0"
        raise SpecServeError(f"coefficient {name} must be finite and {need}, got {value!r}")
    return v


def dense_latency(rate: float, c1: float, c2: float) -> float:
    """L(λ) = C1 / (1 − λ·C2); inf at or beyond the saturation rate 1/C2."""
    return Demands(c1, c2).latency(rate)


@dataclass(frozen=True, slots=True)
class Demands:
    """Load-independent demand C1 (s, a lone request's latency) and load-dependent C2 (s per co-resident)."""

    c1: float
    c2: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "c1", _check_coefficient("C1", self.c1, positive=True))
        object.__setattr__(self, "c2", _check_coefficient("C2", self.c2))

    @property
    def saturation_rate(self) -> float:
        return math.inf if self.c2 == 0.0 else 1.0 / self.c2

    def latency(self, rate: float) -> float:
        load = check_rate(rate) * self.c2
        return math.inf if load >= 1.0 else self.c1 / (1.0 - load)

    def max_rate_within(self, target: float) -> float:
        """Largest λ with L(λ) ≤ target: (1 − C1/target)/C2; 0 when even a lone request misses it."""
        t = float(target)
        if not (t > 0.0):
            raise SpecServeError(f"latency target must be > 0 s, got {target!r}")
        if self.c1 > t:
            return 0.0
        return math.inf if self.c2 == 0.0 else (1.0 - self.c1 / t) / self.c2


@dataclass(frozen=True, slots=True)
class SpecCoefficients:
    """The six per-deployment coefficients of docs/design.md §2.2 (seconds; *p prefill, *v verify, *d per drafted
    token)."""

    c1p: float
    c1v: float
    c1d: float
    c2p: float
    c2v: float
    c2d: float

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _check_coefficient(f.name, getattr(self, f.name)))

    def demands(self, output_tokens: float, expected: float, k: int) -> Demands:
        """C1 = c1p + (g/E)(c1v + k·c1d),  C2 = c2p + (g/E)(c2v + k·c2d)."""
        check_k(k)
        g, e = float(output_tokens), float(expected)
        if not (g > 0.0 and math.isfinite(g)):
            raise SpecServeError(f"output tokens g must be > 0, got {output_tokens!r}")
        if not (1.0 <= e <= k + 1.0 + 1e-9):
            raise SpecServeError(f"tokens per cycle E={e!r} must lie in [1, k+1] for k={k}")
        cycles = g / e
        return Demands(self.c1p + cycles * (self.c1v + k * self.c1d),
                       self.c2p + cycles * (self.c2v + k * self.c2d))

    def dense(self, output_tokens: float) -> Demands:
        """k = 0 (E = 1): the plain-decoding baseline."""
        return self.demands(output_tokens, 1.0, 0)


def expected_for(alpha: float | Sequence[float], k: int) -> float:
    """E for draft length k from an i.i.d. α or from per-position α_1..α_K (uses the first k)."""
    if isinstance(alpha, (int, float)):
        return expected_tokens(alpha, k)
    alphas = list(alpha)
    if k > len(alphas):
        raise SpecServeError(f"k={k} needs acceptance for {k} positions, only {len(alphas)} given")
    return expected_tokens_positional(alphas[:k])


def speedup(rate: float, dense: Demands, sd: Demands) -> float:
    """L_dense(λ)/L_SD(λ): inf where only plain decoding saturates, 0 where only SD does."""
    l_dense, l_sd = dense.latency(rate), sd.latency(rate)
    if math.isinf(l_dense) and math.isinf(l_sd):
        raise SpecServeError(f"rate {rate} req/s saturates both plain decoding and SD: speedup is undefined")
    return math.inf if math.isinf(l_dense) else l_dense / l_sd


def speedup_from_ratios(c1r: float, c2r: float, dense_load: float) -> float:
    """docs/design.md §2.3: speedup = (1/C1R)·[1 + (1 − C2R)·r/(1 − r)], r = λ·C2_dense in [0, 1)."""
    r = float(dense_load)
    if not (0.0 <= r < 1.0):
        raise SpecServeError(f"dense load r = λ·C2_dense must be in [0, 1), got {dense_load!r}")
    if not (c1r > 0.0 and c2r >= 0.0):
        raise SpecServeError(f"need C1R > 0 and C2R >= 0, got {c1r!r}, {c2r!r}")
    value = (1.0 / c1r) * (1.0 + (1.0 - c2r) * r / (1.0 - r))
    return max(value, 0.0)  # negative means SD is past its own saturation: no throughput, speedup 0


@dataclass(frozen=True, slots=True)
class BreakEven:
    """Where SD and plain decoding give equal latency; `regime` says which side SD wins on."""

    regime: str  # "sd-wins-below", "sd-wins-above", "sd-always-wins", "sd-never-wins", "identical"
    dense_load: float | None  # r* = (C1R − 1)/(C1R − C2R), when a crossing exists
    rate: float | None  # λ* = r*/C2_dense


def break_even(dense: Demands, sd: Demands) -> BreakEven:
    """Crossing of L_SD and L_dense (docs/design.md §2.3): r* = (C1R − 1)/(C1R − C2R), λ* = r*/C2_dense.

    Written with differences rather than ratios so that a contention-free baseline (C2_dense = 0) still
    has a well-defined crossing rate. C1 decides the winner at zero load, C2 near saturation.
    """
    d1, d2 = sd.c1 - dense.c1, sd.c2 - dense.c2
    if d1 == 0.0 and d2 == 0.0:
        return BreakEven("identical", None, None)
    if d1 == 0.0 or d2 == 0.0 or (d1 < 0.0) == (d2 < 0.0):
        return BreakEven("sd-always-wins" if d1 <= 0.0 and d2 <= 0.0 else "sd-never-wins", None, None)
    rate = d1 / (sd.c1 * dense.c2 - dense.c1 * sd.c2)
    return BreakEven("sd-wins-below" if d1 < 0.0 else "sd-wins-above", rate * dense.c2, rate)


def _demands_by_k(coefs: SpecCoefficients, output_tokens: float, alpha: float | Sequence[float],
                  ks: Iterable[int]) -> dict[int, Demands]:
    out = {k: coefs.demands(output_tokens, 1.0 if k == 0 else expected_for(alpha, k), k) for k in sorted(set(ks))}
    if not out:
        raise SpecServeError("no candidate k given")
    return out


def best_k_at_rate(coefs: SpecCoefficients, rate: float, output_tokens: float,
                   alpha: float | Sequence[float], ks: Iterable[int]) -> tuple[int, float]:
    """argmin_k C1(k)/(1 − λ·C2(k)) over ks (docs/design.md §2.3); ties go to the shorter draft (less waste)."""
    latency = {k: d.latency(rate) for k, d in _demands_by_k(coefs, output_tokens, alpha, ks).items()}
    best = min(latency, key=lambda k: (latency[k], k))
    if math.isinf(latency[best]):
        raise SpecServeError(f"rate {rate} req/s is beyond saturation for every candidate k")
    return best, latency[best]


def best_k_under_target(coefs: SpecCoefficients, target: float, output_tokens: float,
                        alpha: float | Sequence[float], ks: Iterable[int]) -> tuple[int, float]:
    """The k that sustains the highest rate with mean latency ≤ target, and that rate."""
    rate = {k: d.max_rate_within(target) for k, d in _demands_by_k(coefs, output_tokens, alpha, ks).items()}
    best = max(rate, key=lambda k: (rate[k], -k))
    if rate[best] == 0.0:
        raise SpecServeError(f"no candidate k meets a {target * 1e3:.0f} ms target even for a lone request")
    return best, rate[best]
