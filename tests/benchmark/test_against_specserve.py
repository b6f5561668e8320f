"""`specserve bench` end to end against a real `specserve serve` process (tiny model + draft)."""
import json

from specserve.cli import main
from tests.server.conftest import SMALL_KV, ServerProcess


def test_bench_run_and_report_against_a_real_specserve_server(tmp_path, tiny_target, tiny_draft):
    spec = json.dumps({"model": str(tiny_draft), "num_speculative_tokens": 3})
    server = ServerProcess(["--model", str(tiny_target), "--dtype", "float32", "--kv-cache-memory", SMALL_KV,
                            "--speculative-config", spec], tmp_path / "server.log")
    try:
        results = tmp_path / "runs.jsonl"
        code = main(["bench", "--base-url", server.root, "--request-rate", "8", "--max-requests", "12",
                     "--input-len", "16", "--output-len", "8", "--tokenizer", str(tiny_target),
                     "--label", "k3", "--k", "3", "--results", str(results), "--no-progress",
                     "--slo", "ttft:5000 tpot:2000"])
        assert code == 0
        record = json.loads(results.read_text().splitlines()[-1])
        assert record["num_completed"] == 12 and record["num_failed"] == 0
        assert record["mean_output_tokens"] == 8 and record["mean_prompt_tokens"] == 16
        assert 0 < record["ttft_s"]["mean"] <= record["e2e_s"]["mean"]
        spec_stats = record["spec"]
        assert spec_stats["num_drafts"] > 0 and spec_stats["num_draft_tokens"] <= 3 * spec_stats["num_drafts"]
        # the server's own Prometheus counters saw the same drafts the responses reported
        assert server.metric("specserve:spec_decode_num_drafts_total") >= spec_stats["num_drafts"]
        assert record["slo_attainment"] is not None
        assert main(["bench", "report", str(results), "--out", str(tmp_path / "report")]) == 0
        assert any(p.suffix == ".html" for p in (tmp_path / "report").iterdir())
        assert len(list((tmp_path / "report").glob("*.png"))) >= 2
    finally:
        server.stop()


def test_multi_turn_conversations_resend_their_history_and_hit_the_prefix_cache(tmp_path, tiny_target):
    server = ServerProcess(["--model", str(tiny_target), "--dtype", "float32", "--kv-cache-memory", SMALL_KV],
                           tmp_path / "server.log")
    try:
        results = tmp_path / "runs.jsonl"
        code = main(["bench", "--base-url", server.root, "--turns", "3", "--think-time", "0.01",
                     "--request-rate", "8", "--max-requests", "4", "--output-len", "8", "--results", str(results),
                     "--no-progress"])
        assert code == 0
        record = json.loads(results.read_text().splitlines()[-1])
        assert record["endpoint"] == "chat" and record["num_completed"] == 12
        turns = record["turns"]
        assert [t["turn"] for t in turns] == [1, 2, 3] and all(t["requests"] == 4 for t in turns)
        # each turn carries the previous ones, the model's 8-token replies included
        assert turns[0]["mean_prompt_tokens"] + 8 < turns[1]["mean_prompt_tokens"] < turns[2]["mean_prompt_tokens"]
        assert record["prefix_cache_hit_rate"] > 0.3
    finally:
        server.stop()
