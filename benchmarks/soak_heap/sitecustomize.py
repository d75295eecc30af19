"""Where an engine's memory is, for benchmarks/soak.py: on ``PYTHONPATH`` with ``KVLOOM_DIAG_OUT=FILE`` set, the
engine process appends a JSON line every 30 s (smaps by kind, glibc's mallinfo2, gc counts); others ignore it."""
import os
from pathlib import Path

_cmd = Path("/proc/self/cmdline").read_bytes()
if os.environ.get("KVLOOM_DIAG_OUT") and b"kvloom.launch.engine_process" in _cmd:
    import threading

    def _run():
        import collections
        import ctypes
        import gc
        import json
        import time
        import tracemalloc

        out = open(os.environ["KVLOOM_DIAG_OUT"], "a")
        use_tm = os.environ.get("KVLOOM_DIAG_TM") == "1"
        if use_tm:
            tracemalloc.start(int(os.environ.get("KVLOOM_DIAG_TM_FRAMES", "4")))
        libc = ctypes.CDLL("libc.so.6")

        class MI2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in
                        ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                         "fordblks", "keepcost")]

        libc.mallinfo2.restype = MI2
        libc.fopen.restype = ctypes.c_void_p
        libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
        t0 = time.time()
        base = None
        base_types = None
        period = float(os.environ.get("KVLOOM_DIAG_S", "30"))
        n = 0
        while True:
            time.sleep(period)
            n += 1
            row = {"t": round(time.time() - t0, 1)}
            for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
                k = line.split(":")[0]
                if k in ("Rss", "Anonymous", "Pss_Anon", "Pss_File", "Private_Dirty", "Swap"):
                    row[k] = int(line.split()[1]) // 1024
            row["maps"] = len(Path("/proc/self/maps").read_text().splitlines())
            anon_big = 0
            for line in Path("/proc/self/maps").read_text().splitlines():
                parts = line.split()
                if len(parts) < 6:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    if hi - lo >= 1 << 20:
                        anon_big += hi - lo
            row["anon_maps_ge1M_MB"] = anon_big >> 20
            cat = {"heap": 0, "arena64": 0, "anon1M": 0, "anon_other": 0, "file": 0}
            cur = None
            for line in Path("/proc/self/smaps").read_text().splitlines():
                first = line.split(None, 1)[0]
                if "-" in first and not first.endswith(":"):
                    parts = line.split()
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    size = hi - lo
                    if len(parts) >= 6 and parts[5] == "[heap]":
                        cur = "heap"
                    elif len(parts) >= 6:
                        cur = "file"
                    elif size == 1 << 20:
                        cur = "anon1M"
                    elif lo % (64 << 20) == 0 and size <= 64 << 20:
                        cur = "arena64"
                    else:
                        cur = "anon_other"
                elif first == "Rss:" and cur:
                    cat[cur] += int(line.split()[1])
            row.update({k: v >> 10 for k, v in cat.items()})
            mi = libc.mallinfo2()
            row.update({k: getattr(mi, k) >> 20 for k in ("arena", "hblkhd", "uordblks", "fordblks", "keepcost")})
            row["hblks"] = mi.hblks
            path = f"/tmp/kvloom_malloc_info_{os.getpid()}.xml".encode()
            f = libc.fopen(path, b"w")
            libc.malloc_info(0, f)
            libc.fclose(f)
            xml = Path(path.decode()).read_text()
            row["n_arenas"] = xml.count("<heap nr=")
            row["gc_objects"] = len(gc.get_objects())
            if n % 2 == 0:
                counts = collections.Counter(type(o).__name__ for o in gc.get_objects())
                if base_types is None and row["t"] > 100:
                    base_types = counts
                elif base_types is not None:
                    diff = {k: counts[k] - base_types.get(k, 0) for k in counts}
                    row["types_grown"] = sorted(((v, k) for k, v in diff.items() if v > 50), reverse=True)[:10]
                # container sizes of kvloom objects
                sizes = {}
                for o in gc.get_objects():
                    mod = type(o).__module__
                    if not isinstance(mod, str):
                        continue
                    if mod.startswith("kvloom") and hasattr(o, "__dict__"):
                        for k, v in vars(o).items():
                            if isinstance(v, (dict, list, set, collections.deque)) and len(v) > 20:
                                key = f"{type(o).__name__}.{k}"
                                sizes[key] = max(sizes.get(key, 0), len(v))
                row["containers"] = sizes
            if use_tm:
                row["tm_MB"] = tracemalloc.get_traced_memory()[0] >> 20
                snap = tracemalloc.take_snapshot()
                if base is None and row["t"] > 120:
                    base = snap
                elif base is not None:
                    stats = snap.compare_to(base, "traceback")[:8]
                    row["tm_top"] = [(s.size_diff >> 10, s.count_diff, [f"{fr.filename.split('site-packages/')[-1]}:{fr.lineno}"
                                      for fr in s.traceback][-4:]) for s in stats]
            out.write(json.dumps(row) + "\n")
            out.flush()

    def _safe():
        try:
            _run()
        except Exception as e:  # noqa: BLE001 - a diagnostic must not take the engine down
            with open(os.environ["KVLOOM_DIAG_OUT"], "a") as f:
                f.write(f'{{"error": {repr(e)!r}}}\n')

    threading.Thread(target=_safe, daemon=True, name="kvloom-diag").start()
