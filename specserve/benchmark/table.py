"""The rich summary printed after a run, and the one-line-per-run table after a sweep."""
from __future__ import annotations


def _ms(stats: dict | None, key: str) -> str:
    v = (stats or {}).get(key)
    return "-" if v is None else f"{v * 1000:.1f}"


def _num(v, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def notes(record: dict) -> list[str]:
    """Caveats a reader of the numbers must know."""
    out = []
    p = record.get("prompts") or {}
    if not p.get("exact_length") and p.get("mean_target_tokens") is not None:
        cpt = p.get("chars_per_token")
        how = "calibrated from the server's usage" if "calibrated" in str(p.get("counting")) else "assumed"
        out.append(f"prompt lengths are approximate: no --tokenizer, {cpt:.2f} chars/token {how}; "
                   f"server-counted mean prompt = {_num(record.get('mean_prompt_tokens'), '{:.0f}')} "
                   f"tokens vs target {p['mean_target_tokens']:.0f}")
    if p.get("num_clipped"):
        out.append(f"{p['num_clipped']} prompts clipped to max_model_len {p.get('max_model_len')}")
    if p.get("num_length_misses"):
        out.append(f"{p['num_length_misses']} prompts missed their exact token length (tokenizer round trip)")
    if record.get("output_tokens_source") == "chunks":
        out.append("server sent no usage: output tokens counted as streamed chunks")
    spec, per_chunk = record.get("spec") or {}, record.get("tokens_per_chunk")
    if per_chunk is not None and per_chunk < 1.05 and (spec.get("mean_acceptance_length") or 0) > 1.2:
        # llama-server streams the tokens of one verify step as separate chunks, microseconds apart
        out.append(f"speculating (mean acceptance length {spec['mean_acceptance_length']:.2f}) but streaming "
                   "one token per chunk: tokens accepted together arrive as separate chunks, so ITL mixes "
                   "near-zero gaps with whole verify steps; TPOT is unaffected")
    if record.get("num_failed"):
        out.append(f"{record['num_failed']} failed requests: {record.get('errors')}")
    delay = (record.get("send_delay_s") or {}).get("p99")
    if delay is not None and delay > 0.05 and not (record.get("arrival") or {}).get("max_concurrency"):
        out.append(f"the client sent requests late (p99 {delay * 1000:.0f} ms after schedule): it could not "
                   "keep up, so the offered load was lower than intended")
    b, little = record.get("mean_in_flight"), record.get("littles_law_in_flight")
    if b and little and abs(b - little) > 0.15 * max(b, little):
        out.append(f"Little's law off by more than 15 % (in flight {b:.2f} vs λ·L {little:.2f}): "
                   "not in steady state (saturated, or too short a run)")
    return out


def print_run(record: dict) -> None:
    from rich.table import Table

    from specserve.console import console

    out = console()
    title = (f"{record['label']} — {record['arrival']['process']}, offered "
             f"{_num(record.get('offered_rate'))} req/s, achieved {_num(record.get('achieved_rate'))} req/s")
    lat = Table(title=title)
    for col in ("metric (ms)", "mean", "median", "p90", "p99"):
        lat.add_column(col, justify="right")
    for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s")):
        lat.add_row(name, *(_ms(record.get(key), s) for s in ("mean", "median", "p90", "p99")))
    out.print(lat)
    facts = Table(show_header=False)
    facts.add_column("", justify="left")
    facts.add_column("", justify="right")
    rows = [
        ("requests (completed / failed)", f"{record['num_completed']} / {record['num_failed']}"),
        ("measured window (s)", _num(record.get("duration_s"))),
        ("request throughput (req/s)", _num(record.get("request_throughput_rps"))),
        ("output throughput (tok/s)", _num(record.get("output_throughput_tps"), "{:.1f}")),
        ("mean prompt / output tokens", f"{_num(record.get('mean_prompt_tokens'), '{:.0f}')} / "
                                        f"{_num(record.get('mean_output_tokens'), '{:.0f}')}"),
        ("in flight: measured / λ·L", f"{_num(record.get('mean_in_flight'))} / "
                                      f"{_num(record.get('littles_law_in_flight'))}"),
        ("in-flight slope (req/s)", _num(record.get("in_flight_slope"), "{:.3f}")),
    ]
    if record.get("slo"):
        rows.append(("SLO " + " ".join(f"{k[:-3]}≤{v:g}ms" for k, v in record["slo"].items()),
                     f"{_num(record.get('slo_attainment'), '{:.1%}')} met, goodput "
                     f"{_num(record.get('goodput_rps'))} req/s"))
    spec = record.get("spec")
    if spec:
        rows.append(("acceptance rate / mean acceptance length",
                     f"{_num(spec.get('acceptance_rate'), '{:.3f}')} / "
                     f"{_num(spec.get('mean_acceptance_length'))} ({spec.get('source')})"))
        if spec.get("per_draft"):
            rows.append(("routed drafts: requests (mean acceptance length)", ", ".join(
                f"{name} {d['requests']} ({_num(d['mean_acceptance_length'])})"
                for name, d in spec["per_draft"].items())))
    if record.get("preemptions") is not None:
        rows.append(("preemptions", str(record["preemptions"])))
    if record.get("prefix_cache_hit_rate") is not None:
        rows.append(("prefix cache hit rate (prompt tokens)", f"{record['prefix_cache_hit_rate']:.1%}"))
    for r in rows:
        facts.add_row(*r)
    out.print(facts)
    if record.get("turns"):
        turns = Table(title="by turn of the conversation")
        for col in ("turn", "requests", "mean prompt tokens", "mean TTFT (ms)", "mean E2E (ms)"):
            turns.add_column(col, justify="right")
        for t in record["turns"]:
            turns.add_row(str(t["turn"]), str(t["requests"]), _num(t["mean_prompt_tokens"], "{:.0f}"),
                          _num(None if t["mean_ttft_s"] is None else 1e3 * t["mean_ttft_s"], "{:.0f}"),
                          _num(None if t["mean_e2e_s"] is None else 1e3 * t["mean_e2e_s"], "{:.0f}"))
        out.print(turns)
    for n in notes(record):
        out.print(f"[yellow]note:[/yellow] {n}")


def print_sweep(records: list[dict]) -> None:
    from rich.table import Table

    from specserve.console import console

    t = Table(title="sweep")
    for col in ("label", "offered", "achieved", "in flight", "λ·L", "slope", "TTFT p50", "TPOT p50",
                "E2E mean", "E2E p99", "SLO met", "accept len"):
        t.add_column(col, justify="right")
    for r in records:
        t.add_row(r["label"], _num(r.get("offered_rate")), _num(r.get("achieved_rate")),
                  _num(r.get("mean_in_flight")), _num(r.get("littles_law_in_flight")),
                  _num(r.get("in_flight_slope"), "{:.3f}"), _ms(r.get("ttft_s"), "median"),
                  _ms(r.get("tpot_s"), "median"), _ms(r.get("e2e_s"), "mean"), _ms(r.get("e2e_s"), "p99"),
                  _num(r.get("slo_attainment"), "{:.0%}"),
                  _num((r.get("spec") or {}).get("mean_acceptance_length")))
    console().print(t)
