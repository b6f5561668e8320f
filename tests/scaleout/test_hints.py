"""What the ingress reads from a request body for the router (specserve/scaleout/hints.py)."""
import json

from specserve.scaleout.hints import COMPLETION_DEFAULT_MAX_TOKENS, hints_from_body

FIELDS = ("session_id", "user")


def body(d) -> bytes:
    return json.dumps(d).encode()


def test_chat_counts_message_characters_and_reads_max_tokens():
    h = hints_from_body("/v1/chat/completions", body({
        "messages": [{"role": "system", "content": "abcd"},
                     {"role": "user", "content": [{"type": "text", "text": "efgh"}, {"type": "text", "text": "ij"}]}],
        "max_completion_tokens": 33}), FIELDS)
    assert (h.prompt_chars, h.prompt_ids, h.output_tokens) == (10, 0, 33)
    assert h.prompt_tokens(2.0) == 5
    assert hints_from_body("/v1/chat/completions", body({"messages": [], "max_tokens": 7}), FIELDS).output_tokens == 7
    assert hints_from_body("/v1/chat/completions", body({"messages": []}), FIELDS).output_tokens is None


def test_completions_take_text_or_token_ids_and_the_legacy_default_length():
    h = hints_from_body("/v1/completions", body({"prompt": [1, 2, 3, 4]}), FIELDS)
    assert (h.prompt_chars, h.prompt_ids, h.output_tokens) == (0, 4, COMPLETION_DEFAULT_MAX_TOKENS)
    h = hints_from_body("/v1/completions", body({"prompt": ["ab", "cde"], "max_tokens": 5}), FIELDS)
    assert (h.prompt_chars, h.output_tokens) == (5, 5)


def test_session_comes_from_the_first_field_present():
    assert hints_from_body("/v1/completions", body({"prompt": "x", "user": "u", "session_id": "s"}), FIELDS).session == "s"
    assert hints_from_body("/v1/completions", body({"prompt": "x", "user": "u"}), FIELDS).session == "u"
    assert hints_from_body("/v1/completions", body({"prompt": "x", "user": "u"}), ()).session is None
    assert hints_from_body("/v1/completions", body({"prompt": "x", "user": ""}), FIELDS).session is None


def test_anything_else_gets_bare_hints_and_a_fresh_key():
    for path, raw in (("/v1/completions", b"{not json"), ("/v1/completions", b"[1, 2]"), ("/v1/models", b"")):
        h = hints_from_body(path, raw, FIELDS)
        assert (h.prompt_chars, h.prompt_ids, h.output_tokens, h.session) == (0, 0, None, None)
    assert hints_from_body("/v1/models", b"", FIELDS).key != hints_from_body("/v1/models", b"", FIELDS).key


def test_a_retry_avoids_the_replicas_that_failed():
    h = hints_from_body("/v1/completions", body({"prompt": "x"}), FIELDS)
    assert h.retry("a").retry(None).retry("b").avoid == ("a", "b")
