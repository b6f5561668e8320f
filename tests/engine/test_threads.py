"""The contention governor: threads follow the cores other processes leave free (engine/threads.py)."""
import os

import pytest
import torch

from specserve.engine.threads import PERIOD_S, ThreadGovernor


class FakeMachine:
    """Clock and CPU tick counters the test advances: `others` cores busy besides this process's `mine`."""

    def __init__(self):
        self.now, self.machine, self.process = 0.0, 0, 0
        self.hz = os.sysconf("SC_CLK_TCK")

    def advance(self, seconds: float, others: float, mine: float = 1.0):
        self.now += seconds
        self.process += round(mine * seconds * self.hz)
        self.machine += round((mine + others) * seconds * self.hz)


@pytest.fixture
def threads_restored():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # what the governors below start with
    yield
    torch.set_num_threads(before)


def governor(fake: FakeMachine, ceiling: int = 2, cores: int = 2) -> ThreadGovernor:
    return ThreadGovernor(ceiling, cores, clock=lambda: fake.now, machine=lambda: fake.machine,
                          process=lambda: fake.process)


@pytest.mark.parametrize("others, threads", [(0.0, 2), (0.2, 2), (0.45, 2), (0.6, 1), (1.0, 1), (1.9, 1)])
def test_a_busy_core_takes_a_thread_away(others, threads, threads_restored):
    fake = FakeMachine()
    g = governor(fake)
    fake.advance(PERIOD_S * 2, others)
    assert g.tick() == threads
    assert torch.get_num_threads() == threads


def test_nothing_is_measured_before_the_period(threads_restored):
    fake = FakeMachine()
    g = governor(fake)
    fake.advance(PERIOD_S / 2, others=2.0)
    assert g.tick() == 2


def test_a_core_is_taken_back_only_when_its_load_falls_below_the_lower_mark(threads_restored):
    fake = FakeMachine()
    g = governor(fake)
    steps = [(1.0, 1), (0.4, 1), (0.35, 1), (0.2, 2), (0.4, 2), (0.7, 1)]  # (others' load, threads after)
    for others, threads in steps:
        fake.advance(PERIOD_S, others)
        assert g.tick() == threads, (others, threads)


def test_never_more_than_it_started_with_nor_less_than_one(threads_restored):
    fake = FakeMachine()
    g = governor(fake, ceiling=4, cores=8)
    fake.advance(PERIOD_S, others=2.0)  # 6 cores free, but the engine was given 4 threads
    assert g.tick() == 4
    fake.advance(PERIOD_S, others=5.6)  # 2 free
    assert g.tick() == 2
    fake.advance(PERIOD_S, others=9.0)
    assert g.tick() == 1


def test_one_thread_or_no_proc_means_no_governor():
    fake = FakeMachine()
    assert not governor(fake, ceiling=1).active
    assert not ThreadGovernor(2, 2, machine=lambda: None).active
