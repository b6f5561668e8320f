"""When requests arrive: production traces replayed from their timestamps, or synthetic Poisson/Gamma arrivals.

Every arrival schedule is an array of offsets in seconds from the start of the run, sorted ascending, so the
runner does not care where it came from. Traces also carry each request's token counts.
"""
from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from decimal import Decimal, InvalidOperation
from pathlib import Path

import numpy as np

from specserve.errors import SpecServeError

# The data shipped inside the package (specserve/data), found beside this file so that it works from an
# editable checkout, a wheel, or a namespace-package import alike.
DATA_DIR = Path(__file__).resolve().parent.parent / "data"
# Short names for the traces shipped in specserve/data, so the default command works in a fresh clone.
SHIPPED_TRACES = {"azure-conv": "AzureLLMInferenceTrace_conv.csv"}

TRACE_FORMATS = ("auto", "azure", "mooncake", "timestamps")

# Column names seen in public traces, lower-cased. Azure 2023/2024, BurstGPT and Mooncake-as-CSV variants.
_TIME_COLUMNS = ("timestamp", "time", "arrival_time")
_INPUT_COLUMNS = ("contexttokens", "request tokens", "input_length", "input_tokens", "prompt_tokens")
_OUTPUT_COLUMNS = ("generatedtokens", "response tokens", "output_length", "output_tokens", "completion_tokens")

_DATETIME = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?\s*(Z|[+-]\d{2}:?\d{2})?$")


@dataclass
class Trace:
    """Arrival offsets (s, first request at 0) and, when the trace has them, token counts per request."""
    times_s: np.ndarray
    input_tokens: np.ndarray | None = None
    output_tokens: np.ndarray | None = None
    hash_ids: list[list[int]] | None = None   # Mooncake prefix-sharing blocks, kept for prompt building
    source: str = ""
    format: str = ""
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.times_s)

    @property
    def mean_rate(self) -> float:
        """Requests per second over the trace's span, (n − 1)/span: n arrivals bound n − 1 gaps."""
        span = float(self.times_s[-1] - self.times_s[0]) if len(self) > 1 else 0.0
        return (len(self) - 1) / span if span > 0 else float("inf")


def parse_timestamp_ns(text: str) -> int:
    """Integer nanoseconds of a trace timestamp: since the Unix epoch for dates, else the number itself.

    Azure 2023 writes 7 fractional digits (`2023-11-16 18:17:03.9799600`); a float of epoch seconds
    (~1.7e9) resolves only ~0.2 µs and `datetime` only 1 µs, so we keep integers and subtract the
    trace's start before converting to seconds. Naive times are taken as UTC: only differences matter,
    and UTC has no daylight-saving jumps. Numbers (seconds) are parsed as decimals for the same reason.
    """
    text = text.strip()
    try:
        return int(Decimal(text) * 1_000_000_000)
    except (InvalidOperation, ValueError, OverflowError):   # not a number (or NaN/inf): try a date
        pass
    m = _DATETIME.match(text)
    if not m:
        raise SpecServeError(f"unrecognised trace timestamp {text!r}")
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    frac, tz = m.group(7) or "", m.group(8)
    offset = timedelta(0)
    if tz and tz != "Z":
        sign = 1 if tz[0] == "+" else -1
        digits = tz[1:].replace(":", "")
        offset = sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
    whole = datetime(year, month, day, hour, minute, second, tzinfo=timezone.utc) - offset
    return int(whole.timestamp()) * 1_000_000_000 + int((frac + "000000000")[:9])


def _find_column(header: list[str], names: tuple[str, ...]) -> int | None:
    lowered = [h.strip().lower() for h in header]
    for name in names:
        if name in lowered:
            return lowered.index(name)
    return None


def _read_csv(path: Path) -> Trace:
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r and any(c.strip() for c in r)]
    if not rows:
        raise SpecServeError(f"trace {path} is empty")
    header = rows[0]
    t_col = _find_column(header, _TIME_COLUMNS)
    if t_col is None:
        # A one-column timestamp file may have no header: the first row is then itself a timestamp.
        try:
            parse_timestamp_ns(header[0])
            t_col, body, header = 0, rows, []
        except SpecServeError:
            if len(header) != 1:
                raise SpecServeError(f"trace {path}: no timestamp column in header {header}") from None
            t_col, body = 0, rows[1:]
    else:
        body = rows[1:]
    if not body:
        raise SpecServeError(f"trace {path} has a header but no rows")
    in_col = _find_column(header, _INPUT_COLUMNS) if header else None
    out_col = _find_column(header, _OUTPUT_COLUMNS) if header else None
    stamps_ns, ins, outs = [], [], []
    first_line = len(rows) - len(body) + 1
    for n, r in enumerate(body, first_line):
        try:
            stamps_ns.append(parse_timestamp_ns(r[t_col]))
            if in_col is not None and out_col is not None:
                ins.append(int(float(r[in_col])))
                outs.append(int(float(r[out_col])))
        except (IndexError, ValueError, SpecServeError) as e:
            raise SpecServeError(f"{path}:{n}: bad trace row {r} ({e})") from None
    ns = np.array(stamps_ns, dtype=np.int64)
    # Seconds from the earliest request, computed in integers first (see parse_timestamp_ns).
    stamps = (ns - ns.min()).astype(np.float64) / 1e9
    ins = np.array(ins) if ins else None
    outs = np.array(outs) if outs else None
    fmt = "azure" if in_col is not None and out_col is not None else "timestamps"
    return Trace(stamps, ins, outs, source=str(path), format=fmt,
                 meta={"epoch_start_s": int(ns.min()) / 1e9})


def _read_mooncake(path: Path, lengths: bool = True) -> Trace:
    """Mooncake JSONL rows; with `lengths` false only the timestamps are read (and needed)."""
    stamps, ins, outs, hashes = [], [], [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                stamps.append(float(row["timestamp"]) / 1000.0)   # Mooncake timestamps are milliseconds
                if lengths:
                    ins.append(int(row["input_length"]))
                    outs.append(int(row["output_length"]))
                    hashes.append([int(h) for h in row.get("hash_ids", [])])
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise SpecServeError(f"{path}:{n}: not a Mooncake trace row ({e!r})") from None
    if not stamps:
        raise SpecServeError(f"trace {path} is empty")
    if not lengths:
        return Trace(np.array(stamps), source=str(path), format="timestamps")
    return Trace(np.array(stamps), np.array(ins), np.array(outs),
                 hash_ids=hashes if any(hashes) else None, source=str(path), format="mooncake")


def detect_format(path: Path) -> str:
    """"mooncake" for JSON lines (by suffix, else by a first non-blank character of "{"), else "csv"."""
    if path.suffix in (".jsonl", ".json"):
        return "mooncake"
    with open(path, errors="replace") as f:
        head = f.read(4096).lstrip()
    return "mooncake" if head.startswith("{") else "csv"


def resolve_trace_path(name: str) -> Path:
    if name in SHIPPED_TRACES:
        return DATA_DIR / SHIPPED_TRACES[name]
    path = Path(name).expanduser()
    if not path.is_file():
        raise SpecServeError(f"trace {name!r} not found (shipped traces: {', '.join(SHIPPED_TRACES)})")
    return path


def load_trace(name: str, fmt: str = "auto") -> Trace:
    """Read a trace, sort it by time and shift it so the first request arrives at 0 s."""
    path = resolve_trace_path(name)
    if fmt not in TRACE_FORMATS:
        raise SpecServeError(f"unknown trace format {fmt!r} (one of {', '.join(TRACE_FORMATS)})")
    kind = detect_format(path) if fmt in ("auto", "timestamps") else fmt
    if kind == "mooncake":
        # "timestamps" takes the arrival times of any format: of a Mooncake file, without its lengths
        # and prefix blocks, so that prompts are the data set's own (natural lengths).
        trace = _read_mooncake(path, lengths=fmt != "timestamps")
    else:
        trace = _read_csv(path)
    if fmt == "azure" and trace.input_tokens is None:
        raise SpecServeError(f"trace {path}: no ContextTokens/GeneratedTokens columns for --trace-format azure")
    if fmt == "timestamps":   # asked for arrivals only: drop any lengths and prefix blocks
        trace.input_tokens = trace.output_tokens = None
        trace.hash_ids = None
        trace.format = "timestamps"
    order = np.argsort(trace.times_s, kind="stable")
    trace.times_s = trace.times_s[order] - trace.times_s[order[0]]
    if trace.input_tokens is not None:
        trace.input_tokens = trace.input_tokens[order]
    if trace.output_tokens is not None:
        trace.output_tokens = trace.output_tokens[order]
    if trace.hash_ids is not None:
        trace.hash_ids = [trace.hash_ids[i] for i in order]
    return trace


def window(trace: Trace, start_s: float = 0.0, duration_s: float | None = None,
           time_scale: float = 1.0, max_requests: int | None = None) -> Trace:
    """The part of a trace to replay.

    `start_s` and `duration_s` select a window in the trace's own clock; arrivals are then shifted so
    the window starts at 0 and multiplied by `time_scale` (0.5 replays twice as fast, 2 half as fast).
    `max_requests` keeps the first requests of the window.
    """
    if not 0 < time_scale < float("inf"):
        raise SpecServeError("--time-scale must be a positive finite number")
    t = trace.times_s
    keep = t >= start_s
    if duration_s is not None:
        keep &= t < start_s + duration_s
    idx = np.flatnonzero(keep)
    if max_requests is not None:
        idx = idx[:max_requests]
    if len(idx) == 0:
        raise SpecServeError(f"no trace requests in the window start={start_s}s duration={duration_s}s")
    pick = (lambda a: a[idx] if a is not None else None)
    out = Trace((t[idx] - start_s) * time_scale, pick(trace.input_tokens), pick(trace.output_tokens),
                [trace.hash_ids[i] for i in idx] if trace.hash_ids is not None else None,
                trace.source, trace.format, dict(trace.meta))
    out.meta.update(start_s=start_s, duration_s=duration_s, time_scale=time_scale)
    return out


def synthetic_arrivals(rate: float, rng: np.random.Generator, n: int | None = None,
                       duration_s: float | None = None, cv: float = 1.0) -> np.ndarray:
    """Arrival offsets of a renewal process with mean rate `rate` and inter-arrival CV `cv`.

    CV 1 is Poisson (exponential gaps); other CVs use Gamma gaps with shape 1/CV² and mean 1/rate, so
    CV > 1 is burstier than Poisson and CV < 1 more regular. (vLLM's `--burstiness` is the Gamma shape
    itself, i.e. 1/CV².) An infinite rate sends everything at 0. The first request arrives at 0.
    """
    if n is None and duration_s is None:
        raise SpecServeError("synthetic arrivals need a request count or a duration")
    if rate <= 0 or cv <= 0:
        raise SpecServeError("request rate and burstiness must be positive")
    if np.isinf(rate):
        if n is None:
            raise SpecServeError("an infinite request rate needs --max-requests")
        return np.zeros(n)
    shape = 1.0 / cv ** 2

    def gaps(m: int) -> np.ndarray:
        if cv == 1.0:
            return rng.exponential(1.0 / rate, m)
        return rng.gamma(shape, 1.0 / (rate * shape), m)

    if n is not None:
        times = np.concatenate([[0.0], np.cumsum(gaps(n - 1))]) if n > 0 else np.zeros(0)
        return times[times < duration_s] if duration_s is not None else times
    # Duration only: draw in chunks until past the end; each chunk covers ~1.2× the expected remainder,
    # so this loop runs a handful of times at most.
    times = [np.zeros(1)]
    last = 0.0
    while last < duration_s:
        need = max(16, int(1.2 * rate * (duration_s - last)) + 16)
        chunk = last + np.cumsum(gaps(need))
        times.append(chunk)
        last = float(chunk[-1])
    all_times = np.concatenate(times)
    return all_times[all_times < duration_s]
