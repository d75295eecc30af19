"""How many CPU threads the engine runs, and how they wait for one another.

PyTorch's CPU build runs its parallel loops and oneDNN's matmuls on one GNU OpenMP team. By default
a thread that finishes its share spins about 300,000 polls (milliseconds) at the barrier before it
sleeps. On a machine where another process holds one of our cores, the thread that shares that core
is preempted in the middle of its share; the others spin on their cores waiting for it, so the
kernel finds no idle core to move the preempted thread to, and every parallel region waits out the
other process's time slice (milliseconds, against regions of tens of microseconds): the 4-8x
collapse. Waiting passively (sleep at once) frees the core but pays a wake-up at every region, which
an earlier session measured as much slower on a quiet machine. The engine bounds the spin instead
(``GOMP_SPINCOUNT``, a tenth of a millisecond or so): back-to-back regions of a step still find their
threads awake, and a thread waiting for a preempted one sleeps soon enough for the kernel to move
that one onto its core. Threads are not bound to cores, for the same reason. OpenMP reads these
settings once, when the library loads: they must be in the environment before torch is imported,
which the engine process and ``kvloom.LLM`` do through ``prepare_openmp``; a process that imported
torch first keeps OpenMP's defaults (``benchmarks/cpu_contention.py`` compares the settings).
"""

from __future__ import annotations

import logging
import os
import sys

from kvloom.core.config import ConfigError

logger = logging.getLogger("kvloom")

# OpenMP settings of the engine process; a value the user set for OpenMP itself is kept.
OPENMP_ENVIRONMENT = {"GOMP_SPINCOUNT": "20000"}
OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")  # any of these: the user chose


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. under taskset or a cpuset), not the
    machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def prepare_openmp() -> bool:
    """Put the engine's OpenMP settings in this process's environment; True if they can still take
    effect (torch, and with it OpenMP, not loaded yet)."""
    if "torch" in sys.modules:
        return False
    if not any(name in os.environ for name in OPENMP_VARIABLES):
        os.environ.update(OPENMP_ENVIRONMENT)
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
