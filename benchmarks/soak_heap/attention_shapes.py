"""Random bf16 attention shapes in a loop (``python benchmarks/soak_heap/attention_shapes.py N [random|few]``):
RSS and malloc's bytes in use every 500, to see whether the capped oneDNN/ideep caches creep as they evict."""
import sys
from kvloom.core.worker.cpu_threads import prepare_openmp
prepare_openmp()
import random, torch, ctypes, time
from kvloom.core.worker.cpu_malloc import keep_freed_memory, release_free_memory
keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
class MI2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MI2
def rss_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) // 1024
def anon_other():
    tot=0; cur=False
    for line in open("/proc/self/smaps"):
        f=line.split(None,1)[0]
        if "-" in f and not f.endswith(":"):
            cur = len(line.split()) < 6
        elif f=="Rss:" and cur:
            tot+=int(line.split()[1])
    return tot>>10
rng = random.Random(0)
N = int(sys.argv[1]); mode = sys.argv[2] if len(sys.argv) > 2 else "random"
t0=time.time()
for i in range(N):
    if mode == "random":
        queries, keys = rng.randint(1, 600), rng.randint(1, 600)
    else:  # few shapes
        queries, keys = rng.randint(1, 600), rng.randint(1, 600)
        queries, keys = -(-queries // 32) * 32, -(-keys // 32) * 32
    scores = torch.randn(3, queries, 64, dtype=torch.bfloat16) @ torch.randn(3, 64, keys, dtype=torch.bfloat16)
    scores @ torch.randn(3, keys, 64, dtype=torch.bfloat16)
    if i % 500 == 499:
        release_free_memory()
        mi = libc.mallinfo2()
        print(i+1, "rss", rss_mb(), "inuse", mi.uordblks>>20, "free", mi.fordblks>>20, "anon_nonheap", anon_other(), f"{time.time()-t0:.0f}s", flush=True)
