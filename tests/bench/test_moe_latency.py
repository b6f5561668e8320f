"""bench/moe_latency.py without its sweep: the configurations it launches parse (synthetic acceptance named,
capped at k + 1), and its summary splits held-out errors by load, the MoE-aware fit ahead of the dense one
at low load on a sweep drawn from a mixture-of-experts model (tests/latency/synthetic.py)."""
import argparse
import importlib.util
import json
import shlex
from pathlib import Path

import pytest

from specserve.latency.equations.moe import MoeExperts
from specserve.spec_decode.config import SpeculativeConfig
from tests.latency.synthetic import CONFIGS, Sweep, write_sweep

SCRIPT = Path(__file__).parents[2] / "bench" / "moe_latency.py"


def load_script():
    spec = importlib.util.spec_from_file_location("moe_latency", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_configs_name_synthetic_acceptance():
    bench = load_script()
    args = argparse.Namespace(threads=1, max_model_len=512, ks=[1, 4], acceptance_length=2.5, port=9000)
    configs = bench.configs(args, Path("/m/target"), Path("/m/draft"))
    assert [c["label"] for c in configs] == ["no-sd", "k1", "k4"]
    assert [c["base_url"] for c in configs] == [f"http://127.0.0.1:{9000 + n}" for n in range(3)]
    for c in configs[1:]:
        words = shlex.split(c["launch"])
        spec = SpeculativeConfig.parse(json.loads(words[words.index("--speculative-config") + 1]))
        assert spec.rejection_sample_method == "synthetic"
        assert 1 + sum(spec.synthetic_rates) == pytest.approx(min(2.5, c["k"] + 1))


def test_summary_splits_errors_by_load(tmp_path):
    bench = load_script()
    results = write_sweep(tmp_path, Sweep(configs=CONFIGS[:3], moe=MoeExperts(8, 128), saturated=False,
                                          rows=False, load_fractions=(0.05, 0.1, 0.2, 0.35, 0.5, 0.7)))
    table = bench.summarize(tmp_path, results, "8/128")
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    dense, moe = (next(line for line in lines if line.startswith(f"| {name}")) for name in ("dense", "MoE-aware"))
    low = [float(row.split("|")[2].strip(" %")) for row in (dense, moe)]
    assert low[1] < low[0]
    assert (tmp_path / "validate-dense.md").exists() and (tmp_path / "validate-moe.md").exists()
