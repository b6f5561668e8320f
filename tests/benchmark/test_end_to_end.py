"""Runs against the scripted fake server: the measured times must match the script."""
import json
import socket
import statistics
import time

import pytest

from fake_server import FakeServer, Script
from specserve.benchmark.metrics import in_flight_steps
from specserve.benchmark.results import read_request_rows, read_runs, validate_run
from specserve.cli import build_parser, main

TTFT, ITL = 0.06, 0.015
ROUNDING = 2e-6   # request rows hold times to the microsecond


def assert_measures_the_script(run: dict, rows: list[dict], ttft: float, itl: float, wall_s: float) -> None:
    """What holds of the measured times on any machine, fast, slow or busy. The server cannot send sooner
    than the script says, so every time from a request's send to one of its chunks is at least the
    script's (a chunk that arrives late can shorten the gap after it, so a single gap has no lower bound,
    nor has a difference such as TPOT); no time exceeds the bench's own wall time; each request's numbers
    are its timestamps' differences, by the documented definitions; and the run's medians are its rows'."""
    ok = [r for r in rows if r["error"] is None]
    assert ok
    for r in ok:
        gaps = r["itl_s"]
        assert len(gaps) == r["num_chunks"] - 1
        assert r["ttft_s"] == pytest.approx(r["first_token_s"] - r["sent_s"], abs=ROUNDING)
        assert r["e2e_s"] == pytest.approx(r["end_s"] - r["sent_s"], abs=ROUNDING)
        assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1), abs=ROUNDING)
        last_chunk = r["ttft_s"] + sum(gaps)
        assert last_chunk <= r["e2e_s"] + len(gaps) * ROUNDING   # the last byte ([DONE]) comes after it
        assert r["ttft_s"] >= ttft - ROUNDING and last_chunk >= ttft + len(gaps) * itl - len(gaps) * ROUNDING
        assert r["e2e_s"] < wall_s
    for key, values in (("ttft_s", [r["ttft_s"] for r in ok]), ("e2e_s", [r["e2e_s"] for r in ok]),
                        ("tpot_s", [r["tpot_s"] for r in ok]), ("itl_s", [g for r in ok for g in r["itl_s"]])):
        assert run[key]["median"] == pytest.approx(statistics.median(values), abs=ROUNDING), key


@pytest.fixture(scope="module")
def server(tokenizer):
    script = Script(ttft_s=TTFT, itl_s=ITL, count_tokens=lambda t: len(tokenizer.encode(t)))
    with FakeServer(script) as srv:
        yield srv


def bench(*args) -> int:
    return main(["bench", *args, "--no-progress"])


def timed_bench(*args) -> tuple[int, float]:
    """bench's exit status and its wall time, as this test saw it."""
    t = time.monotonic()
    rc = bench(*args)
    return rc, time.monotonic() - t


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_argparse_forms():
    p = build_parser()
    a = p.parse_args(["bench", "--base-url", "http://127.0.0.1:1", "--request-rate", "2"])
    assert a.func.__name__ == "_run" and a.request_rate == 2.0 and a.bench_command is None
    a = p.parse_args(["bench", "sweep", "--rates", "1,2.5", "--config", "a=http://127.0.0.1:1,k=3"])
    assert a.func.__name__ == "_sweep" and a.rates == [1.0, 2.5] and a.config == ["a=http://127.0.0.1:1,k=3"]
    a = p.parse_args(["bench", "report", "r.jsonl", "--out", "d"])
    assert a.func.__name__ == "_report" and a.results == "r.jsonl"
    with pytest.raises(SystemExit):
        p.parse_args(["bench", "sweep", "--rates", "1", "--fractions", "0.5"])


def test_poisson_run_measures_the_scripted_timing(server, tokenizer_path, tmp_path):
    results = tmp_path / "r.jsonl"
    rc, wall_s = timed_bench("--base-url", server.url, "--request-rate", "8", "--max-requests", "12",
                             "--input-len", "40", "--output-len", "6", "--tokenizer", str(tokenizer_path),
                             "--results", str(results), "--slo", "ttft:60000 tpot:60000", "--label", "k3",
                             "--k", "3")
    assert rc == 0
    [run] = read_runs(results)
    assert validate_run(run) == []
    assert (run["label"], run["k"], run["num_completed"], run["num_failed"]) == ("k3", 3, 12, 0)
    rows = read_request_rows(results)[run["run_id"]]
    assert len(rows) == 12 and all(len(r["itl_s"]) == 5 and r["error"] is None for r in rows)
    assert_measures_the_script(run, rows, TTFT, ITL, wall_s)
    # Exact prompt lengths: the fake counts with the same tokenizer and reports usage.prompt_tokens.
    assert run["mean_prompt_tokens"] == 40 and run["prompt_tokens_source"] == "server"
    assert run["mean_output_tokens"] == 6 and run["prompts"]["exact_length"]
    assert run["slo_attainment"] == 1.0
    # The client sends on the Poisson schedule, never before a request's arrival (how late is the machine's).
    assert all(r["sent_s"] >= r["arrival_s"] for r in rows)
    assert [r["id"] for r in sorted(rows, key=lambda r: r["sent_s"])] == [r["id"] for r in rows]
    assert run["send_delay_s"]["median"] == pytest.approx(statistics.median(r["sent_s"] - r["arrival_s"] for r in rows),
                                                          abs=ROUNDING)
    # The fake counts one preemption per request; warm-up requests come before the first scrape.
    assert run["preemptions"] == 12
    assert all(r["prompt_tokens"] == 40 for r in rows)
    sent = [b for b in server.script.seen if b.get("max_tokens") == 6]
    assert sent and all(b["ignore_eos"] and b["stream_options"] == {"include_usage": True} for b in sent)


def test_chat_endpoint_and_multi_token_chunks(tmp_path):
    # Three tokens per chunk, as a speculative server commits them: ITL counts chunks, TPOT tokens.
    with FakeServer(Script(ttft_s=TTFT, itl_s=ITL, tokens_per_chunk=3)) as srv:
        results = tmp_path / "r.jsonl"
        rc, wall_s = timed_bench("--base-url", srv.url + "/v1", "--endpoint", "chat", "--max-concurrency", "2",
                                 "--max-requests", "6", "--input-len", "30", "--output-len", "9",
                                 "--results", str(results))
    assert rc == 0
    [run] = read_runs(results)
    assert run["endpoint"] == "chat" and run["num_completed"] == 6
    assert run["tokens_per_chunk"] == 3.0
    # Three chunks (two gaps) of the 9 tokens; TPOT spreads the time after the first chunk over 8 tokens.
    rows = read_request_rows(results)[run["run_id"]]
    assert all(r["num_chunks"] == 3 and r["output_tokens"] == 9 for r in rows)
    assert_measures_the_script(run, rows, TTFT, ITL, wall_s)
    assert run["spec"]["mean_acceptance_length"] == pytest.approx(3.0)
    assert run["spec"]["source"] == "responses"
    # No tokenizer: prompt lengths were estimated with a ratio calibrated from the server's usage.
    assert run["prompts"]["counting"] == "server-calibrated estimate"


def test_closed_loop_littles_law(server, tmp_path):
    results = tmp_path / "r.jsonl"
    rc, wall_s = timed_bench("--base-url", server.url, "--max-concurrency", "3", "--max-requests", "15",
                             "--output-len", "4", "--results", str(results))
    assert rc == 0
    [run] = read_runs(results)
    rows = read_request_rows(results)[run["run_id"]]
    assert run["arrival"]["process"] == "closed" and run["offered_rate"] is None
    # Three in flight, never more: the first three go out together, before any can have finished.
    _, counts = in_flight_steps([(r["sent_s"], r["end_s"]) for r in rows])
    assert max(counts) == 3 and run["mean_in_flight"] <= 3
    assert run["littles_law_in_flight"] == pytest.approx(run["mean_in_flight"], rel=0.15)
    # 15 requests queued at 0, three at a time: later ones wait for a slot (the 13th and later for four
    # requests of >= TTFT + 3·ITL each), and their TTFT is measured from their send, not from 0.
    assert run["send_delay_s"]["p90"] > 2 * TTFT
    assert_measures_the_script(run, rows, TTFT, ITL, wall_s)
    # Each request takes at least TTFT + 3·ITL, three at a time: no machine completes them faster.
    assert run["achieved_rate"] <= 3 / (TTFT + 3 * ITL)


def test_failed_requests_are_recorded_not_fatal(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in
                                 ["hello there", "please REJECT this", "another one", "and more"]))
    with FakeServer(Script(ttft_s=0.01, itl_s=0.005, reject_marker="REJECT")) as srv:
        results = tmp_path / "r.jsonl"
        rc = bench("--base-url", srv.url, "--dataset", str(prompts), "--request-rate", "50",
                   "--max-requests", "8", "--output-len", "3", "--warmup-requests", "0",
                   "--results", str(results), "--seed", "3")
    assert rc == 0
    [run] = read_runs(results)
    assert run["num_requests"] == 8 and run["num_failed"] == 2 and run["num_completed"] == 6
    assert run["errors"] == {"HTTP 400: rejected by script": 2}


def test_unreachable_server(tmp_path):
    url = f"http://127.0.0.1:{_free_port()}"   # a loopback port nobody listens on
    results = tmp_path / "r.jsonl"
    rc = bench("--base-url", url, "--model", "m", "--request-rate", "100", "--max-requests", "3",
               "--output-len", "2", "--input-len", "5", "--results", str(results))
    assert rc == 1
    [run] = read_runs(results)
    assert run["num_failed"] == 3 and all(e.startswith("ConnectError") for e in run["errors"])
    assert main(["bench", "--base-url", url, "--no-progress"]) == 2    # no --model and no /v1/models


def test_sweep_two_configs_then_report(server, tmp_path, capsys):
    configs = tmp_path / "configs.json"
    configs.write_text(json.dumps([{"label": "k0", "base_url": server.url, "k": 0},
                                   {"label": "k4", "base_url": server.url, "k": 4,
                                    "server_config": {"method": "draft"}}]))
    results = tmp_path / "sweep.jsonl"
    rc = main(["bench", "sweep", "--configs", str(configs), "--rates", "10,20", "--duration", "0.8",
               "--output-len", "3", "--input-len", "20", "--results", str(results), "--no-progress",
               "--slo", "ttft:70 e2e:1000", "--warmup-requests", "1"])
    assert rc == 0
    runs = read_runs(results)
    assert [(r["label"], r["offered_rate"]) for r in runs] == [("k0", 10), ("k0", 20), ("k4", 10), ("k4", 20)]
    assert runs[3]["server_config"] == {"method": "draft"} and runs[3]["k"] == 4
    assert all(validate_run(r) == [] and r["sweep"]["rate"] == r["offered_rate"] for r in runs)
    # The sweep table is wider than 80 columns; piped (capsys is no terminal) it still prints whole.
    shown = capsys.readouterr().out
    header = next(line for line in shown.splitlines() if "offered" in line and "accept len" in line)
    assert "…" not in shown and all(c in header for c in ("in flight", "TTFT p50", "E2E p99", "SLO met"))
    out = tmp_path / "report"
    assert main(["bench", "report", str(results), "--out", str(out)]) == 0
    pngs = {p.name for p in out.glob("*.png")}
    assert {"latency_vs_rate.png", "slo_attainment_vs_rate.png", "ttft_cdf.png", "tpot_cdf.png",
            "in_flight_over_time.png"} <= pngs
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(pngs) and "k4" in page
    assert all((out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_sweep_fractions_of_measured_saturation(server, tmp_path):
    results = tmp_path / "f.jsonl"
    rc = main(["bench", "sweep", "--base-url", server.url, "--fractions", "0.25", "--duration", "0.6",
               "--saturation-requests", "12", "--output-len", "3", "--input-len", "10",
               "--results", str(results), "--no-progress", "--warmup-requests", "0"])
    assert rc == 0
    [run] = read_runs(results)
    sat = run["sweep"]["saturation_rate"]
    assert sat > 0 and run["offered_rate"] == pytest.approx(0.25 * sat)


def test_sweep_launches_and_stops_each_server(tmp_path):
    import sys
    import time
    from pathlib import Path

    import httpx

    port = _free_port()
    script = Path(__file__).with_name("fake_server.py")
    configs = tmp_path / "configs.json"
    configs.write_text(json.dumps([{"label": "launched", "base_url": f"http://127.0.0.1:{port}",
                                    "launch": f"{sys.executable} {script} {port}", "ready_timeout_s": 60}]))
    results = tmp_path / "r.jsonl"
    rc = main(["bench", "sweep", "--configs", str(configs), "--rates", "20", "--max-requests", "4",
               "--output-len", "2", "--input-len", "5", "--results", str(results), "--no-progress",
               "--log-dir", str(tmp_path / "logs"), "--warmup-requests", "0"])
    assert rc == 0 and read_runs(results)[0]["num_completed"] == 4
    assert (tmp_path / "logs" / "launched.server.log").exists()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:     # the server's process group was terminated
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1.0, trust_env=False)
        except httpx.HTTPError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("launched server still answering after the sweep")


@pytest.mark.parametrize("n_configs,n_rates,seed", [(5, 8, 0), (2, 3, 1), (1, 4, 2), (3, 1, 0)])
def test_interleaved_order_is_rounds_of_every_configuration(n_configs, n_rates, seed):
    from specserve.benchmark.sweep import interleaved_order

    order = interleaved_order(n_configs, n_rates, seed)
    assert order == interleaved_order(n_configs, n_rates, seed)          # the seed fixes it
    rounds = [order[r * n_configs:(r + 1) * n_configs] for r in range(n_rates)]
    assert all(sorted(c for c, _ in rnd) == list(range(n_configs)) for rnd in rounds)
    for c in range(n_configs):
        assert sorted(i for cc, i in order if cc == c) == list(range(n_rates))


def test_interleaved_order_shuffles_rates_and_configurations():
    from specserve.benchmark.sweep import interleaved_order

    order = interleaved_order(5, 8, 0)
    rates_in_time = [[i for c, i in order if c == cc] for cc in range(5)]
    assert rates_in_time[0] != list(range(8)) and len({tuple(r) for r in rates_in_time}) == 5
    assert len({tuple(c for c, _ in order[r * 5:(r + 1) * 5]) for r in range(8)}) > 1
    assert interleaved_order(5, 8, 1) != order


def test_interleaved_sweep_keeps_every_server_up_and_mixes_configurations(tmp_path):
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("fake_server.py")
    ports = [_free_port(), _free_port()]
    configs = tmp_path / "configs.json"
    configs.write_text(json.dumps([{"label": f"c{n}", "base_url": f"http://127.0.0.1:{port}",
                                    "launch": f"{sys.executable} {script} {port}", "ready_timeout_s": 60}
                                   for n, port in enumerate(ports)]))
    results = tmp_path / "r.jsonl"
    rc = main(["bench", "sweep", "--configs", str(configs), "--rates", "20,30,40", "--max-requests", "3",
               "--output-len", "2", "--input-len", "5", "--results", str(results), "--no-progress",
               "--log-dir", str(tmp_path / "logs"), "--warmup-requests", "0", "--interleave", "--seed", "3",
               "--probe", "2"])
    assert rc == 0
    runs = read_runs(results)
    from specserve.benchmark.sweep import interleaved_order

    expected = [(f"c{c}", [20, 30, 40][i]) for c, i in interleaved_order(2, 3, 3)]
    assert [(r["label"], r["offered_rate"]) for r in runs] == expected
    assert all(r["num_completed"] == 3 and r["sweep"]["index"] == [20, 30, 40].index(r["offered_rate"])
               for r in runs)
    # One probe before the first run and one after each: two lone requests to the first configuration.
    probes = read_runs(tmp_path / "r.probes.jsonl")
    assert len(probes) == len(runs) + 1
    assert all(p["label"] == "c0/probe" and p["num_completed"] == 2 and p["arrival"]["process"] == "closed"
               and p["arrival"]["max_concurrency"] == 1 for p in probes)
    assert all(before["started_at"] <= run["started_at"] <= after["started_at"]
               for before, run, after in zip(probes, runs, probes[1:]))


def test_probes_need_an_interleaved_sweep(tmp_path, capsys):
    rc = main(["bench", "sweep", "--config", "a=http://127.0.0.1:9", "--rates", "1", "--probe", "2",
               "--no-progress", "--input-len", "5", "--results", str(tmp_path / "r.jsonl")])
    assert rc == 2 and "--probe needs --interleave" in capsys.readouterr().err


def test_interleaved_sweep_needs_a_port_per_launched_server(tmp_path, capsys):
    configs = tmp_path / "configs.json"
    configs.write_text(json.dumps([{"label": f"c{n}", "base_url": "http://127.0.0.1:9", "launch": "true"}
                                   for n in range(2)]))
    rc = main(["bench", "sweep", "--configs", str(configs), "--rates", "1", "--interleave", "--no-progress",
               "--input-len", "5", "--results", str(tmp_path / "r.jsonl")])
    assert rc == 2 and "own base_url" in capsys.readouterr().err


def test_request_timeout_bounds_a_stalled_request(tmp_path):
    stall = 60.0   # the server's first token comes only after this long: no machine is that slow to time out
    with FakeServer(Script(ttft_s=stall, itl_s=0.01)) as srv:
        results = tmp_path / "r.jsonl"
        rc = bench("--base-url", srv.url, "--request-rate", "20", "--max-requests", "2", "--output-len", "2",
                   "--input-len", "5", "--request-timeout", "0.2", "--warmup-requests", "0",
                   "--results", str(results))
    assert rc == 1
    [run] = read_runs(results)
    assert run["errors"] == {"timed out after 0.2s": 2}
    assert run["bench_duration_s"] < stall   # it gave up on them, rather than waiting for the server
