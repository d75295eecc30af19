"""CPU threads: the engine runs as many torch threads as the cores it may use (its affinity mask) or
``--threads``, refuses more threads than cores, and bounds how long OpenMP threads spin at a barrier
(set before torch loads OpenMP), so another process on one of its cores costs that core, not a collapse."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvloom.cli.main import main
from kvloom.core.config import ConfigError, EngineConfig
from tests.server_utils import EngineServer, server_env

PROBE = """
import json, os, sys
if sys.argv[2] != "all":
    os.sched_setaffinity(0, {int(c) for c in sys.argv[2].split(",")})
from kvloom import LLM
threads = None if sys.argv[3] == "auto" else int(sys.argv[3])
try:
    llm = LLM(sys.argv[1], threads=threads, num_kv_blocks=32)
except ValueError as e:
    print(json.dumps({"error": str(e)}))
    raise SystemExit(0)
import torch
from kvloom import SamplingParams
out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
print(json.dumps({"threads": torch.get_num_threads(), "wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                  "spin_count": os.environ.get("GOMP_SPINCOUNT"),
                  "tokens": len(out)}))
"""


def probe(model, cores: str, threads: str, env_extra: dict | None = None) -> dict:
    """An offline engine in a fresh process (torch not yet loaded), restricted to ``cores``."""
    env = {**server_env(), **(env_extra or {})}
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS"):
        if env_extra is None or name not in env_extra:
            env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", PROBE, str(model), cores, threads], env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_threads_follow_the_cores_this_process_may_use(tiny_llama):
    # One core in the affinity mask: one thread, whatever the machine has.
    one = probe(tiny_llama, "0", "auto")
    assert (one["threads"], one["spin_count"], one["wait_policy"], one["tokens"]) == (1, "20000", None, 3)
    # --threads below the cores is taken as given; above them it is refused by name.
    assert probe(tiny_llama, "all", "1")["threads"] == 1
    too_many = probe(tiny_llama, "0", "2")
    assert "threads=2" in too_many["error"] and "1 cores" in too_many["error"]
    # A wait policy the user set for OpenMP itself is kept.
    user = probe(tiny_llama, "0", "auto", {"OMP_WAIT_POLICY": "ACTIVE"})
    assert (user["wait_policy"], user["spin_count"]) == ("ACTIVE", None)


def test_threads_is_a_config_key_and_a_flag(tiny_llama, tmp_path):
    with pytest.raises(ConfigError, match="threads=0"):
        EngineConfig(threads=0).validate()
    assert EngineConfig.from_dict({"threads": 1}).threads == 1
    assert main(["--model", str(tiny_llama), "--threads", "0"]) == 2
    # The server's engine process logs what it runs with.
    server = EngineServer(["--model", str(tiny_llama), "--num-kv-blocks", "64", "--threads", "1"], tmp_path)
    try:
        server.wait_ready()
        assert "CPU: 1 thread (" in server.log() and "OpenMP spin count 20000" in server.log()
    finally:
        server.stop()


class FakeMachine:
    """/proc/stat and this process's CPU time, advanced by hand: ``run(seconds, own=…, others=…,
    niced=…)`` says how many cores this engine, other processes and niced processes kept busy."""

    def __init__(self) -> None:
        self.now = self.busy = self.niced = self.own = 0.0

    def run(self, seconds: float, own: float, others: float = 0.0, niced: float = 0.0) -> None:
        self.now += seconds
        self.own += own * seconds
        self.busy += (own + others) * seconds
        self.niced += niced * seconds

    def governor(self, max_threads: int = 2, cores=(0, 1), niced_compete: bool = False):
        from kvloom.core.worker.cpu_threads import ThreadGovernor

        self.set_calls: list[int] = []
        return ThreadGovernor(max_threads, cores, interval_s=0.5, clock=lambda: self.now,
                              core_times=lambda cores: (self.busy, self.niced), own_cpu=lambda: self.own,
                              set_threads=self.set_calls.append, niced_compete=niced_compete)


def test_governor_gives_a_core_taken_by_another_process_back_and_takes_it_again_when_freed():
    m = FakeMachine()
    g = m.governor()
    m.run(0.6, own=2.0)  # quiet: both cores ours
    assert g.maybe_adjust() == 2 and m.set_calls == []
    m.run(0.6, own=1.5, others=0.5)  # a busy loop at our priority shares one core with a thread of ours
    assert g.maybe_adjust() == 1 and m.set_calls == [1]
    m.run(0.6, own=1.0, others=1.0)  # it keeps that core: one thread stays
    assert g.maybe_adjust() == 1
    m.run(0.6, own=1.0, others=0.1)  # the loop ended (a little other work is not a core): the thread comes back
    assert g.maybe_adjust() == 2 and m.set_calls == [1, 2]


def test_governor_ignores_niced_work_and_small_loads_and_does_not_flap_near_the_threshold():
    m = FakeMachine()
    g = m.governor()
    m.run(0.6, own=1.9, niced=0.1)  # a test run at nice 19 on both cores: the engine's threads win them
    assert g.maybe_adjust() == 2
    m.run(0.6, own=1.8, others=0.25)  # an API server using a quarter of a core: no thread given up
    assert g.maybe_adjust() == 2
    m.run(0.6, own=1.6, others=0.4)  # above the 0.3-core threshold: one given up
    assert g.maybe_adjust() == 1
    m.run(0.6, own=1.0, others=0.25)  # below the threshold but not by the release margin: kept at one
    assert g.maybe_adjust() == 1
    assert m.set_calls == [1]
    # An engine that runs niced itself shares its cores with niced work as with any other.
    niced = FakeMachine()
    g = niced.governor(niced_compete=True)
    niced.run(0.6, own=1.0, niced=1.0)
    assert g.maybe_adjust() == 1


def test_governor_reads_only_every_interval_and_never_goes_below_one_or_above_its_ceiling():
    m = FakeMachine()
    g = m.governor(max_threads=2, cores=(0, 1, 2, 3))
    m.run(0.2, own=2.0, others=3.5)
    assert g.maybe_adjust() == 2 and m.set_calls == []  # too soon: nothing read
    m.run(0.4, own=0.5, others=3.5)
    assert g.maybe_adjust() == 1  # three and a half of four cores taken: one thread, never zero
    m.run(0.6, own=1.0, others=0.0)
    assert g.maybe_adjust() == 2  # four free cores, but no more than the ceiling of two


def test_an_engine_with_threads_set_or_one_core_keeps_its_count(tiny_llama):
    from kvloom import LLM

    assert LLM(tiny_llama, threads=1, num_kv_blocks=32).engine.thread_governor is None
    assert LLM(tiny_llama, adaptive_threads=False, num_kv_blocks=32).engine.thread_governor is None
