"""Schemathesis fuzzes every operation of the server's own /openapi.json: no response may be a 5xx, and
no stream may end in a 500 error event; every 4xx is in OpenAI's shape.

Cases are valid bodies (positive) and bodies that break the schema (negative); half of the bodies lose
their random `model`, so that they get past the 404 into validation and the engine. The run is bounded and
reproducible: a fixed Hypothesis seed (set SPECSERVE_FUZZ_SEED to explore others) and MIN_CASES cases
in all. It runs against a real server process (uvicorn's HTTP parsing included), with the tiny model, a
short context (max_tokens is capped by it) and speculation on.
"""
import json
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from tests.server.conftest import ServerProcess, tiny_args

MIN_CASES = 1000
# Generation requests take most of the cases: they are where the input space is.
EXAMPLES = {"POST": 500, "GET": 40}
FUZZ_SEED = int(os.environ.get("SPECSERVE_FUZZ_SEED", "47"))


@pytest.fixture(scope="module")
def fuzz_server(tiny_target, tiny_draft, tmp_path_factory):
    server = ServerProcess(tiny_args(tiny_target, "--speculative-config",
                                     f'{{"model": "{tiny_draft}", "num_speculative_tokens": 3}}',
                                     "--max-model-len", "96", "--served-model-name", "tiny",
                                     "--disable-access-log"),
                           tmp_path_factory.mktemp("server") / "fuzz.log")
    yield server
    assert server.stop() == 0


def _header(response, name: str) -> str | None:
    """schemathesis keeps each header as a list of values."""
    for key, values in response.headers.items():
        if key.lower() == name:
            return values[0] if isinstance(values, list) else values
    return None


def _problem(response) -> str | None:
    """What is wrong with one response, or None."""
    status, text = response.status_code, response.text
    if status >= 500:
        return f"status {status}: {text[:500]}"
    if "Traceback" in text:
        return "a traceback in the body"
    if status >= 400:
        try:
            err = json.loads(text)["error"]
        except (ValueError, KeyError, TypeError):
            return f"status {status} without an OpenAI error body: {text[:300]}"
        if set(err) != {"message", "type", "param", "code"}:
            return f"error body with fields {sorted(err)}"
        if status in (429, 503) and _header(response, "retry-after") is None:
            return f"status {status} without Retry-After"
    elif (_header(response, "content-type") or "").startswith("text/event-stream"):
        for line in text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                if json.loads(line[6:])["error"]["type"] == "internal_server_error":
                    return f"a 500 error event mid-stream: {line[:300]}"
    return None


def test_schemathesis_finds_no_server_error(fuzz_server):
    schema = schemathesis.openapi.from_url(fuzz_server.root + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/health", "/v1/models"} <= paths
    counts, failures, statuses = {}, [], {}
    for op in operations:
        key = f"{op.method.upper()} {op.path}"
        counts[key] = 0
        strategy = op.as_strategy(generation_mode=schemathesis.GenerationMode.POSITIVE) | op.as_strategy(
            generation_mode=schemathesis.GenerationMode.NEGATIVE)

        @seed(FUZZ_SEED)
        @settings(max_examples=EXAMPLES.get(op.method.upper(), 40), deadline=None, database=None,
                  suppress_health_check=list(HealthCheck), phases=("explicit", "generate"))
        @given(case=strategy, served=st.booleans())
        def run(case, served):
            counts[key] += 1
            if served and isinstance(case.body, dict):  # past the 404 for a random model name, into the engine
                case.body.pop("model", None)
            response = case.call(base_url=fuzz_server.root, timeout=60)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            problem = _problem(response)
            if problem is not None:
                failures.append(f"{key}: {problem}\n  body sent: {str(case.body)[:300]}")

        run()
    print("cases per operation:", counts, "statuses:", dict(sorted(statuses.items())))
    assert failures == [], "\n".join(failures[:10])
    assert sum(counts.values()) >= MIN_CASES, counts
    assert "Traceback" not in fuzz_server.log
