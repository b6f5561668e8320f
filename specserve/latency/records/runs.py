"""Read `specserve bench` run records (docs/bench-results-schema.md) into validated `BenchRun`s."""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from specserve.errors import SpecServeError
from specserve.latency.equations.acceptance import acceptance_length_from_spec, check_k, expected_tokens
from specserve.latency.equations.arrival_regularity import EQUAL, Lifetimes, run_cv

RUN_SCHEMA = "specserve.bench.run/1"


@dataclass(frozen=True, slots=True)
class Stats:
    """Summary of one latency metric over a run's requests (seconds); quantiles and std may be missing."""

    mean: float
    p95: float | None
    p99: float | None
    std: float | None = None  # spread over the run's requests

    @classmethod
    def parse(cls, obj: object, where: str) -> "Stats":
        if not isinstance(obj, Mapping) or not _positive(obj.get("mean")):
            raise SpecServeError(f"{where}: needs an object with a positive 'mean'")
        q = {key: float(obj[key]) if _positive(obj.get(key)) else None for key in ("p95", "p99")}
        std = obj.get("std")
        std = float(std) if _positive(std) or (std == 0 and not isinstance(std, bool)) else None
        return cls(float(obj["mean"]), q["p95"], q["p99"], std)

    def quantile(self, name: str) -> float | None:
        return {"p95": self.p95, "p99": self.p99}[name]


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@dataclass(frozen=True, slots=True)
class BenchRun:
    """One server configuration measured at one arrival rate."""

    label: str
    k: int
    acceptance_length: float  # E, tokens committed per cycle (1 without SD)
    offered_rate: float | None
    achieved_rate: float
    arrival_rate: float | None  # realised arrivals per second (specserve bench writes it), if known
    arrival_process: str | None  # "poisson", "gamma", "trace", "closed", "burst", ...
    arrival_cv: float | None  # CV of the arrival gaps: the measured requests' own (`arrival_gap_cv`) where the
    # record has it, else its process's (Poisson 1, Gamma its burstiness)
    duration_s: float
    num_requests: int
    num_completed: int
    num_failed: int
    prompt_tokens: float
    output_tokens: float
    e2e: Stats
    ttft: Stats
    tpot: Stats
    mean_in_flight: float | None
    in_flight_slope: float | None
    preemptions: int | None
    accepted_per_position: tuple[int, ...] | None  # drafts accepted at each draft position, summed
    num_drafts: int
    source: str  # "file:line", so exclusions and errors point at the record
    requests_path: str | None
    run_key: str | None  # value of the per-request rows' "run" field that belongs to this run, if known
    lifetimes: Lifetimes = EQUAL  # the requests' relative lifetimes, from their output lengths where the
    # per-request rows give them (fit_runs); equal lifetimes otherwise

    def __post_init__(self) -> None:
        check_k(self.k)
        if not (1.0 <= self.acceptance_length <= self.k + 1 + 1e-9):
            raise SpecServeError(f"{self.source}: mean acceptance length {self.acceptance_length:g} "
                                 f"is outside [1, k+1] for k={self.k}")

    @property
    def results_file(self) -> str:
        return self.source.rsplit(":", 1)[0]

    @property
    def cv(self) -> float:
        """The arrival CV the load terms use: the stated one, else Poisson's 1 (docs/design.md §2.1 assumes it)."""
        return 1.0 if self.arrival_cv is None else self.arrival_cv

    @property
    def in_flight(self) -> float:
        """B̂ = λ·L (Little's law with the achieved rate), the load measure of docs/design.md §2.1."""
        return self.achieved_rate * self.e2e.mean


def _number(record: Mapping, key: str, where: str, default: float | None = None) -> float:
    value = record.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise SpecServeError(f"{where}: '{key}' must be a finite number >= 0, got {value!r}")
    return float(value)


def _optional(record: Mapping, key: str) -> float | None:
    value = record.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def parse_run(record: Mapping, where: str, base_dir: Path, k_override: int | None = None,
              alpha_override: float | None = None) -> BenchRun:
    if record.get("schema") != RUN_SCHEMA:
        raise SpecServeError(f"{where}: not a bench run record (schema {record.get('schema')!r}, "
                             f"expected {RUN_SCHEMA!r})")
    label = str(record.get("label") or "")
    if not label:
        raise SpecServeError(f"{where}: run has no 'label'")
    config = record.get("server_config") or {}
    k = k_override if k_override is not None else record.get("k")
    if k is None and isinstance(config, Mapping):
        k = config.get("k", config.get("num_speculative_tokens"))
    if k is None:
        raise SpecServeError(f"{where}: speculation length of '{label}' unknown; pass --k {label}=K")
    if isinstance(k, float) and k.is_integer():  # JSON writers may emit 4.0
        k = int(k)
    check_k(k)
    if k == 0:
        accept = 1.0
    elif alpha_override is not None:
        accept = expected_tokens(alpha_override, k)
    else:
        accept = acceptance_length_from_spec(record.get("spec"), k)
        if accept is None:
            raise SpecServeError(f"{where}: '{label}' (k={k}) has no speculation stats; "
                                 f"pass --alpha {label}=A")
    achieved = _number(record, "achieved_rate", where)
    if achieved <= 0:
        raise SpecServeError(f"{where}: achieved_rate must be > 0")
    spec = record.get("spec") if isinstance(record.get("spec"), Mapping) else {}
    per_position = spec.get("accepted_per_position")
    offered = record.get("offered_rate")
    requests_file = record.get("requests_file")
    preemptions = record.get("preemptions")
    run_key = record.get("run_id", record.get("run"))
    arrival = record.get("arrival") if isinstance(record.get("arrival"), Mapping) else {}
    try:
        cv = run_cv(arrival.get("process"), arrival.get("burstiness"), record.get("arrival_gap_cv"))
    except SpecServeError as e:
        raise SpecServeError(f"{where}: {e}") from None
    return BenchRun(
        label=label, k=k, acceptance_length=accept,
        offered_rate=None if offered is None else _number(record, "offered_rate", where),
        achieved_rate=achieved, arrival_rate=_optional(record, "arrival_rate"),
        arrival_process=arrival.get("process"),
        arrival_cv=cv,
        duration_s=_number(record, "duration_s", where, 0.0),
        num_requests=int(_number(record, "num_requests", where, 0)),
        num_completed=int(_number(record, "num_completed", where, 0)),
        num_failed=int(_number(record, "num_failed", where, 0)),
        prompt_tokens=_number(record, "mean_prompt_tokens", where),
        output_tokens=_number(record, "mean_output_tokens", where),
        e2e=Stats.parse(record.get("e2e_s"), f"{where}: e2e_s"),
        ttft=Stats.parse(record.get("ttft_s"), f"{where}: ttft_s"),
        tpot=Stats.parse(record.get("tpot_s"), f"{where}: tpot_s"),
        mean_in_flight=_optional(record, "mean_in_flight"),
        in_flight_slope=_optional(record, "in_flight_slope"),
        preemptions=None if preemptions is None else int(preemptions),
        accepted_per_position=tuple(int(a) for a in per_position) if isinstance(per_position, list) else None,
        num_drafts=int(spec.get("num_drafts") or 0),
        source=where,
        requests_path=str(base_dir / requests_file) if requests_file else None,
        run_key=None if run_key is None else str(run_key),
    )


def load_runs(paths: Iterable[str | Path], k_overrides: Mapping[str, int] | None = None,
              alpha_overrides: Mapping[str, float] | None = None,
              unusable: list[dict] | None = None) -> list[BenchRun]:
    """All run records in the given JSONL files; other line types (unknown schemas) are errors, because a
    silently skipped line would silently change the fit. Runs that completed no request (a sweep pushed
    far past saturation) carry no latency; they go to `unusable` with the reason when it is given."""
    k_overrides, alpha_overrides = dict(k_overrides or {}), dict(alpha_overrides or {})
    paths = [Path(p) for p in paths]
    runs: list[BenchRun] = []
    for path in paths:
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise SpecServeError(f"cannot read results file {path}: {e.strerror}") from None
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                # model.json is indented JSON, so its first line is "{": say what the file is instead.
                hint = ("; it is a latency model, not bench results" if '"specserve.latency.model/'
                        in "".join(lines[:3]) else "")
                raise SpecServeError(f"{where}: not JSON ({e.msg}){hint}") from None
            label = record.get("label") if isinstance(record, dict) else None
            if unusable is not None and isinstance(record, dict) and record.get("num_completed") == 0:
                unusable.append({"label": label, "k": record.get("k"), "offered_rate": record.get("offered_rate"),
                                 "achieved_rate": record.get("achieved_rate"), "e2e_mean_s": None,
                                 "source": where, "reasons": ["no request completed"]})
                continue
            runs.append(parse_run(record if isinstance(record, dict) else {}, where, path.parent,
                                  k_overrides.get(label), alpha_overrides.get(label)))
    if not runs:
        raise SpecServeError("no bench runs found in " + ", ".join(map(str, paths)))
    ks: dict[str, int] = {}
    for run in runs:
        if ks.setdefault(run.label, run.k) != run.k:
            raise SpecServeError(f"label '{run.label}' is used for k={ks[run.label]} and k={run.k}; "
                                 "give each configuration its own label")
    return runs
