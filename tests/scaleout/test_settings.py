"""ScaleoutSettings from the CLI and from a Ray Serve config's `args:` (specserve/scaleout/settings.py)."""
import pytest

from specserve.cli import build_parser
from specserve.errors import SpecServeError
from specserve.scaleout.settings import ScaleoutSettings, engine_defaults, parse_session_fields


def test_serve_config_args_are_flat_with_dashes_or_underscores():
    s = ScaleoutSettings.from_dict({"model": "m", "replicas": 3, "num-threads": 2, "router": "pow2",
                                    "session_fields": "conv", "speculative_config": '{"method": "ngram", '
                                    '"num_speculative_tokens": 4}'})
    assert (s.replicas, s.num_threads, s.router, s.session_fields) == (3, 2, "pow2", ("conv",))
    assert s.engine["model"] == "m" and s.served_model_names == ("m",) and s.speculative_k == 4
    assert s.ongoing_cap == 4 * engine_defaults()["max_num_seqs"]
    assert ScaleoutSettings.from_dict(s.to_dict()) == s  # what replicas and the ingress receive


def test_bad_settings_are_one_line_errors():
    with pytest.raises(SpecServeError, match="unknown scale-out settings: replica_count"):
        ScaleoutSettings.from_dict({"replica_count": 2})
    with pytest.raises(SpecServeError, match="--router"):
        ScaleoutSettings.from_dict({"router": "random"})
    with pytest.raises(SpecServeError, match="--replicas"):
        ScaleoutSettings.from_dict({"replicas": 0})


def test_session_fields():
    assert parse_session_fields(None) == ("session_id", "user")
    assert parse_session_fields("none") == ()
    assert parse_session_fields(" a, b ,") == ("a", "b")


def test_from_the_serve_command_line():
    args = build_parser().parse_args(["serve", "--replicas", "2", "--num-threads", "1", "--model", "m",
                                      "--session-field", "none", "--router", "pow2", "--max-retries", "0",
                                      "--generation-config", "vllm"])
    s = ScaleoutSettings.from_args(args)
    assert (s.replicas, s.num_threads, s.router, s.session_fields, s.max_retries) == (2, 1, "pow2", (), 0)
    assert ScaleoutSettings.from_dict(s.to_dict()).generation_config == "vllm"  # reaches every replica
    assert build_parser().parse_args(["serve"]).replicas is None  # no flag: the single-process server
