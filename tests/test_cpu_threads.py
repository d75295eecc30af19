"""CPU threads: the engine runs as many torch threads as the cores it may use (its affinity mask) or
``--threads``, refuses more threads than cores, and bounds how long OpenMP threads spin at a barrier
(set before torch loads OpenMP), so another process on one of its cores costs that core, not a collapse."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvloom.cli import main
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
