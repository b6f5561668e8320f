"""The CPU and commit a benchmark names (specserve/benchmark/machine.py)."""
import pytest

from specserve.benchmark import machine
from specserve.settings import settings

CPUINFO = "processor\t: 0\nmodel name\t: Example CPU 9000\nflags\t\t: fpu sse2 {flags}\n\n"


@pytest.mark.parametrize("flags, isa", [("avx2 avx512f avx512_vnni", "AVX-512"), ("avx2 fma", "AVX2"),
                                        ("sse4_2", "no AVX2"), ("avx512fx", "no AVX2")])
def test_cpu_name_names_the_widest_vector_set(monkeypatch, flags, isa):
    monkeypatch.setattr(machine, "_cpuinfo", lambda: CPUINFO.format(flags=flags))
    assert machine.cpu_name() == f"Example CPU 9000, {isa}"


def test_without_cpuinfo_the_name_comes_from_platform(monkeypatch):
    monkeypatch.setattr(machine, "_cpuinfo", lambda: "")
    monkeypatch.setattr(machine.platform, "processor", lambda: "")
    assert machine.cpu_model() == "?" and machine.cpu_name() == "?, no AVX2"


def test_outside_a_checkout_the_commit_is_the_default(monkeypatch, tmp_path):
    monkeypatch.setattr(settings, "commit", None)
    monkeypatch.setattr(machine, "REPO", tmp_path)
    assert machine.git_commit("?") == "?"


def test_a_named_commit_wins_over_the_checkouts(monkeypatch):
    """A lent device's copy of the tree carries a stale .git (a GPU run once recorded the session's first
    commit): the caller names the commit."""
    monkeypatch.setattr(settings, "commit", "abc1234")
    assert machine.git_commit("?") == "abc1234"
