"""Load-adaptive speculation against fixed choices: every speculation policy on one engine, under the shipped
Azure conversation trace's arrivals (each run's window of it stretched to the level's mean rate) at load
levels from 20 % to 90 % of plain decoding's saturation rate, on code (python-stdlib prefixes, the code
draft), chat (Spec-Bench, the chat draft), or `mix`: both streams at once in one engine, each with its own
window of the trace at half the level's rate, the server's default speculation (lookup first, the draft
that fits each prompt), mean E2E per stream and overall; or `code-edit`: multi-turn code-editing sessions
(benchmark/code_edit.py, 3 turns, the trace's arrivals start them, each later turn follows its reply). `none`
is plain decoding on an engine without speculation (no draft loaded): the floor the default must not go
below (`off` keeps the drafts loaded).

    python bench/adaptive.py --workloads mix --policies none,off,static2,static4,adaptive \
        --levels 0.2,0.5,0.8,1.1 --requests 12 --repeats 2   # the mixed bursty evaluation, ~20 min here

    python bench/adaptive.py                       # ~60 min on 2 CPU cores: off, static 2 and 4, adaptive
    python bench/adaptive.py --policies all --temperatures 0,0.7 --levels 0.1,0.25,0.4,0.55,0.7,0.9 \
        --requests 12                              # the issue's full grid: several hours there
    python bench/adaptive.py --slo-tpot-ms 60 --levels 0.2,0.5,0.9   # ~35 min: + TPOT-objective attainment
    python bench/adaptive.py --analyze bench/results/adaptive/<run>      # tables, goals and plots again

Per workload (and temperature): one engine (SmolLM2-135M, the workload's draft, prompt lookup first, the
server default's draft-length ceiling of 4) whose policy is switched between runs, so every policy meets the
same weights, cache and threads; `adaptive_q8` runs on a second such engine whose drafts are quantized to
q8_0 at load. Plain decoding's saturation rate is measured first (a burst of requests). Then rounds:
each round runs every (policy, level) once in a shuffled order, so a machine whose speed drifts spreads
the drift over all of them; --repeats rounds. A run replays --requests arrivals of the Azure trace, its
clock scaled to the level's rate, in real time, and measures each request's E2E, TTFT and TPOT on the
engine's clock. Greedy outputs are identical under every policy (lossless), so greedy runs differ in
timing only. Results: runs.jsonl (one line per run), summary.md (tables, goals), PNG plots.
"""
from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from specserve.benchmark.machine import git_commit

OUT = Path(__file__).parent / "results" / "adaptive"
LATENCY_MODEL = Path(__file__).parent / "results" / "latency21" / "model.json"  # the int8 engine, 1 thread
CEILING = 4  # the server default's (spec_decode/config.py DEFAULT_SPECULATIVE)
# label -> (policy, draft-length ceiling, policy options)
POLICIES = {
    "none": (None, 0, None),  # an engine without speculation
    "off": ("off", CEILING, None),
    **{f"static{k}": ("static", k, None) for k in (1, 2, 3, 4, 6)},
    "batch_table": ("batch_table", CEILING, None),
    "threshold": ("threshold", CEILING, None),
    "goodput": ("goodput", CEILING, None),
    "adaptive": ("adaptive", CEILING, None),
    "planned": ("planned", CEILING, {"model": str(LATENCY_MODEL)}),
    "adaptive_q8": ("adaptive", CEILING, None),  # on an engine whose drafts are quantized to q8_0 at load
}
DRAFT_Q8 = "_q8"  # a label ending so runs on the engine with q8_0 drafts
STATIC = ["none", "off", "static1", "static2", "static3", "static4", "static6"]
WORKLOADS = {  # dataset, draft, prompt tokens, output tokens (at most: EOS ends a request earlier)
    "code": ("python-stdlib", "code", 256, 64),
    "chat": ("spec-bench", "chat", None, 96),
    "mix": (None, "default", None, None),  # code and chat streams at once
    "code-edit": ("code-edit", "default", None, 256),  # sessions of EDIT_TURNS turns (benchmark/code_edit.py)
}
EDIT_TURNS = 3  # a code-edit session's turns: each sent when the previous reply has ended
STREAMS = ("code", "chat")
LEVELS = [0.2, 0.35, 0.5, 0.65, 0.8, 0.9]
# What fits the hour on a 2-core CPU (~60 min): the full grid (every policy, T = 0.7 too) is a flag away
# and takes several hours there.
DEFAULT_POLICIES = ["off", "static2", "static4", "adaptive"]


def build_engine(workload: str, threads: int, plain: bool = False, draft_quantization: str | None = None):
    """The workload's speculating engine, or with `plain` one that has no speculation at all."""
    from specserve import LLM
    dataset, draft, _, _ = WORKLOADS[workload]
    spec = None if plain else {"model": draft, "num_speculative_tokens": CEILING, "ngram_first": True,
                               "quantization": draft_quantization}
    llm = LLM(model="smollm2-135m", num_threads=threads, max_num_seqs=64, max_num_batched_tokens=512,
              speculative_config=spec)
    llm.engine.profile_costs()  # before any request: the adaptive and goodput policies read it
    return llm


def use_policy(engines: dict, label: str):
    """The engine that runs `label` (`none`: the plain one), its policy switched to it."""
    from specserve.spec_decode.policies import make_policy
    if label == "none":
        return engines["none"]
    from specserve.spec_decode.acceptance_model import AcceptanceModel
    llm = engines[engine_key(label)]
    engine = llm.engine
    name, k, options = POLICIES[label]
    # Each policy keeps what it learned of acceptance as a server running it would, and learns it from its
    # own runs only: static k=4's outcomes must not tell the adaptive policy what to expect. The step cost
    # model is the machine's and is shared.
    learned = engines.setdefault("acceptance", {})
    engine.models.acceptance = learned.setdefault(label, AcceptanceModel(engine.models.acceptance.max_positions))
    engine.policy = engine.executor.policy = make_policy(name, k, options, engine.models)
    engine.scheduler.max_drafts = k
    return llm


def engine_key(label: str) -> str:
    return "none" if label == "none" else "spec_q8" if label.endswith(DRAFT_Q8) else "spec"


def build_engines(workload: str, threads: int, labels) -> dict:
    """The engines the policies `labels` run on; `none` (plain decoding) always: it measures saturation."""
    keys = {engine_key(label) for label in labels} | {"none"}
    return {key: build_engine(workload, threads, plain=key == "none",
                              draft_quantization="q8_0" if key == "spec_q8" else None) for key in sorted(keys)}


def prompts_and_arrivals(llm, workload: str, rate: float | None, n: int, seed: int):
    """n prompts, their arrival times and streams: the Azure trace's times, scaled to `rate` (None: all at
    once). Code: stdlib prefixes of exactly the prompt length; chat: Spec-Bench questions in the chat
    template; mix: n // 2 of each, each stream from its own window of the trace at rate / 2, merged."""
    if workload == "mix":
        half = [_stream(llm, w, rate and rate / 2, n // 2, seed, offset) for offset, w in enumerate(STREAMS)]
        merged = sorted(((t, text, w) for (texts, times, streams) in half for text, t, w in zip(texts, times, streams)),
                        key=lambda m: m[0])
        return [m[1] for m in merged], np.array([m[0] for m in merged]), [m[2] for m in merged]
    return _stream(llm, workload, rate, n, seed)


def _stream(llm, workload: str, rate: float | None, n: int, seed: int, offset: int = 0):
    from specserve.benchmark.code_edit import build_sessions
    from specserve.benchmark.prompts import HFTokenizer, load_dataset
    from specserve.benchmark.workload import WorkloadSpec, make_workload
    dataset, _, input_len, output_len = WORKLOADS[workload]
    times = _arrivals(rate, n, seed, offset)
    if workload == "code-edit":  # sessions: the arrivals start them (replay sends the later turns)
        return build_sessions(n, EDIT_TURNS, seed), times, [workload] * n
    if input_len is None:
        questions = load_dataset(dataset)
        picks = np.random.default_rng(seed).integers(0, len(questions), n)
        return [llm.tokenizer.encode_chat([{"role": "user", "content": questions[i]}]) for i in picks], times, \
            [workload] * n
    spec = WorkloadSpec(dataset=dataset, max_requests=n, request_rate=float("inf"), input_len=input_len,
                        output_len=output_len, seed=seed)
    w = make_workload(spec, tokenizer=HFTokenizer(llm.tokenizer.hf), max_model_len=llm.engine.max_model_len)
    return [p.text for p in w.prompts], times, [workload] * n


def _arrivals(rate: float | None, n: int, seed: int, offset: int) -> np.ndarray:
    """n arrival times from the Azure conversation trace, stretched to `rate` (None: all at once)."""
    from specserve.benchmark import arrival_schedules as arr
    trace = arr.load_trace("azure-conv")
    # another stretch of the trace in each repeat, and another (half the trace on) for a second stream
    span = float(trace.times_s[-1] - trace.times_s[0])
    start = float(trace.times_s[0]) + (60.0 * (seed % 50) + span / 2 * offset) % (span - 300.0)
    times = arr.window(trace, start, max_requests=n).times_s
    if rate is None:
        times = np.zeros(n)
    else:  # the window's own gaps (its burstiness), stretched so that it arrives at `rate` on average: a
        # short window of a bursty trace can otherwise run at a fraction or a multiple of the level's rate
        times = times - times[0]
        times = times * ((n - 1) / rate) / times[-1] if times[-1] > 0 else np.arange(n) / rate
    return times


def replay(llm, texts, times, params, streams, on_step=None) -> dict:
    """Submit each prompt at its arrival time (real time) and step the engine; latencies, overall and per
    stream (`mean_e2e_code`, ... when the run mixes streams). on_step(stats, outputs): called after every
    step with the engine's StepStats and the step's outputs (bench/adaptive_steps.py sums them). A text that
    is a list of messages is a session: its first turn arrives at its time, each later one (the history and
    the model's reply in the chat template) as soon as the previous turn has ended; every turn is a request."""
    engine = llm.engine
    # Every run replays prompts that earlier runs (other policies, other levels) sent too: it starts with an
    # empty prefix cache, so that only its own requests share prefixes (the chat template's system prompt).
    engine.reset_prefix_cache()
    is_session = [isinstance(t, list) and isinstance(t[0], str) for t in texts]  # else a text or token ids
    sessions = {str(j): [{"role": "user", "content": t[0]}] for j, t in enumerate(texts) if is_session[j]}
    start, i, done = time.monotonic(), 0, {}
    n = sum(len(t) if session else 1 for t, session in zip(texts, is_session))  # requests: every turn
    lengths, steps, predicted, measured, busy = [], 0, [], [], 0.0
    prefill_s = prefill_tokens = 0.0  # prefill-only steps: the same work under every policy, so a speed gauge
    while len(done) < n:
        now = time.monotonic() - start
        while i < len(texts) and times[i] <= now:
            prompt = llm.tokenizer.encode_chat(sessions[str(i)]) if str(i) in sessions else texts[i]
            engine.add_request(prompt, params[i], request_id=str(i), arrival_time=start + times[i])
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(times[i] - now, 0.05)))
            continue
        t0 = time.perf_counter()
        outs = engine.step()
        busy += time.perf_counter() - t0
        for out in outs:
            if out.finished:
                done[out.request_id] = out
                session, _, turn = out.request_id.partition(".")
                history = sessions.get(session)
                if history is not None and (t := int(turn or 0) + 1) < len(texts[int(session)]):
                    history += [{"role": "assistant", "content": out.text},
                                {"role": "user", "content": texts[int(session)][t]}]
                    engine.add_request(llm.tokenizer.encode_chat(history), params[int(session)],
                                       request_id=f"{session}.{t}", arrival_time=time.monotonic())
        s = engine.last_stats
        if on_step is not None:
            on_step(s, outs)
        if s.num_prefill_tokens and not s.num_decodes:
            prefill_s, prefill_tokens = prefill_s + s.t_forward, prefill_tokens + s.num_prefill_tokens
        if s.num_decodes:
            steps += 1
            lengths.append(sum(s.draft_lengths) / s.num_decodes)
            if s.t_predicted is not None:
                predicted.append(s.t_predicted)
                measured.append(s.t_draft + s.t_forward)
    e2e, ttft, tpot, tokens, by_stream = [], [], [], 0, {}
    for rid, out in done.items():
        m = out.metrics
        e2e.append(m["finished_time"] - m["arrival_time"])
        by_stream.setdefault(streams[int(rid.partition(".")[0])], []).append(e2e[-1])
        ttft.append(m["first_token_time"] - m["arrival_time"])
        if out.num_output_tokens > 1:
            tpot.append((m["finished_time"] - m["first_token_time"]) / (out.num_output_tokens - 1))
        tokens += out.num_output_tokens
    slo = [p.slo_tpot for p in params if p.slo_tpot]
    per_stream = {f"mean_e2e_{w}": float(np.mean(v)) for w, v in by_stream.items()} if len(by_stream) > 1 else {}
    return {"n": n, "mean_e2e": float(np.mean(e2e)), **per_stream, "p99_e2e": float(np.percentile(e2e, 99)),
            "mean_ttft": float(np.mean(ttft)), "mean_tpot": float(np.mean(tpot)) if tpot else None,
            "tpot_attainment": float(np.mean([t <= slo[0] for t in tpot])) if slo and tpot else None,
            "output_tokens": tokens, "wall_s": time.monotonic() - start, "busy_s": busy, "steps": steps,
            "mean_draft_length": float(np.mean(lengths)) if lengths else 0.0,
            "prefill_ms_per_token": 1e3 * prefill_s / prefill_tokens if prefill_tokens else None,
            "step_time_error": float(np.mean(np.abs(np.array(predicted) - measured) / np.array(measured)))
            if predicted else None}


def sampling(streams: list[str], temperature: float, seed: int, slo_tpot_ms: float | None) -> list:
    from specserve import SamplingParams
    return [SamplingParams(max_tokens=WORKLOADS[w][3], temperature=temperature, seed=seed * 1000 + i,
                           slo_tpot=slo_tpot_ms / 1000 if slo_tpot_ms else None) for i, w in enumerate(streams)]


def saturation(engines: dict, workload: str, n: int) -> float:
    """Plain decoding's throughput in requests/s with n requests sent at once."""
    llm = use_policy(engines, "none")
    texts, times, streams = prompts_and_arrivals(llm, workload, None, n, seed=999)
    r = replay(llm, texts, times, sampling(streams, 0.0, 999, None), streams)
    return n / r["wall_s"]


def run(args) -> Path:
    out = Path(args.out or OUT / datetime.datetime.now().strftime("%Y-%m-%d-%H%M"))
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "runs.jsonl").open("a")
    this = {"command": "python bench/adaptive.py " + " ".join(sys.argv[1:]),
            "started": datetime.datetime.now().isoformat(timespec="seconds"), "commit": git_commit("?")}
    meta = this
    if args.first_repeat and (out / "meta.json").exists():  # more rounds of an earlier run: its command stays
        meta = json.loads((out / "meta.json").read_text())
        meta.setdefault("more", []).append(this)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    earlier = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()] if args.first_repeat else []
    for workload in args.workloads.split(","):
        policies = list(POLICIES) if args.policies == "all" else args.policies.split(",")
        engines = build_engines(workload, args.threads, policies)
        # more rounds run at the rates of the earlier ones: the saturation they measured
        measured = [r["saturation"] for r in earlier if r["workload"] == workload]
        sat = measured[0] if measured else args.saturation or saturation(engines, workload, args.saturation_requests)
        print(f"{workload}: plain decoding saturates at {sat:.3f} req/s", flush=True)
        for temperature in map(float, args.temperatures.split(",")):
            cells = [(p, lv) for p in policies for lv in map(float, args.levels.split(","))]
            for repeat in range(args.first_repeat, args.first_repeat + args.repeats):
                random.Random(f"{workload}{temperature}{repeat}").shuffle(cells)
                for policy, level in cells:
                    llm = use_policy(engines, policy)
                    texts, times, streams = prompts_and_arrivals(llm, workload, level * sat, args.requests, seed=repeat)
                    r = replay(llm, texts, times, sampling(streams, temperature, repeat, args.slo_tpot_ms), streams)
                    row = dict(workload=workload, temperature=temperature, policy=policy, level=level,
                               rate=level * sat, saturation=sat, repeat=repeat, slo_tpot_ms=args.slo_tpot_ms, **r)
                    log.write(json.dumps(row) + "\n")
                    log.flush()
                    print(f"{workload} T={temperature} r{repeat} {policy:11} {level:.2f}: E2E {r['mean_e2e']:.2f} s, "
                          f"draft {r['mean_draft_length']:.2f}", flush=True)
        del engines, llm
    analyze(out)
    return out


# ---- analysis -------------------------------------------------------------------------------------------

def analyze(out: Path) -> None:
    rows = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    meta = json.loads((out / "meta.json").read_text()) if (out / "meta.json").exists() else {}
    lines = [f"# Adaptive speculation vs fixed policies\n\n`{meta.get('command', 'python bench/adaptive.py')}` → "
             f"`runs.jsonl` ({meta.get('started', '?')}, commit {meta.get('commit', '?')}); medians over repeats "
             "(min–max in brackets), mean E2E in seconds.\n"]
    for more in meta.get("more", []):
        lines[-1] += f"\nMore rounds: `{more['command']}` ({more['started']}, commit {more['commit']}).\n"
    if len({r["repeat"] for r in rows}) > len({r["repeat"] for r in every_policy(rows)}):
        lines[-1] += ("\nTables and plots: the rounds every policy ran; paired ratios: every round the pair ran.\n")
    for workload in sorted({r["workload"] for r in rows}):
        for temperature in sorted({r["temperature"] for r in rows if r["workload"] == workload}):
            mine = [r for r in rows if r["workload"] == workload and r["temperature"] == temperature]
            for key in ["mean_e2e"] + [f"mean_e2e_{w}" for w in STREAMS if f"mean_e2e_{w}" in mine[0]]:
                part = "" if key == "mean_e2e" else f", {key[9:]} stream"
                lines += table(mine, f"{workload}{part}, temperature {temperature}", key)
            plot(every_policy(mine), out / f"{workload}_t{temperature}.png", f"{workload}, T = {temperature}")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def cell(rows, policy, level, key="mean_e2e"):
    values = [r[key] for r in rows if r["policy"] == policy and r["level"] == level and r[key] is not None]
    return (statistics.median(values), min(values), max(values)) if values else None


def every_policy(rows) -> list:
    """The rounds every policy ran (--first-repeat appends rounds of fewer policies): the absolute tables
    and plots compare policies on the same rounds; the paired ratios use every round a pair ran."""
    rounds = set.intersection(*({r["repeat"] for r in rows if r["policy"] == p} for p in {r["policy"] for r in rows}))
    return [r for r in rows if r["repeat"] in rounds]


def table(rows, title, key="mean_e2e") -> list[str]:
    policies = [p for p in POLICIES if any(r["policy"] == p for r in rows)]
    levels = sorted({r["level"] for r in rows})
    rates = {lv: statistics.median(r["rate"] for r in rows if r["level"] == lv) for lv in levels}
    out = [f"## {title}\n", "| policy | " + " | ".join(f"{lv:.0%} ({rates[lv]:.2f}/s)" for lv in levels) + " |",
           "|---|" + "---|" * len(levels)]
    full = every_policy(rows)
    for p in policies:
        cells = [cell(full, p, lv, key) for lv in levels]
        out.append(f"| {p} | " + " | ".join("–" if c is None else f"{c[0]:.2f} [{c[1]:.2f}–{c[2]:.2f}]"
                                            for c in cells) + " |")
    for p in (p for p in ("adaptive", "adaptive_q8") if p in policies):
        out.append(f"| {p}: mean draft length | " + " | ".join(
            f"{(cell(full, p, lv, 'mean_draft_length') or (float('nan'),))[0]:.2f}" for lv in levels) + " |")
    out += ["", *goals(rows, levels, key), "", *attainment(rows, policies, levels)]
    return out


def attainment(rows, policies, levels) -> list[str]:
    """With --slo-tpot-ms: the share of requests whose TPOT met it, pooled over repeats, and goal 4."""
    slo_rows = [r for r in rows if r.get("tpot_attainment") is not None]
    if not slo_rows:
        return []

    def share(p, lv):  # runs carry the same number of requests, so the mean of shares is the pooled share
        values = [r["tpot_attainment"] for r in slo_rows if r["policy"] == p and r["level"] == lv]
        return float(np.mean(values)) if values else None

    slo = sorted({r["slo_tpot_ms"] for r in slo_rows if r.get("slo_tpot_ms")})
    out = [f"TPOT objective {', '.join(f'{s:g}' for s in slo)} ms: share of requests that met it "
           "(pooled over repeats)", "",
           "| policy | " + " | ".join(f"{lv:.0%}" for lv in levels) + " |", "|---|" + "---|" * len(levels)]
    for p in policies:
        shares = ("–" if (v := share(p, lv)) is None else f"{v:.0%}" for lv in levels)
        out.append(f"| {p} | " + " | ".join(shares) + " |")
    reached = [lv for lv in levels if any((share(p, lv) or 0) >= 0.99 for p in policies)]
    if "adaptive" in policies:
        misses = [lv for lv in reached if (share("adaptive", lv) or 0) < 0.99]
        verdict = "not testable" if not reached else "missed at " + ", ".join(f"{lv:.0%}" for lv in misses) \
            if misses else "met"
        out += ["", "4. where some policy meets the objective for ≥ 99 % of requests ("
                + (", ".join(f"{lv:.0%}" for lv in reached) or "nowhere") + f"), adaptive does too: {verdict}", ""]
    return out


def paired(rows, policy, other, level, key="mean_e2e", speed=False) -> list[float]:
    """policy's mean E2E over other's, per repeat: the two ran the same arrivals and prompts in the same round,
    so the ratio cancels what differs between rounds (prompts, most of the machine's drift). With `speed`,
    each ratio is also divided by the ratio of the two runs' prefill time per token (prefill-only steps:
    the same work whatever the policy): what the machine's speed between the two runs, minutes apart,
    still explains (to first order: latency scales with the time of the work)."""
    def of(p):
        return {r["repeat"]: r for r in rows if r["policy"] == p and r["level"] == level}
    mine, theirs = of(policy), of(other)
    out = []
    for k in sorted(mine.keys() & theirs.keys()):
        if mine[k].get(key) is None or theirs[k].get(key) is None:  # (rounds recorded before the key existed)
            continue
        ratio = mine[k][key] / theirs[k][key]
        if speed:
            gauges = mine[k].get("prefill_ms_per_token"), theirs[k].get("prefill_ms_per_token")
            if not all(gauges):
                continue
            ratio /= gauges[0] / gauges[1]
        out.append(ratio)
    return out


def goals(rows, levels, key="mean_e2e") -> list[str]:
    """The goals of the adaptive issues for this workload. The best static choice is picked by median E2E;
    adaptive is compared with it by the median of the paired (same-round) ratios, min-max in brackets."""
    full = every_policy(rows)  # the best static choice is picked on the rounds every policy ran
    have = [p for p in STATIC if all(cell(full, p, lv, key) for lv in levels)]
    if "adaptive" not in {r["policy"] for r in rows} or not have:
        return []

    def ratio(policy, other, level):  # median paired ratio and its spread
        values = paired(rows, policy, other, level, key)
        return statistics.median(values), min(values), max(values)

    def fmt(r):
        return f"{r[0]:.3f} [{r[1]:.2f}–{r[2]:.2f}]"

    best_each = [min(have, key=lambda p: cell(full, p, lv, key)[0]) for lv in levels]
    each = [ratio("adaptive", p, lv) for p, lv in zip(best_each, levels)]
    single = min(have, key=lambda p: np.mean(np.log([cell(full, p, lv, key)[0] for lv in levels])))
    geo = float(np.exp(-np.mean(np.log([ratio("adaptive", single, lv)[0] for lv in levels]))))
    out = ["Paired ratios (adaptive's mean E2E over the other policy's in the same round), median [min–max] over rounds:",
           "", "1. adaptive / best static at each level (" + ", ".join(best_each) + "): "
           + ", ".join(fmt(r) for r in each) + f" (goal ≤ 1.03: {'met' if all(r[0] <= 1.03 for r in each) else 'missed'})",
           f"2. best single static choice over the sweep: {single}; it / adaptive, geometric mean over levels: "
           f"{geo:.3f} (goal ≥ 1.15: {'met' if geo >= 1.15 else 'missed'})"]
    if "none" in have:  # issue 59: plain decoding is a floor; a single fixed choice cannot win everywhere
        floor = [ratio("adaptive", "none", lv) for lv in levels]
        over_single = [ratio("adaptive", single, lv) for lv in levels]
        out.append("do no harm: adaptive / none (no speculation) per level: " + ", ".join(fmt(r) for r in floor)
                   + f" (goal ≤ 1.03 everywhere: {'met' if all(r[0] <= 1.03 for r in floor) else 'missed'})")
        adjusted = [paired(rows, "adaptive", "none", lv, key, speed=True) for lv in levels]
        if all(adjusted):
            out.append("  the same, each round's ratio divided by the two runs' ratio of prefill time per token (the "
                       "machine's speed then): " + ", ".join(
                           fmt((statistics.median(v), min(v), max(v))) for v in adjusted))
        if "off" in have:
            out.append("off (drafts loaded, nothing drafted) / none per level: " + ", ".join(
                fmt(ratio("off", "none", lv)) for lv in levels))
        present = {r["policy"] for r in rows}
        busy = {p: [paired(rows, p, "none", lv, "busy_s") for lv in levels] for p in ("adaptive", "off") if p in present}
        if key == "mean_e2e" and busy and all(all(values) for values in busy.values()):
            # the engine's time inside step(): the work itself, without the queueing that mean E2E amplifies
            # (greedy runs commit the same tokens under every policy: the same work done faster or slower)
            out.append("engine busy time over none's (rounds that recorded it): " + "; ".join(
                f"{p} " + ", ".join(fmt((statistics.median(v), min(v), max(v))) for v in values)
                for p, values in busy.items()))
        if "adaptive_q8" in present:
            out.append("q8_0 drafts: adaptive_q8 / none per level: " + ", ".join(
                fmt(ratio("adaptive_q8", "none", lv)) for lv in levels) + "; adaptive_q8 / adaptive: " + ", ".join(
                fmt(ratio("adaptive_q8", "adaptive", lv)) for lv in levels))
        if "planned" in present:  # the latency model's k for the measured rate against the per-request plan
            out.append("planned (the latency model's k) / adaptive per level: " + ", ".join(
                fmt(ratio("planned", "adaptive", lv)) for lv in levels) + "; planned / none: " + ", ".join(
                fmt(ratio("planned", "none", lv)) for lv in levels))
        wins = sum(r[0] <= 0.90 for r in over_single)
        out.append(f"win on the mix: adaptive / {single} (best single fixed choice) per level: "
                   + ", ".join(fmt(r) for r in over_single) + f" (goal ≤ 0.90 at ≥ 2 levels and ≤ 1.00 at all: "
                   f"{'met' if wins >= 2 and all(r[0] <= 1.0 for r in over_single) else 'missed'})")
    if "off" in have:
        high = ratio("adaptive", "off", levels[-1])
        low_best = best_each[0]
        speedup_best = 1 / ratio(low_best, "off", levels[0])[0]
        speedup_adaptive = 1 / ratio("adaptive", "off", levels[0])[0]
        low = speedup_adaptive / speedup_best
        out.append(f"3. highest load: adaptive / off = {fmt(high)} (goal ≤ 1.03: {'met' if high[0] <= 1.03 else 'missed'}); "
                   f"lowest load: adaptive's speedup over off {speedup_adaptive:.3f} / best static's "
                   f"({low_best}) {speedup_best:.3f} = {low:.3f} (goal ≥ 0.95: {'met' if low >= 0.95 else 'missed'})")
    return out


def plot(rows, path, title) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    levels = sorted({r["level"] for r in rows})
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, p in enumerate(p for p in POLICIES if any(r["policy"] == p for r in rows)):
        med = [cell(rows, p, lv) for lv in levels]
        pts = [(lv, c[0]) for lv, c in zip(levels, med) if c]
        style = dict(lw=2.5, color="k") if p == "adaptive" else dict(lw=1, color=f"C{i % 10}")
        ax.plot(*zip(*pts), "o-", label=p, **style)
        k = [(lv, c[0]) for lv in levels if (c := cell(rows, p, lv, "mean_draft_length"))]
        bx.plot(*zip(*k), "o-", label=p, **style)
    ax.set(xlabel="load (fraction of plain decoding's saturation rate)", ylabel="mean E2E (s)", title=title)
    bx.set(xlabel="load (fraction of plain decoding's saturation rate)", ylabel="mean draft length per request",
           title="draft length chosen")
    for a in (ax, bx):
        a.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="code,chat")
    ap.add_argument("--temperatures", default="0")
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES), help=f"'all' or some of {','.join(POLICIES)}")
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--first-repeat", type=int, default=0,
                    help="the first round's number (its arrivals' window and prompts): more rounds appended to an --out")
    ap.add_argument("--requests", type=int, default=6, help="arrivals per run")
    ap.add_argument("--saturation-requests", type=int, default=16)
    ap.add_argument("--saturation", type=float, help="plain decoding's saturation rate (req/s) to use instead of "
                    "measuring it: levels at the rates of an earlier run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slo-tpot-ms", type=float, default=None, help="every request's TPOT objective")
    ap.add_argument("--out")
    ap.add_argument("--analyze", metavar="DIR", help="only redo the tables and plots of a finished run")
    args = ap.parse_args()
    if args.analyze:
        return analyze(Path(args.analyze))
    run(args)


if __name__ == "__main__":
    sys.path.append(str(Path(__file__).resolve().parent.parent))
    main()
