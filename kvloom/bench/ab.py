"""``engine bench ab``: start the server once per plugin combination (same model, same options), run the
same load against each, and compare every figure with the first combination."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from kvloom.bench.serve import LoadSpec, run_sweep
from kvloom.bench.workloads import Workload
from kvloom.core.config import EngineConfig

SERVING_LINE = re.compile(r"Serving the OpenAI API on (http://[^\s]+?:\d+)")
KV_LINE = re.compile(r"(KV cache: .*)$", re.MULTILINE)
STOP_TIMEOUT_S = 60.0
ENGINE_COUNTERS = {"preemptions": "kvloom_num_preemptions_total",
                   "prefix_cache_queries": "kvloom_prefix_cache_queries_total",
                   "prefix_cache_hits": "kvloom_prefix_cache_hits_total",
                   "spec_decode_drafts": "kvloom_spec_decode_num_draft_tokens_total",
                   "spec_decode_accepted": "kvloom_spec_decode_num_accepted_tokens_total",
                   "spec_decode_verify_steps": "kvloom_spec_decode_num_verify_steps_total"}


def combination_name(plugins: list[str]) -> str:
    return ",".join(plugins) or "none"


class ServerProcess:
    """``engine`` serving on a free loopback port, its log in a file; stopped with SIGTERM (then SIGKILL
    of the process group it leads)."""

    def __init__(self, engine_args: list[str], log_path: Path) -> None:
        kvloom_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [kvloom_root, env.get("PYTHONPATH")]))
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvloom.cli", "--log-level", "info", *engine_args, "--host", "127.0.0.1", "--port", "0"],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        self.url: str | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode}; its log:\n{self.log()[-3000:]}")
            if self.url is None and (m := SERVING_LINE.search(self.log())):
                self.url = m.group(1)
            if self.url is not None:
                try:
                    if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                        return self.url
                except httpx.HTTPError:
                    pass
            time.sleep(0.25)
        raise RuntimeError(f"the server was not healthy within {timeout:g}s; its log:\n{self.log()[-3000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group this server leads
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def engine_stats(url: str) -> dict[str, float]:
    """The engine's counters from our server's /metrics after the load (preemptions, prefix-cache hits,
    speculative decoding's drafts)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    samples: dict[str, float] = {}
    for s in (s for fam in text_string_to_metric_families(text) for s in fam.samples):
        samples[s.name] = samples.get(s.name, 0.0) + s.value  # summed over the replicas' series
    return {key: samples[name] for key, name in ENGINE_COUNTERS.items() if name in samples}


def run_ab(config: EngineConfig, combinations: list[list[str]], spec: LoadSpec, workload: Workload,
           engine_args: Callable[[EngineConfig], list[str]], *, start_timeout: float = 900.0,
           log_dir: str | None = None, on_level=None) -> dict[str, Any]:
    """One server per combination, started and stopped in turn; ``engine_args`` turns a config into flags."""
    configs = [config.replace(plugins=list(c)) for c in combinations]
    log_root = Path(log_dir or tempfile.mkdtemp(prefix="kvloom-ab-"))
    log_root.mkdir(parents=True, exist_ok=True)
    runs = []
    for i, c in enumerate(configs):
        name = combination_name(c.plugins)
        server = ServerProcess(engine_args(c), log_root / f"server-{i}.log")
        try:
            url = server.wait_ready(start_timeout)
            result = run_sweep(dataclasses.replace(spec, base_url=url, model=None), workload,
                               on_level=(lambda s, name=name: on_level(name, s)) if on_level else None)
            stats = engine_stats(url)
        finally:
            server.stop()
        kv = KV_LINE.search(server.log())
        runs.append({"name": name, "plugins": c.plugins, "kv_cache": kv.group(1) if kv else None,
                     "engine_stats": stats, "server_log": str(server.log_path), **result})
    return {"model": config.model, "combinations": [r["name"] for r in runs], "runs": runs}
