"""glibc malloc settings for CPU inference.

PyTorch's CPU tensors come straight from ``malloc``. glibc serves blocks above its mmap threshold
(128 KiB, rising to at most 32 MiB as such blocks are freed) with fresh ``mmap`` calls and returns
freed heap tops to the kernel past its trim threshold, so every step's activations (megabytes: a
4,096-token prefill's MLP output is 50 MB in float32) are page-faulted in again, zeroed by the
kernel, on every layer. The usual cure is to preload tcmalloc or jemalloc (vLLM's and Intel's CPU
guides); the same effect without a preload is to raise both thresholds so freed blocks stay in the
heap and are reused, which makes prefill and decode faster in both dtypes (docs/benchmarks.md). The cost is
that the process keeps its peak heap instead of handing it back, which is what an inference engine wants
anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger("kvloom")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def keep_freed_memory(mmap_threshold: int = 1 << 30, trim_threshold: int = 4 << 30) -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once). False where the C library
    is not glibc (musl, macOS, Windows) or refuses; nothing else changes then."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, min(mmap_threshold, 2**31 - 1)) == 1
    ok = ok and mallopt(_M_TRIM_THRESHOLD, min(trim_threshold, 2**31 - 1)) == 1
    if ok:
        _done = True
        logger.info("CPU: glibc malloc keeps freed blocks (mmap threshold %d MiB, trim threshold %d MiB)",
                    mmap_threshold >> 20, min(trim_threshold, 2**31 - 1) >> 20)
    return ok


def release_free_memory() -> bool:
    """Give the free pages of every malloc arena back to the kernel (glibc's ``malloc_trim``). With
    freed blocks kept (``keep_freed_memory``) a long-running engine's heap only grows as blocks of new
    sizes miss the holes it has; the engine calls this now and then (every ``HEAP_TRIM_INTERVAL_S``),
    so its resident memory is what is in use, at the cost of re-faulting the pages one step touches
    again. False where the C library has no ``malloc_trim``."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True

