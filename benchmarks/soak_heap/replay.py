"""The soak's mix replayed on an EngineCore in this process (``PYTHONPATH=. python benchmarks/soak_heap/replay.py``):
RSS and malloc's bytes in use every --sample-s; SCAN=1 also lists kvloom containers and object types that grew."""
import argparse, ctypes, json, os, random, sys, time

ap = argparse.ArgumentParser()
ap.add_argument("--minutes", type=float, default=5)
ap.add_argument("--sample-s", type=float, default=20)
ap.add_argument("--conc", type=int, default=10)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--no-trim", action="store_true")
args = ap.parse_args()

from kvloom.core.worker.cpu_threads import prepare_openmp
prepare_openmp()
import torch  # noqa
from kvloom.builder import build_engine
from kvloom.core.config import EngineConfig
from kvloom.core.messages import AddRequest
from kvloom.core.sampling_params import SamplingParams
from kvloom.core.worker.cpu_malloc import release_free_memory

libc = ctypes.CDLL("libc.so.6")
class MI2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MI2

def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) >> 10

core = build_engine(EngineConfig(model=os.environ.get("MODEL", "/root/.cache/kvloom/SmolLM2-135M-Instruct.Q4_1.gguf")))
rng = random.Random(args.seed)
vocab = 40000
live: dict[str, int] = {}  # rid -> tokens to abort after (0: never)
counter = 0
t0 = time.monotonic(); next_sample = t0; next_trim = t0 + 60
done = 0; steps = 0

def add():
    global counter
    plen = rng.choice([15, 45, 110, 260]) + rng.randint(0, 12)
    ids = [rng.randrange(vocab) for _ in range(plen)]
    kind = rng.choices(["stream", "n2", "abort", "whole", "logprobs"], [40, 20, 15, 15, 10])[0]
    sp = dict(max_tokens=rng.choice([16, 32, 64]), temperature=rng.choice([0.0, 0.8]), ignore_eos=False)
    if kind == "logprobs":
        sp["logprobs"] = 3
    for _ in range(2 if kind == "n2" else 1):
        counter += 1
        rid = f"r{counter}"
        core.add_request(AddRequest(request_id=rid, prompt_token_ids=ids, sampling=SamplingParams(**sp)))
        live[rid] = 3 if kind == "abort" else 0

got: dict[str, int] = {}
while time.monotonic() - t0 < args.minutes * 60:
    while len(live) < args.conc:
        add()
    deltas = core.step(); steps += 1
    to_abort = []
    for d in deltas:
        got[d.request_id] = got.get(d.request_id, 0) + len(d.new_token_ids)
        if d.finish_reason is not None:
            live.pop(d.request_id, None); got.pop(d.request_id, None); done += 1
        elif live.get(d.request_id) and got[d.request_id] >= live[d.request_id]:
            to_abort.append(d.request_id)
    if to_abort:
        for d in core.abort_requests(to_abort):
            pass
        for rid in to_abort:
            live.pop(rid, None); got.pop(rid, None); done += 1
    now = time.monotonic()
    if not args.no_trim and now >= next_trim:
        release_free_memory(); next_trim = now + 60
    if now >= next_sample:
        mi = libc.mallinfo2()
        print(json.dumps({"t": round(now - t0), "rss": rss(), "inuse": mi.uordblks >> 20, "free": mi.fordblks >> 20,
                          "done": done, "steps": steps}), flush=True)
        next_sample = now + args.sample_s
        if os.environ.get("SCAN"):
            import gc, collections
            gc.unfreeze()
            sizes = {}
            types = collections.Counter()
            for o in gc.get_objects():
                types[type(o).__name__] += 1
                mod = type(o).__module__
                if isinstance(mod, str) and mod.startswith("kvloom") and hasattr(o, "__dict__"):
                    for k, v in vars(o).items():
                        if isinstance(v, (dict, list, set, collections.deque, collections.OrderedDict)):
                            key = f"{type(o).__name__}.{k}"
                            sizes[key] = max(sizes.get(key, 0), len(v))
            gc.freeze()
            global first_sizes, first_types
            if now - t0 > 60 and "first_sizes" not in globals():
                first_sizes, first_types = sizes, types
            elif "first_sizes" in globals():
                grown = {k: (first_sizes.get(k, 0), v) for k, v in sizes.items() if v > first_sizes.get(k, 0) + 5}
                tg = sorted(((v - first_types.get(k, 0), k) for k, v in types.items() if v - first_types.get(k, 0) > 20), reverse=True)[:12]
                print("  grown", grown, "\n  types", tg, flush=True)
