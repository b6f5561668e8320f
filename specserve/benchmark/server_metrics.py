"""Counters scraped from the server's Prometheus `/metrics` before and after a run (when it has one).

Preemptions and speculative-decoding totals are server-side facts the client cannot see; vLLM and
specserve name them alike (§5), with a `vllm:` or `specserve:` prefix.
"""
from __future__ import annotations

import re

import httpx

from specserve.benchmark.client import server_root

PREFIXES = ("specserve:", "vllm:")
COUNTERS = {
    "preemptions": "num_preemptions_total",
    "spec_drafts": "spec_decode_num_drafts_total",
    "spec_draft_tokens": "spec_decode_num_draft_tokens_total",
    "spec_accepted_tokens": "spec_decode_num_accepted_tokens_total",
}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Our counters from Prometheus text format, summed over label sets (e.g. one series per model)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, value = m.group(1), m.group(3)
        for prefix in PREFIXES:
            if not name.startswith(prefix):
                continue
            for key, suffix in COUNTERS.items():
                if name[len(prefix):] == suffix:
                    try:
                        totals[key] = totals.get(key, 0.0) + float(value)
                    except ValueError:
                        pass
    return totals


async def scrape(http: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """The counters now, or None when the server has no /metrics (llama.cpp without --metrics, APIs)."""
    try:
        resp = await http.get(server_root(base_url) + "/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return parse_prometheus(resp.text)


def delta(before: dict | None, after: dict | None) -> dict[str, float] | None:
    """How much each counter grew during the run; None when either scrape failed."""
    if before is None or after is None:
        return None
    return {k: after[k] - before.get(k, 0.0) for k in after}
