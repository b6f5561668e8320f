"""Threads for the step while other processes want cores (a contention governor).

The step's parallel regions (torch's and the C kernels', one OpenMP team) need every thread of the team at
once. While another process keeps a core busy, one of two threads is descheduled for a time slice at a time,
and every region waits for it: on the 2-core machines here a decode then takes 1.5-3x what one thread alone
takes (bench/contention.py). So the engine watches the CPU time the rest of the machine uses (/proc/stat
minus this process's own, /proc/self/stat) and runs the step on the cores left free: one thread fewer per
busy core, never more than it started with. It reads two small files every half second: nothing per step.

OpenMP's wait policy is the other half (specserve/__init__.py): threads that spin a little before they sleep
make an idle machine fast, and spinning hurts only while a core is contended, which this governor avoids.
"""
from __future__ import annotations

import logging
import os
import time

import torch

log = logging.getLogger("specserve.engine")

PERIOD_S = 0.5        # how often the load is measured
BUSY_CORE = 0.5       # another process using this much of a core takes that core from the step
FREE_AGAIN = 0.3      # ... and gives it back once it uses less (hysteresis: a load near 0.5 does not flip)


def _ticks_of_machine() -> int | None:
    """CPU time (clock ticks) spent running anything on the cores this process may run on; None off Linux."""
    try:
        cores = {f"cpu{c}" for c in os.sched_getaffinity(0)}
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu")]
    except (OSError, AttributeError):
        return None
    # user + nice + system + irq + softirq; steal (the hypervisor's other guests) is not ours to avoid
    return sum(int(v[1]) + int(v[2]) + int(v[3]) + int(v[6]) + int(v[7]) for v in lines if v[0] in cores)


def _ticks_of_process() -> int:
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))


class ThreadGovernor:
    """Call `tick()` once per step; it changes torch's thread count (which the C kernels also read) when
    the cores other processes use change. `ceiling`: the threads the engine started with."""

    def __init__(self, ceiling: int, cores: int | None = None, clock=time.monotonic, machine=_ticks_of_machine,
                 process=_ticks_of_process):
        self.ceiling = ceiling
        self.cores = cores or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
        self.clock, self.machine, self.process = clock, machine, process
        self.hz = os.sysconf("SC_CLK_TCK")
        self.threads = ceiling
        self.busy_cores = 0.0  # other processes' load at the last measurement, in cores
        self.last = None
        if ceiling > 1 and machine() is not None:
            self.last = (clock(), machine(), process())

    @property
    def active(self) -> bool:
        return self.last is not None

    def tick(self) -> int:
        """The step's thread count, measured again when PERIOD_S has passed."""
        if self.last is None:
            return self.threads
        now = self.clock()
        t, machine, process = self.last
        if now - t < PERIOD_S:
            return self.threads
        m, p = self.machine(), self.process()
        self.last = (now, m, p)
        self.busy_cores = max(0.0, ((m - machine) - (p - process)) / self.hz / (now - t))
        self.set(self._wanted())
        return self.threads

    def _wanted(self) -> int:
        busy = int(self.busy_cores + 1 - BUSY_CORE)  # cores taken: a load of 0.5 takes one, 1.5 two
        if self.cores - busy > self.threads:
            # Taking a core back only once the others' load on it fell under FREE_AGAIN.
            busy = int(self.busy_cores + 1 - FREE_AGAIN)
        return max(1, min(self.ceiling, self.cores - busy))

    def set(self, threads: int) -> None:
        if threads != self.threads:
            log.info("other processes use %.1f cores: the step runs on %d threads", self.busy_cores, threads)
            self.threads = threads
            torch.set_num_threads(threads)
