"""The multi-turn code-editing workload (benchmark/code_edit.py)."""
import ast

from specserve.benchmark.code_edit import ASK, DATASET, EDITS, build_sessions, stdlib_functions
from specserve.benchmark.conversations import build_conversations
from specserve.benchmark.prompts import load_dataset


def test_functions_come_from_held_out_stdlib_files_and_parse():
    functions = stdlib_functions(limit=30)
    assert len(functions) == 30
    for source, name, params in functions:
        tree = ast.parse(source)
        assert isinstance(tree.body[0], ast.FunctionDef) and tree.body[0].name == name
        assert params == [a.arg for a in tree.body[0].args.args if a.arg not in ("self", "cls")]


def test_sessions_carry_the_function_first_and_ask_an_edit_every_turn():
    sessions = build_sessions(5, 4, seed=3)
    assert len(sessions) == 5 and all(len(s) == 4 for s in sessions)
    for session in sessions:
        first = session[0]
        code = first.split("```python\n", 1)[1].split("\n```", 1)[0]
        name = ast.parse(code).body[0].name
        assert all(turn.endswith(ASK) for turn in session)
        assert "```python" not in "".join(session[1:])  # later turns ask only: the code is in the history
        edits = [turn.removeprefix(f"Here is a Python function:\n```python\n{code}\n```\n").removesuffix(" " + ASK)
                 for turn in session]
        assert len(set(edits)) == 4  # no edit asked twice while others are left
        assert any(e.startswith("Rename the function") and name in e for e in edits) or all(
            not e.startswith("Rename the function") for e in edits)
        assert all(any(e.split("`")[0] == t.split("`")[0] for t in EDITS) for e in edits)
    assert build_sessions(5, 4, seed=3) == sessions and build_sessions(5, 4, seed=4) != sessions


def test_the_bench_takes_it_as_a_data_set_and_as_conversations():
    assert build_conversations(3, 2, seed=1, dataset=DATASET) == build_sessions(3, 2, seed=1)
    firsts = load_dataset(DATASET)
    assert len(firsts) == 200 and all(p.startswith("Here is a Python function:") for p in firsts)


def test_every_turn_names_its_conversation():
    """Each conversation's turns carry one `user` (the router's session field), different per conversation."""
    import asyncio

    import numpy as np

    from specserve.benchmark.client import RequestResult
    from specserve.benchmark.conversations import execute_conversations

    class Recorder:
        def __init__(self):
            self.sent = []

        async def send(self, result: RequestResult, prompt, clock, messages=None, session=None):
            self.sent.append((session, len(messages)))
            result.sent_s = result.first_token_s = result.end_s = clock()
            result.text, result.output_tokens = "reply", 1
            return result

    class Progress:
        def advance(self, ok):
            pass

    client = Recorder()
    asyncio.run(execute_conversations(client, [["a", "b", "c"], ["d", "e"]], np.zeros(2), 4, 0.0, Progress()))
    by_session = {}
    for session, history in client.sent:
        by_session.setdefault(session, []).append(history)
    assert by_session == {"conversation-0": [1, 3, 5], "conversation-1": [1, 3]}
