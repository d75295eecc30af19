"""kvloom's own C++ kernels for the CPU, built with the machine's compiler the first time they are needed and kept
under ``~/.cache/kvloom/kernels`` by source, compiler, flags and CPU (a later start loads one in milliseconds).
Built with the C++ compiler directly rather than through inductor's cache, whose import and ISA probes cost several
seconds a process. The libraries are loaded with ctypes; their OpenMP loops run on torch's own OpenMP runtime
(torch has loaded its libgomp, so ``libgomp.so.1`` resolves to it) and thread count."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

# tried in turn: a compiler or CPU that refuses one set gets the next
FLAG_SETS = (["-O3", "-march=native", "-ffast-math", "-fopenmp"], ["-O3", "-ffast-math", "-fopenmp"],
             ["-O3", "-ffast-math"])


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvloom", "kernels")


def cpu_signature() -> str:
    """What ``-march=native`` compiles for: a library built on another CPU (a shared home folder) is not reused."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.processor() + platform.machine()


def build_library(name: str, source: str, flag_sets=FLAG_SETS, link: tuple[str, ...] = ()) -> str:
    """The path of ``source`` compiled to a shared library (built now unless a build of the same source, compiler,
    flags and CPU is cached); ``link``: libraries to link, after the source (a linker that drops libraries nothing
    before them needs would drop them ahead of it). Raises RuntimeError with each flag set's error when no build
    works."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++ on PATH, or CXX)")
    os.makedirs(cache_dir(), exist_ok=True)
    errors = []
    for flags in flag_sets:
        parts = [source, cxx, *flags, *(["--", *link] if link else []), cpu_signature()]
        key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]
        path = os.path.join(cache_dir(), f"{name}_{key}.so")
        if os.path.exists(path):
            return path
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            src, out = os.path.join(tmp, f"{name}.cpp"), os.path.join(tmp, f"{name}.so")
            with open(src, "w") as f:
                f.write(source)
            done = subprocess.run([cxx, *flags, "-std=c++17", "-shared", "-fPIC", src, *link, "-o", out],
                                  capture_output=True, text=True, timeout=300)
            if done.returncode == 0:
                os.replace(out, path)  # atomic: a process building beside this one loads a whole file
                return path
            errors.append(f"{' '.join(flags)}: {done.stderr.strip().splitlines()[-1:] or done.returncode}")
    raise RuntimeError("; ".join(errors))
