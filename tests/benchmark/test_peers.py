"""What `specserve bench` reads from servers we did not write (issue 50): llama-server's `llamacpp:`
metrics and per-response timings, and the arrival times of any trace format."""
import json

import pytest

from fake_server import FakeServer, Script
from specserve.benchmark import arrival_schedules as arr
from specserve.benchmark.results import read_runs
from specserve.benchmark.server_metrics import delta, parse_prometheus
from specserve.benchmark.table import notes
from specserve.benchmark.workload import WorkloadSpec, make_workload
from specserve.cli import main

# What `llama-server --metrics` printed (tools/server/server-task.cpp of llama-cpp-python 0.3.36's
# vendored llama.cpp), trimmed to the lines we read and two we do not.
LLAMACPP_METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 5120
llamacpp:n_decode_total {decodes}
llamacpp:spec_decode_num_draft_tokens_total {drafted}
llamacpp:spec_decode_num_accepted_tokens_total {accepted}
llamacpp:spec_decode_num_drafts_total {drafts}
llamacpp:requests_deferred 3
llamacpp:n_busy_slots_per_decode {busy}
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {pos0}
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="1"}} {pos1}
"""


def test_llamacpp_metrics_are_read_and_differenced():
    before = parse_prometheus(LLAMACPP_METRICS.format(decodes=100, drafted=40, accepted=20, drafts=10,
                                                      busy=1.0, pos0=10, pos1=6))
    after = parse_prometheus(LLAMACPP_METRICS.format(decodes=300, drafted=240, accepted=120, drafts=60,
                                                     busy=2.5, pos0=50, pos1=36))
    assert after["spec_drafts"] == 60 and after["spec_draft_tokens"] == 240 and after["requests_deferred"] == 3
    d = delta(before, after)
    assert (d["spec_drafts"], d["spec_draft_tokens"], d["spec_accepted_tokens"]) == (50, 200, 100)
    assert d["accepted_per_position"] == [40, 30]
    # 2.5 slots x 300 calls in all, 1.0 x 100 before the run: 650 busy slots over the run's 200 calls
    assert d["busy_slots_per_decode"] == pytest.approx(650 / 200)
    assert d["decode_calls"] == 200 and d["requests_deferred"] == 3   # a gauge: as read after the run
    idle = delta(after, after)
    assert idle["busy_slots_per_decode"] is None   # no decode during the run: no average of its own


def test_bench_reads_acceptance_from_llama_server(tmp_path):
    # llama-server speculates 3 tokens per verify step here but streams one token per chunk, and its
    # responses count drafted/accepted tokens without the number of drafts: acceptance comes from /metrics.
    with FakeServer(Script(ttft_s=0.02, itl_s=0.002, llamacpp=True, max_model_len=512)) as srv:
        results = tmp_path / "r.jsonl"
        rc = main(["bench", "--base-url", srv.url, "--max-concurrency", "1", "--max-requests", "4",
                   "--input-len", "20", "--output-len", "9", "--no-progress", "--results", str(results)])
    assert rc == 0
    [run] = read_runs(results)
    spec = run["spec"]
    assert spec["source"] == "metrics"
    assert spec["mean_acceptance_length"] == pytest.approx(3.0)   # 1 + 6 accepted / 3 drafts per response
    assert spec["acceptance_rate"] == pytest.approx(6 / 9)
    assert spec["responses_acceptance_rate"] == pytest.approx(6 / 9)
    assert spec["accepted_per_position"] == [12, 12]
    assert run["tokens_per_chunk"] == 1.0 and run["server_metrics"]["busy_slots_per_decode"] == 2.0
    assert run["prompts"]["max_model_len"] == 512   # a slot's context, from /v1/models meta.n_ctx
    assert any("one token per chunk" in n for n in notes(run))


def test_llama_server_without_metrics_still_gives_its_acceptance_rate():
    from specserve.benchmark.client import RequestResult
    from specserve.benchmark.summary import _spec

    r = RequestResult(id=0, arrival_s=0.0)
    r.spec = {"num_draft_tokens": 12, "num_accepted_tokens": 9}
    s = _spec([r], None)
    assert s["acceptance_rate"] == 0.75 and s["mean_acceptance_length"] is None and s["source"] == "responses"


MOONCAKE = [{"timestamp": 3052, "input_length": 7234, "output_length": 794, "hash_ids": [0, 28]},
            {"timestamp": 0, "input_length": 6755, "output_length": 500, "hash_ids": [0, 1, 2]},
            {"timestamp": 10535, "input_length": 2287, "output_length": 316, "hash_ids": [0, 42]}]


@pytest.mark.parametrize("name", ["trace.jsonl", "trace.txt"])   # by suffix, and by content
def test_timestamps_mode_reads_a_mooncake_trace(tmp_path, name):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in MOONCAKE) + "\n")
    t = arr.load_trace(str(path), "timestamps")
    assert t.format == "timestamps" and t.times_s.tolist() == [0.0, 3.052, 10.535]
    assert t.input_tokens is None and t.output_tokens is None and t.hash_ids is None
    assert arr.load_trace(str(path)).format == "mooncake"   # auto keeps the lengths


def test_timestamps_mode_needs_only_the_timestamp_field(tmp_path):
    path = tmp_path / "arrivals.jsonl"
    path.write_text('{"timestamp": 500}\n{"timestamp": 0}\n\n{"timestamp": 1500}\n')
    assert arr.load_trace(str(path), "timestamps").times_s.tolist() == [0.0, 0.5, 1.5]
    with pytest.raises(Exception, match="arrivals.jsonl:1"):
        arr.load_trace(str(path))   # as a Mooncake trace it lacks the lengths


def test_timestamps_workload_from_mooncake_uses_natural_prompts(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in MOONCAKE) + "\n")
    w = make_workload(WorkloadSpec(trace=str(path), trace_format="timestamps", time_scale=0.1,
                                   dataset="spec-bench"))
    assert w.arrival_s.tolist() == pytest.approx([0.0, 0.3052, 1.0535])
    assert w.arrival["trace"]["format"] == "timestamps" and not w.arrival["trace"]["lengths_used"]
    assert all(p.target_tokens is None and p.max_tokens == 128 for p in w.prompts)


def test_bench_cli_accepts_a_mooncake_trace_as_timestamps(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in MOONCAKE[:2]) + "\n")
    with FakeServer(Script(ttft_s=0.01, itl_s=0.001)) as srv:
        results = tmp_path / "r.jsonl"
        rc = main(["bench", "--base-url", srv.url, "--trace", str(path), "--trace-format", "timestamps",
                   "--time-scale", "0.05", "--output-len", "4", "--warmup-requests", "0", "--no-progress",
                   "--results", str(results)])
    assert rc == 0
    [run] = read_runs(results)
    assert run["num_completed"] == 2 and run["arrival"]["trace"]["format"] == "timestamps"
