"""Replicas as Ray actors behind the same router: ``engine --ray-address local --data-parallel-size 2``
starts a Ray cluster on this machine, one engine actor per replica; requests land on both, outputs are
the same on each, and SIGTERM stops the actors with the server. Skipped without Ray (kvloom[ray])."""

from __future__ import annotations

import httpx
import pytest

from tests.server_utils import EngineServer, alive

ray = pytest.importorskip("ray", reason="the Ray path needs the kvloom[ray] extra (pip install 'kvloom[ray]')")


def test_two_ray_replicas_serve_behind_the_router(tiny_llama, tmp_path):
    server = EngineServer(["--model", str(tiny_llama), "--num-kv-blocks", "128", "--ray-address", "local",
                           "--data-parallel-size", "2", "--routing-policy", "round_robin"], tmp_path)
    try:
        server.wait_ready(timeout=400)
        children = server.descendants()
        engines = [pid for pid in children if "kvloom.launch.engine_process" in open(f"/proc/{pid}/cmdline").read()]
        assert len(engines) == 2  # under the Ray actors, in this server's process tree
        body = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 1.0, "seed": 5, "ignore_eos": True}
        texts = [httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
                 for _ in range(4)]
        assert len(set(texts)) == 1 and texts[0]  # round-robin: two on each replica, the same text
        health = httpx.get(server.url + "/health", timeout=10).json()
        assert health["status"] == "ok"
        assert [(r["healthy"], r["num_routed"]) for r in health["replicas"]] == [(True, 2), (True, 2)]
    finally:
        code = server.stop(timeout=120)
    assert code == 0, server.log()[-3000:]
    assert not [pid for pid in engines if alive(pid)], "engine actors outlived the server"
