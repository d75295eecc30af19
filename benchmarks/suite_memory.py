"""Peak memory of a pytest run: summed PSS and RSS of pytest and every process it spawned, sampled twice a
second, with the test running at the peak, each test file's own peak and the wall time.

    python benchmarks/suite_memory.py [--interval 0.5] [--json OUT.json] -- -q tests/test_server.py

PSS (from /proc/PID/smaps_rollup) divides each shared page among the processes that map it, so the sum is
what the run really holds; summed RSS counts a shared page once per process (an upper bound). This file
is also the pytest plugin (``-p suite_memory``) that writes the running test's node id to a file."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

CURRENT_TEST_ENV = "KVLOOM_SUITE_MEMORY_CURRENT"
KiB = 1024


# --- the pytest plugin: loaded in the pytest process by ``-p suite_memory`` -----------------------------
def pytest_runtest_logstart(nodeid, location):
    path = os.environ.get(CURRENT_TEST_ENV)
    if path:
        # Write then rename: the sampler never reads a half-written id.
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(nodeid)
        os.replace(tmp, path)


# --- the sampler ----------------------------------------------------------------------------------------
def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants (a process whose parent died is re-parented and lost from view)."""
    children = _children_map()
    out, todo = [root], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def pss_rss(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of one process in bytes; (0, 0) once it is gone."""
    pss = rss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1]) * KiB
                elif line.startswith("Rss:"):
                    rss = int(line.split()[1]) * KiB
    except (OSError, ValueError):
        pass
    return pss, rss


def command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return ""


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0] if nodeid else "(collection / start-up)"


class Sampler:
    def __init__(self, root: int, current_path: Path, interval: float) -> None:
        self.root, self.current_path, self.interval = root, current_path, interval
        self.peak_pss = self.peak_rss = 0
        self.peak_pss_test = self.peak_rss_test = ""
        self.peak_pss_procs = 0
        self.peak_breakdown: list[tuple[int, int, int, str]] = []  # (pid, PSS, RSS, command) at the PSS peak
        self.per_file: dict[str, dict] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def current_test(self) -> str:
        try:
            return self.current_path.read_text()
        except OSError:
            return ""

    def sample(self) -> None:
        pids = process_tree(self.root)
        pss = rss = 0
        each = []
        for pid in pids:
            p, r = pss_rss(pid)
            pss += p
            rss += r
            each.append((pid, p, r))
        test = self.current_test()
        self.samples += 1
        if pss > self.peak_pss:
            self.peak_pss, self.peak_pss_test, self.peak_pss_procs = pss, test, len(pids)
            self.peak_breakdown = [(pid, p, r, command(pid)) for pid, p, r in each]
        if rss > self.peak_rss:
            self.peak_rss, self.peak_rss_test = rss, test
        entry = self.per_file.setdefault(file_of(test), {"peak_pss": 0, "peak_rss": 0, "test": "", "procs": 0})
        if pss > entry["peak_pss"]:
            entry.update(peak_pss=pss, test=test, procs=len(pids))
        entry["peak_rss"] = max(entry["peak_rss"], rss)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: pytest's arguments")
    args = ap.parse_args(argv)
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args

    current = Path(f"/tmp/suite_memory-{os.getpid()}.current")
    env = dict(os.environ)
    env[CURRENT_TEST_ENV] = str(current)
    # This file's directory on the path so that pytest can load it as the plugin ``suite_memory``.
    here = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "pytest", "-p", "suite_memory", *pytest_args]
    print("running:", " ".join(cmd), flush=True)
    load_before = os.getloadavg()
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env)
    sampler = Sampler(proc.pid, current, args.interval)
    sampler.start()
    try:
        rc = proc.wait()
    finally:
        sampler.stop()
        current.unlink(missing_ok=True)
        Path(str(current) + ".tmp").unlink(missing_ok=True)
    wall = time.monotonic() - started
    load_after = os.getloadavg()

    print(f"\npytest exit status {rc}, wall time {wall:.0f} s, {sampler.samples} samples every {args.interval} s")
    print(f"load average (1/5/15 min) before {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, "
          f"after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f}")
    print(f"peak summed PSS {gib(sampler.peak_pss)} ({sampler.peak_pss_procs} processes) during "
          f"{sampler.peak_pss_test or '(start-up)'}")
    for pid, p, r, cmd in sorted(sampler.peak_breakdown, key=lambda e: -e[1]):
        if p >= 16 << 20:  # the processes that matter
            print(f"    {p / (1 << 20):7.0f} MiB PSS {r / (1 << 20):7.0f} MiB RSS  pid {pid}  {cmd}")
    print(f"peak summed RSS {gib(sampler.peak_rss)} during {sampler.peak_rss_test or '(start-up)'}")
    rows = sorted(sampler.per_file.items(), key=lambda kv: -kv[1]["peak_pss"])
    print("\nper test file (peak while its tests ran, by PSS):")
    for name, e in rows:
        print(f"  {gib(e['peak_pss']):>10} PSS  {gib(e['peak_rss']):>10} RSS  {e['procs']:3d} procs  {name}  "
              f"[{e['test'].split('::', 1)[-1] if '::' in e['test'] else ''}]")
    if args.json:
        args.json.write_text(json.dumps({
            "command": cmd, "exit_status": rc, "wall_s": round(wall, 1), "interval_s": args.interval,
            "load_before": load_before, "load_after": load_after,
            "peak_pss_bytes": sampler.peak_pss, "peak_pss_test": sampler.peak_pss_test,
            "peak_rss_bytes": sampler.peak_rss, "peak_rss_test": sampler.peak_rss_test,
            "peak_pss_processes": sampler.peak_breakdown, "per_file": dict(rows),
        }, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
