"""Host-side work per engine step: the time a step spends outside the models' forwards, and how many
device->host reads it makes (each a synchronisation on a GPU: a `device_sync.to_host` call, which reads
several tensors at once, or any other tensor -> Python conversion in the engine), at 1 and 32 running
requests, with plain decoding and with speculation; and the speculation policy's own time (the
controller: plan and observe), e.g. the adaptive policy's (`--configs adaptive`).

    python bench/step_overhead.py --label after                      # this checkout
    PYTHONPATH=/path/to/old/checkout python bench/step_overhead.py --label before
    python bench/step_overhead.py --report                           # the table of every label

Each configuration: N requests (256-token ShareGPT prompts, greedy, EOS ignored) run until all decode, then
--steps timed steps. Forward time is what LlamaModel.forward and compute_logits take (target and drafts);
everything else in `engine.step()` is host-side overhead. Results: bench/results/step_overhead/<label>.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

OUT = Path(__file__).parent / "results" / "step_overhead"
CONFIGS = {"plain": None,
           "spec": '{"model": "default", "num_speculative_tokens": 3, "ngram_first": true}',
           "adaptive": '{"model": "default", "num_speculative_tokens": 3, "ngram_first": true, "policy": "adaptive"}',
           # the drafts loaded, nothing drafted: what speculation's machinery costs by itself (should be ~plain)
           "off": '{"model": "default", "num_speculative_tokens": 3, "ngram_first": true, "policy": "off"}'}
POLICY_METHODS = ("plan", "observe")
CONVERSIONS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy")


def instrument():
    """Wraps the model's compute and tensor -> Python conversions with counters."""
    import torch

    from specserve.model.llama import LlamaModel
    clock = {"forward": 0.0, "reads": 0, "policy": 0.0}
    for name in ("forward", "compute_logits"):
        original = getattr(LlamaModel, name)

        def timed(self, *args, _original=original, **kwargs):
            t0 = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                clock["forward"] += time.perf_counter() - t0
        setattr(LlamaModel, name, timed)
    for name in CONVERSIONS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            # engine-side reads, not host metadata; device_sync.to_host's are counted per call below
            if "/specserve/" in caller and "/model/" not in caller and not caller.endswith("device_sync.py"):
                clock["reads"] += 1
            return _original(self, *args, **kwargs)
        setattr(torch.Tensor, name, counted)
    return clock


def measure(spec: str | None, running: int, steps: int, threads: int) -> dict:
    from specserve import LLM, SamplingParams, device_sync
    from bench.engine_throughput import load_prompts
    clock = instrument()
    llm = LLM(model="smollm2-135m", max_num_seqs=64, num_threads=threads, speculative_config=spec)
    engine = llm.engine
    policy = getattr(engine, "policy", None)
    for name in POLICY_METHODS if policy is not None else ():
        def timed_policy(*args, _original=getattr(policy, name), **kwargs):
            t0 = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                clock["policy"] += time.perf_counter() - t0
        setattr(policy, name, timed_policy)  # the scheduler, proposer and executor all call this one object
    params = SamplingParams(max_tokens=steps * 5 + 50, temperature=0, ignore_eos=True)
    for p in load_prompts(llm.tokenizer, running, 256):
        engine.add_request(p, params)
    while engine.scheduler.waiting or any(s.in_prefill for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # warm
        engine.step()
    step_s, forward_s, reads, policy_s = [], [], [], []
    for _ in range(steps):
        f0, r0, p0, t0 = clock["forward"], clock["reads"] + device_sync.transfers, clock["policy"], time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t0)
        forward_s.append(clock["forward"] - f0)
        reads.append(clock["reads"] + device_sync.transfers - r0)
        policy_s.append(clock["policy"] - p0)
    host = [s - f for s, f in zip(step_s, forward_s)]
    return {"running": running, "step_ms": statistics.median(step_s) * 1e3,
            "host_ms": statistics.median(host) * 1e3,
            "host_share": statistics.median(h / s for h, s in zip(host, step_s)),
            "reads_per_step": statistics.median(reads),
            "policy_ms": statistics.median(policy_s) * 1e3,
            "policy_share": statistics.median(p / s for p, s in zip(policy_s, step_s))}


def report() -> None:
    print("| label | config | running | step (ms) | host outside forward (ms) | host share | tensor reads / step "
          "| policy (ms) | policy share |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in sorted(OUT.glob("*.json")):
        data = json.loads(path.read_text())
        for r in data["rows"]:
            print(f"| {data['label']} | {r['config']} | {r['running']} | {r['step_ms']:.1f} | {r['host_ms']:.2f} | "
                  f"{r['host_share']:.1%} | {r['reads_per_step']:g} | "
                  + (f"{r['policy_ms']:.2f} | {r['policy_share']:.1%} |" if "policy_ms" in r else "- | - |"))
    print(f"\n({', '.join(sorted({json.loads(p.read_text())['machine'] for p in OUT.glob('*.json')}))})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--running", default="1,32")
    ap.add_argument("--configs", default="plain,spec")
    ap.add_argument("--report", action="store_true")
    args = ap.parse_args()
    if args.report:
        return report()
    import platform
    import subprocess
    rows = []
    for config in args.configs.split(","):
        for running in map(int, args.running.split(",")):
            # Each measurement in its own process: the instrumentation and the model stay private to it.
            out = subprocess.run([sys.executable, __file__, "--one", config, str(running), str(args.steps),
                                  str(args.threads)], capture_output=True, text=True, check=True)
            row = dict(json.loads(out.stdout.strip().splitlines()[-1]), config=config)
            print(row, flush=True)
            rows.append(row)
    OUT.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.processor() or platform.machine()}, {args.threads} threads"
    (OUT / f"{args.label}.json").write_text(json.dumps({"label": args.label, "machine": machine, "rows": rows}, indent=1))
    report()


if __name__ == "__main__":
    sys.path.append(str(Path(__file__).resolve().parent.parent))  # bench.engine_throughput (after PYTHONPATH)
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        config, running, steps, threads = sys.argv[2], *map(int, sys.argv[3:6])
        print(json.dumps(measure(CONFIGS[config], running, steps, threads)))
    else:
        main()
