"""Engine supervision (engine/async_engine.py): an engine process that dies or hangs fails what is in flight at
once, a new one serves again, and a crash loop makes the server exit non-zero. Chaos by signal: SIGKILL (what the
OOM killer does) and SIGSTOP (a step that never ends). Every wait is for an event, with a hang guard only."""
import asyncio
import os
import signal

import httpx

from tests.server.conftest import PACED, ServerProcess, all_in_server, long_body, read_stream, tiny_args, wait_until

RESTART_GUARD_S = 180  # a new engine process loads the model again: a hang guard, not a speed


def _server(tiny_target, log_path, *extra) -> ServerProcess:
    return ServerProcess(tiny_args(tiny_target, "--speculative-config", "none", *extra), log_path, env=PACED)


def _healthy(server) -> bool:
    try:
        return httpx.get(server.root + "/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def _serves(server) -> bool:
    r = httpx.post(server.base_url + "/completions", timeout=60, json={"prompt": "again", "max_tokens": 3})
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


async def _streams_when(server, n: int, act) -> list[dict]:
    """n long streams (paced: >= 20 s each on any machine); `act()` once all n run; their ends."""
    url = server.base_url + "/completions"
    streams = [asyncio.create_task(read_stream(url, long_body(1000))) for _ in range(n)]
    await all_in_server(server, n, running=n)
    act()
    return await asyncio.wait_for(asyncio.gather(*streams), 60)


def test_a_killed_engine_fails_its_streams_and_a_new_one_serves(tiny_target, tmp_path):
    server = _server(tiny_target, tmp_path / "kill.log")
    try:
        first = server.engine_pid
        ends = asyncio.run(_streams_when(server, 6, lambda: os.kill(first, signal.SIGKILL)))
        for end in ends:  # each ends at once with an error event and [DONE], none runs to its 1000 tokens
            assert end["done"] and "exited (-9)" in end["error"], end
        assert wait_until(lambda: _healthy(server), timeout=RESTART_GUARD_S), server.log
        assert server.engine_pid != first and _serves(server)
        assert server.metric("specserve:engine_restarts_total") == 1
        assert "serving again (restart 1)" in server.log and "Traceback" not in server.log
    finally:
        assert server.stop() == 0


def test_a_hung_engine_is_killed_and_replaced(tiny_target, tmp_path):
    server = _server(tiny_target, tmp_path / "hang.log", "--engine-stall-timeout", "2")
    try:
        first = server.engine_pid
        ends = asyncio.run(_streams_when(server, 2, lambda: os.kill(first, signal.SIGSTOP)))  # a step never ends
        for end in ends:
            assert end["done"] and "hung" in end["error"], end
        assert wait_until(lambda: _healthy(server), timeout=RESTART_GUARD_S), server.log
        assert server.engine_pid != first and _serves(server)
        assert server.metric("specserve:engine_restarts_total") == 1
    finally:
        server.stop()


def test_a_crash_loop_makes_the_server_exit_non_zero(tiny_target, tmp_path):
    server = _server(tiny_target, tmp_path / "loop.log", "--engine-restarts", "1")
    try:
        first = server.engine_pid
        os.kill(first, signal.SIGKILL)  # one death is survived...
        assert wait_until(lambda: _healthy(server) and server.engine_pid != first, timeout=RESTART_GUARD_S)
        os.kill(server.engine_pid, signal.SIGKILL)  # ...a second within the window is a crash loop
        assert server.proc.wait(RESTART_GUARD_S) != 0
        assert "2 engine deaths within 600 s, more than --engine-restarts 1" in server.log
        assert "error: the engine died and was not restarted" in server.log
    finally:
        server.stop()


def test_with_no_restarts_the_first_death_ends_the_server(tiny_target, tmp_path):
    server = _server(tiny_target, tmp_path / "once.log", "--engine-restarts", "0")
    try:
        os.kill(server.engine_pid, signal.SIGKILL)
        assert server.proc.wait(RESTART_GUARD_S) != 0
        assert "exited (-9)" in server.log and "Traceback" not in server.log
    finally:
        server.stop()
