"""Structured output under speculation, on the server's default configuration (SmolLM2-135M Q4_1, the shipped
drafts under the adaptive policy, 2 threads), in process so that every step's grammar time is read.

    python bench/structured_output.py --name 2026-11-29      # ~15 min on 2 CPU cores

Prompts: JSONSchemaBench function-call schemas (bench/data/jsonschemabench), each asked for in the chat template
("the arguments of a call of <function> as a JSON object following this schema: ..."), constrained as a
client's response_format json_schema with "strict": true is (objects closed: specserve/structured_output/params.closed).
1. Validity: --schemas schemas x --samples seeds at temperature 0.8, all submitted at once, json_schema
   structured output: every reply must parse and validate against its schema (the jsonschema library);
   with speculation and without (the same law of replies: the counts differ by sampling noise only).
2. Speed, greedy, --repeats interleaved rounds: at batch 1 (one request at a time) and batch 16 (16 at once),
   with and without the schema, speculation on (default) and off: TPOT (per request, after its first token),
   output tokens per second, mean decode step time, mean acceptance length, and the grammar's own time per
   step (draft cuts, masks and their bias: StepStats.t_grammar) against the step time.
Writes bench/results/structured_output/<name>.json and prints the tables; exits 1 if a goal of issue 61 is
missed (all replies valid; grammar time <= 10% of the step at batch 1 and 16; speculation's TPOT under the
grammar below plain decoding's at batch 1, median of the rounds' paired ratios).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from specserve.benchmark.machine import cpu_model, git_commit

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = ROOT / "bench" / "data" / "jsonschemabench" / "glaive40.jsonl"
OUT = ROOT / "bench" / "results" / "structured_output"
MAX_TOKENS = 512  # validity replies: a reply cut here cannot parse, whatever the grammar


def build(speculation: bool):
    """An engine configured as `specserve serve` is by default (with --speculative-config none: plain)."""
    from specserve.engine.args import add_engine_args, engine_config_from_args
    from specserve.engine.llm import LLM
    from specserve.spec_decode.config import DEFAULT_SPECULATIVE
    parser = argparse.ArgumentParser()
    add_engine_args(parser, 512)
    args = parser.parse_args(["--num-threads", "2"])
    args.speculative_config = DEFAULT_SPECULATIVE if speculation else None
    return LLM(config=engine_config_from_args(args))


def prompts(llm, rows) -> list[list[int]]:
    return [llm.tokenizer.encode_chat([{"role": "user", "content":
            f"Give the arguments of a call of the function {r['name']} as a JSON object following this JSON "
            f"schema:\n{json.dumps(r['schema'])}"}]) for r in rows]


def run(llm, ids, params) -> dict:
    """Runs the requests to the end; per-step sums of the engine's statistics and the outputs."""
    engine = llm.engine
    engine.reset_prefix_cache()  # every run prefills its prompts: runs compare alike
    rids = [engine.add_request(p, sp) for p, sp in zip(ids, params)]
    steps, step_s, grammar_s, decode_steps, outs = 0, 0.0, 0.0, 0, {}
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        stats = engine.last_stats
        steps += 1
        if stats.num_decodes and not stats.num_prefill_tokens:  # decode steps: what TPOT is made of
            decode_steps += 1
            step_s += stats.t_total
            grammar_s += stats.t_grammar
    wall = time.perf_counter() - t0
    outs = [outs[r] for r in rids]
    tokens = sum(len(o.token_ids) for o in outs)
    drafts = sum(o.spec["num_drafts"] for o in outs)
    return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall, "tpot_ms": tpot_ms(outs),
            "decode_step_ms": 1e3 * step_s / max(decode_steps, 1), "grammar_ms": 1e3 * grammar_s / max(decode_steps, 1),
            "grammar_share": grammar_s / step_s if step_s else 0.0,
            "acceptance_length": 1 + sum(o.spec["num_accepted_tokens"] for o in outs) / drafts if drafts else 1.0,
            "outputs": outs}


def tpot_ms(outs) -> float:
    """Mean time per output token after the first, over the requests (each request counts once)."""
    per = [(o.metrics["finished_time"] - o.metrics["first_token_time"]) / (len(o.token_ids) - 1)
           for o in outs if len(o.token_ids) > 1]
    return 1e3 * statistics.fmean(per) if per else float("nan")


def validity(llm, rows, samples: int) -> dict:
    import jsonschema
    from specserve import SamplingParams
    from specserve.structured_output.params import StructuredOutputsParams, closed
    ids, params, schemas = [], [], []
    for r, p in zip(rows, prompts(llm, rows)):
        for seed in range(samples):
            ids.append(p)
            schemas.append(r["schema"])
            params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=seed,
                                         structured_outputs=StructuredOutputsParams(json=json.dumps(closed(r["schema"])))))
    result = run(llm, ids, params)
    valid, problems = 0, []
    for out, schema in zip(result.pop("outputs"), schemas):
        try:
            jsonschema.validate(json.loads(out.text), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as e:
            problems.append({"finish_reason": out.finish_reason, "tokens": len(out.token_ids), "error": str(e)[:200],
                             "head": out.text[:200], "tail": out.text[-200:]})
    result.update(replies=len(schemas), valid=valid, problems=problems)
    return result


def speed(engines: dict, rows, repeats: int) -> list[dict]:
    from specserve import SamplingParams
    from specserve.structured_output.params import StructuredOutputsParams, closed
    records = []
    for rnd in range(repeats):
        for batch in (1, 16):
            for guided in (True, False):
                for label in ("speculation", "none"):  # interleaved: each cell once per round
                    llm = engines[label]
                    chosen = rows[:16]
                    params = [SamplingParams(max_tokens=128, temperature=0, structured_outputs=StructuredOutputsParams(
                        json=json.dumps(closed(r["schema"]))) if guided else None) for r in chosen]
                    ids = prompts(llm, chosen)
                    if batch == 1:
                        parts = [run(llm, [i], [p]) for i, p in zip(ids[:8], params[:8])]
                        result = _pool(parts)
                    else:
                        result = run(llm, ids, params)
                        result.pop("outputs")
                    result.update(round=rnd, batch=batch, guided=guided, config=label)
                    records.append(result)
                    print(f"  round {rnd} batch {batch:2d} {'schema' if guided else 'free':6s} {label:11s} "
                          f"TPOT {result['tpot_ms']:5.1f} ms, {result['tokens_per_s']:6.1f} tok/s, "
                          f"step {result['decode_step_ms']:5.1f} ms, grammar {result['grammar_ms']:.2f} ms "
                          f"({100 * result['grammar_share']:.1f}%), acceptance length {result['acceptance_length']:.2f}",
                          flush=True)
    return records


def _pool(parts: list[dict]) -> dict:
    """Sequential batch-1 runs as one: totals summed, per-step means weighted by steps."""
    wall = sum(p["wall_s"] for p in parts)
    tokens = sum(p["output_tokens"] for p in parts)
    outs = [o for p in parts for o in p["outputs"]]
    drafts = sum(o.spec["num_drafts"] for o in outs)
    step_ms = statistics.fmean(p["decode_step_ms"] for p in parts)
    tpot = tpot_ms(outs)
    grammar_ms = statistics.fmean(p["grammar_ms"] for p in parts)
    return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall, "tpot_ms": tpot, "decode_step_ms": step_ms,
            "grammar_ms": grammar_ms, "grammar_share": grammar_ms / step_ms if step_ms else 0.0,
            "acceptance_length": 1 + sum(o.spec["num_accepted_tokens"] for o in outs) / drafts if drafts else 1.0}


def summary(records: list[dict]) -> tuple[list[str], dict]:
    """The table (medians over rounds, min-max) and per cell the medians; per (batch, output) the paired
    per-round ratio of speculation's TPOT to plain decoding's."""
    lines = ["| batch | output | config | TPOT ms (median, min-max) | tok/s | decode step ms | grammar ms (share) "
             "| acceptance length |", "|---|---|---|---|---|---|---|---|"]
    cells = {}
    for batch in (1, 16):
        for guided in (True, False):
            for label in ("speculation", "none"):
                rs = [r for r in records if (r["batch"], r["guided"], r["config"]) == (batch, guided, label)]
                tpot = [r["tpot_ms"] for r in rs]
                med = lambda key: statistics.median(r[key] for r in rs)  # noqa: E731
                cells[(batch, guided, label)] = {k: med(k) for k in ("tpot_ms", "grammar_share", "acceptance_length")}
                lines.append(f"| {batch} | {'json_schema' if guided else 'free'} | {label} | {med('tpot_ms'):.1f} "
                             f"({min(tpot):.1f}-{max(tpot):.1f}) | {med('tokens_per_s'):.1f} | {med('decode_step_ms'):.1f} "
                             f"| {med('grammar_ms'):.2f} ({100 * med('grammar_share'):.1f}%) | {med('acceptance_length'):.2f} |")
            ratios = [a["tpot_ms"] / b["tpot_ms"] for a in records for b in records
                      if (a["batch"], a["guided"], a["config"], b["config"]) == (batch, guided, "speculation", "none")
                      and a["round"] == b["round"] and b["batch"] == batch and b["guided"] == guided]
            cells[(batch, guided, "ratio")] = statistics.median(ratios)
            lines.append(f"| {batch} | {'json_schema' if guided else 'free'} | speculation / none, paired | "
                         f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | | | | |")
    return lines, cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", required=True)
    ap.add_argument("--schemas", type=int, default=20)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = [json.loads(line) for line in SCHEMAS.read_text().splitlines()]
    engines = {"speculation": build(True), "none": build(False)}
    print(f"validity: {args.schemas} schemas x {args.samples} samples, temperature 0.8, max_tokens {MAX_TOKENS}")
    valid = {}
    for label in ("speculation", "none"):  # lossless: the same law of replies either way
        valid[label] = v = validity(engines[label], rows[:args.schemas], args.samples)
        cut = sum(p["finish_reason"] == "length" for p in v["problems"])
        print(f"  {label}: {v['valid']} of {v['replies']} replies parse and validate ({cut} of the others cut by "
              f"max_tokens); acceptance length {v['acceptance_length']:.2f}; grammar "
              f"{100 * v['grammar_share']:.1f}% of the decode steps", flush=True)
    print("speed, greedy, 16 schemas (batch 1: the first 8, one at a time)")
    records = speed(engines, rows, args.repeats)
    lines, cells = summary(records)
    goals = {
        "all replies valid": valid["speculation"]["valid"] == valid["speculation"]["replies"],
        "grammar <= 10% of the step, batch 1": cells[(1, True, "speculation")]["grammar_share"] <= 0.10,
        "grammar <= 10% of the step, batch 16": cells[(16, True, "speculation")]["grammar_share"] <= 0.10,
        "speculation pays under the grammar, batch 1 (TPOT)": cells[(1, True, "ratio")] < 1.0,
    }
    lines += [""] + [f"- {'PASS' if ok else 'MISS'}: {goal}" for goal, ok in goals.items()]
    print("\n".join(lines))
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / f"{args.name}.json"
    out.write_text(json.dumps({"command": " ".join(["python", "bench/structured_output.py", *sys.argv[1:]]),
                               "cpu": cpu_model(), "commit": git_commit(), "validity": valid,
                               "speed": records, "table": lines, "goals": goals}, indent=1, default=str) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    sys.exit(0 if all(goals.values()) else 1)


if __name__ == "__main__":
    main()
