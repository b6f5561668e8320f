"""bench/moe_step_cost.py at a tiny size: it builds the quantized MoE, times steps of 1..N requests, counts
the experts they touch and writes its table (no timing is asserted: the numbers are the lead's to take)."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from specserve.model.cpu_linear import kernel_can_run

SCRIPT = Path(__file__).parents[2] / "bench" / "moe_step_cost.py"


@pytest.mark.skipif(not kernel_can_run(torch.zeros(1)), reason="no C compiler: no kernel here")
def test_tiny_run_writes_the_table(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("moe_step_cost", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--hidden", "64", "--moe-intermediate", "32", "--layers", "2", "--experts", "16",
                         "--active", "4", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--vocab", "512",
                         "--batches", "1,4,16", "--context", "20", "--reps", "2", "--threads", "1",
                         "--bandwidth-mb", "8", "--label", "tiny", "--results", str(tmp_path)])
    saved = json.loads((tmp_path / "tiny.json").read_text())
    assert [r["requests"] for r in saved["rows"]] == [1, 4, 16] and saved["rows"] == result["rows"]
    touched = [r["experts_touched_per_layer"] for r in saved["rows"]]
    assert touched[0] == 4 and all(4 <= t <= 16 for t in touched)  # 1 request: its own 4 experts
    assert all(r["step_ms"] > 0 and r["read_ms"] > 0 for r in saved["rows"])
    assert "step/read" in capsys.readouterr().out
