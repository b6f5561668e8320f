"""A server running the adaptive policy with objectives: per-request SLOs in the body, the policy, the
cost model's predictions and SLO attainment in /metrics."""
import openai
import pytest

from tests.server.conftest import ServerProcess, tiny_args


@pytest.fixture(scope="module")
def adaptive_server(tiny_target, tiny_draft, tmp_path_factory):
    spec = f'{{"model": "{tiny_draft}", "num_speculative_tokens": 3, "policy": "adaptive"}}'
    server = ServerProcess(tiny_args(tiny_target, "--speculative-config", spec, "--served-model-name", "tiny",
                                     "--slo-tpot-ms", "10000"), tmp_path_factory.mktemp("server") / "slo.log")
    yield server
    server.stop()


def test_objectives_policy_and_predictions_are_in_metrics(adaptive_server):
    client = openai.OpenAI(base_url=adaptive_server.base_url, api_key="none")
    for i in range(4):
        client.completions.create(model="tiny", prompt=f"slo {i}", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True, "slo_ttft_ms": 60000 if i % 2 else 1e-3})
    m = adaptive_server
    assert m.metric("specserve:spec_decode_policy_info", policy="adaptive") == 1
    # the server default TPOT (10 s) is met by all; the TTFT objective of 1 µs by none, of 60 s by all
    assert m.metric("specserve:slo_requests_total", objective="tpot", met="true") == 4
    assert m.metric("specserve:slo_requests_total", objective="ttft", met="true") == 2
    assert m.metric("specserve:slo_requests_total", objective="ttft", met="false") == 2
    measured = m.metric("specserve:spec_decode_step_time_seconds_count", kind="measured")
    assert measured > 0 and m.metric("specserve:spec_decode_step_time_seconds_count", kind="predicted") == measured
    assert m.metric("specserve:spec_decode_cost_model_relative_error") >= 0
    assert 0.5 <= m.metric("specserve:spec_decode_drafting_cost_factor") <= 4


def test_a_non_positive_objective_is_a_400(adaptive_server):
    client = openai.OpenAI(base_url=adaptive_server.base_url, api_key="none")
    with pytest.raises(openai.BadRequestError, match="TPOT SLO must be positive"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"slo_tpot_ms": 0})
