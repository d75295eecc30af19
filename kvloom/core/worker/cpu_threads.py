"""How many CPU threads the engine runs, and how they wait for one another.

PyTorch's CPU build runs its parallel loops and oneDNN's matmuls on one GNU OpenMP team. By default
a thread that finishes its share spins about 300,000 polls (milliseconds) at the barrier before it
sleeps. On a machine where another process holds one of our cores, the thread that shares that core
is preempted in the middle of its share; the others spin on their cores waiting for it, so the
kernel finds no idle core to move the preempted thread to, and every parallel region waits out the
other process's time slice (milliseconds, against regions of tens of microseconds): the 4-8x
collapse. Waiting passively (sleep at once) frees the core but pays a wake-up at every region, much
slower on a quiet machine (docs/benchmarks.md). The engine bounds the spin instead
(``GOMP_SPINCOUNT``, a tenth of a millisecond or so): back-to-back regions of a step still find their
threads awake, and a thread waiting for a preempted one sleeps soon enough for the kernel to move
that one onto its core. Threads are not bound to cores, for the same reason. OpenMP reads these
settings once, when the library loads: they must be in the environment before torch is imported,
which the engine process and ``kvloom.LLM`` do through ``prepare_openmp``; a process that imported
torch first keeps OpenMP's defaults (``benchmarks/cpu_contention.py`` compares the settings).

No wait policy alone degrades in proportion to the core lost, and a passive wait costs the quiet machine
(docs/benchmarks.md, ``benchmarks/cpu_contention.py``). ``ThreadGovernor`` therefore runs one thread fewer
for each core another process at the engine's priority keeps busy, and takes it back when that core is free
again.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time

from kvloom.core.config import ConfigError

logger = logging.getLogger("kvloom")

# OpenMP settings of the engine process; a value the user set for OpenMP itself is kept.
OPENMP_ENVIRONMENT = {"GOMP_SPINCOUNT": "20000"}
OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")  # any of these: the user chose
# oneDNN's primitive cache and PyTorch's ideep cache above it keep one entry, with its memory, per input
# shape of a bf16 matmul or a packed linear; attention's shapes change with every step's lengths, so at
# their default (1,024 entries each) an engine grew by ~1 GB before they filled. Each is set unless the
# user set it.
ONEDNN_ENVIRONMENT = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256", "LRU_CACHE_CAPACITY": "256"}


def available_core_ids() -> list[int]:
    """The cores this process may run on (its affinity mask, e.g. under taskset or a cpuset)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return list(range(os.cpu_count() or 1))


def available_cores() -> int:
    """How many cores this process may run on, not the machine's count."""
    return len(available_core_ids())


def prepare_openmp() -> bool:
    """Put the engine's OpenMP and oneDNN cache settings in this process's environment; True if they
    can still take effect (torch, and with it OpenMP and oneDNN, not loaded yet)."""
    if "torch" in sys.modules:
        return False
    if not any(name in os.environ for name in OPENMP_VARIABLES):
        os.environ.update(OPENMP_ENVIRONMENT)
    for name, value in ONEDNN_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    return True


def configure_threads(threads: int | None) -> int:
    """Set torch's intra-op threads: ``threads``, or the available cores. More threads than cores
    would have two threads of one team share a core, the collapse described above, so it is refused."""
    import torch

    cores = available_cores()
    if threads is not None and threads > cores:
        raise ConfigError(f"threads={threads} is more than the {cores} cores this process may run on "
                          f"(its affinity mask)")
    n = threads or cores
    torch.set_num_threads(n)
    logger.info("CPU: %d thread%s (%d core%s available), OpenMP spin count %s, wait policy %s", n, "s" * (n != 1),
                cores, "s" * (cores != 1), os.environ.get("GOMP_SPINCOUNT", "default"),
                os.environ.get("OMP_WAIT_POLICY", "default"))
    return n


# --- fewer threads while other processes hold cores -------------------------------------------------
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def read_core_times(cores) -> tuple[float, float] | None:
    """Seconds the given cores spent busy since boot: (at normal priority or above, at a positive nice
    value), from /proc/stat; None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy = niced = 0
    wanted = {f"cpu{c}" for c in cores}
    for line in lines:
        name, _, rest = line.partition(" ")
        if name not in wanted:
            continue
        # user nice system idle iowait irq softirq steal (guest time is inside user already)
        v = [int(x) for x in rest.split()[:8]]
        busy += v[0] + v[2] + v[5] + v[6] + v[7]
        niced += v[1]
    return busy / CLOCK_TICKS, niced / CLOCK_TICKS


class ThreadGovernor:
    """Runs the engine's OpenMP team on the cores other processes leave free.

    A team of N threads is as fast as its slowest thread at every barrier, so one core taken by another process
    at the engine's priority slows every parallel region to the pace of the thread sharing that core, below what
    one thread on the free core keeps (docs/benchmarks.md). Every ``interval_s`` (checked between steps) the
    governor reads how much of the engine's cores other processes used (/proc/stat less this process's own CPU
    time; processes at a larger nice value than the engine's are left out, since the engine's threads win their
    cores from them) and sets torch's thread count to the cores that are left, never more than ``max_threads``
    nor fewer than one. It takes a thread back once the others use less than ``release`` of a core more than the
    ``take`` threshold that made it drop one, so a load near the threshold does not make the team flap.
    """

    def __init__(self, max_threads: int, cores, interval_s: float = 0.5, take: float = 0.3,
                 release: float = 0.15, clock=time.monotonic, core_times=read_core_times,
                 own_cpu=lambda: sum(os.times()[:2]), set_threads=None, niced_compete: bool | None = None) -> None:
        self.max_threads, self.cores = max_threads, sorted(cores)
        self.interval_s, self.take, self.release = interval_s, take, release
        self._clock, self._core_times, self._own_cpu = clock, core_times, own_cpu
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self._set_threads = set_threads
        self.threads = max_threads
        self.others = 0.0  # cores other processes used over the last interval
        # An engine that is itself niced competes with other niced work as with any other.
        self._count_niced = os.getpriority(os.PRIO_PROCESS, 0) > 0 if niced_compete is None else niced_compete
        self._last = self._sample()
        self.enabled = self._last is not None

    def _sample(self):
        times = self._core_times(self.cores)
        if times is None:
            return None
        busy, niced = times
        return self._clock(), busy + (niced if self._count_niced else 0.0), self._own_cpu()

    def maybe_adjust(self) -> int:
        """Called between steps; returns the thread count the next step runs with."""
        if not self.enabled or self._clock() - self._last[0] < self.interval_s:
            return self.threads
        now = self._sample()
        (t0, busy0, own0), (t1, busy1, own1) = self._last, now
        self._last = now
        self.others = max(0.0, (busy1 - busy0) - (own1 - own0)) / max(t1 - t0, 1e-9)
        free = len(self.cores) - math.ceil(self.others - self.take)
        if free > self.threads:  # growing back: the others must be clearly below the threshold
            free = len(self.cores) - math.ceil(self.others - self.take + self.release)
        target = max(1, min(self.max_threads, free))
        if target != self.threads:
            logger.info("CPU: other processes use %.1f of this engine's %d cores: %d thread%s", self.others,
                        len(self.cores), target, "s" * (target != 1))
            self._set_threads(target)
            self.threads = target
        return self.threads
