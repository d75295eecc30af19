"""``engine bench serve`` and ``engine bench ab`` against the real server (a subprocess on a tiny model,
loopback only): every reported figure is present and agrees with the server's own counters."""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvloom.bench.ab import ServerProcess
from kvloom.bench.clients import ClientLoad, LoopLag, RequestCounter, client_count, split_level
from kvloom.bench.metrics import LATENCIES, PERCENTILES, SLO, RequestResult, summarize
from kvloom.bench.report import comparison_table, sweep_table
from kvloom.bench.serve import client_report
from kvloom.bench.workloads import Workload
from kvloom.cli.main import build_parser, config_flags, config_from_args, main
from kvloom.core.config import EngineConfig, default_block_size

TINY_TOKENS = "3:320"  # prompt token ids inside the tiny model's vocabulary, clear of its special tokens
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    srv = ServerProcess(["--model", str(tiny_llama), "--num-kv-blocks", "512", "--api-workers", "1"],
                        tmp_path_factory.mktemp("bench-server") / "server.log")
    try:
        srv.wait_ready(240)
        yield srv
    finally:
        srv.stop()


def token_counters(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    return samples["kvloom_prompt_tokens_total"], samples["kvloom_generation_tokens_total"]


def completions_served(url: str) -> float:
    """Successful /v1/completions requests the server counted (its one API worker's /metrics)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "kvloom_http_requests_total" and s.labels.get("path") == "/v1/completions"
               and s.labels.get("status") == "200")


def run_bench(argv, tmp_path, capsys) -> tuple[int, dict, str]:
    out = tmp_path / "bench.json"
    rc = main(["bench", *argv, "--output-json", str(out), "--no-progress"])
    printed = capsys.readouterr()
    data = json.loads(out.read_text()) if out.exists() else {}
    return rc, data, printed.out + printed.err


def check_figures(level: dict) -> None:
    """Every figure is present, percentiles are ordered, and throughputs agree with the counts."""
    for metric in LATENCIES:
        dist = level[f"{metric}_ms"]
        values = [dist[k] for k in ("mean", *(f"p{p}" for p in PERCENTILES))]
        assert all(isinstance(v, float) and v >= 0 for v in values), (metric, dist)
        assert dist["p50"] <= dist["p95"] <= dist["p99"], (metric, dist)
    assert level["ttft_ms"]["p50"] <= level["e2e_ms"]["p50"]
    d = level["duration_s"]
    assert level["request_throughput"] * d == pytest.approx(level["completed"])
    assert level["output_throughput"] * d == pytest.approx(level["output_tokens"])
    assert level["total_token_throughput"] * d == pytest.approx(level["prompt_tokens"] + level["output_tokens"])


def test_serve_sweep_figures_match_the_server(server, tmp_path, capsys):
    before = token_counters(server.url)
    argv = ["serve", "--base-url", server.url + "/v1", "--random-token-range", TINY_TOKENS, "--input-len", "8:40",
            "--output-len", "4:12", "--num-requests", "12", "--concurrency", "1,4", "--warmup-requests", "0",
            "--slo-ttft-ms", "60000", "--slo-tpot-ms", "0.001"]
    rc, data, printed = run_bench(argv, tmp_path, capsys)
    assert rc == 0, printed
    after = token_counters(server.url)

    expected = Workload(input_len=(8, 40), output_len=(4, 12), token_range=(3, 320)).requests(12)
    levels = data["levels"]
    assert [lv["level"] for lv in levels] == [{"concurrency": 1}, {"concurrency": 4}]
    for lv in levels:
        assert (lv["completed"], lv["failed"], lv["incomplete"]) == (12, 0, 0)
        assert lv["usage_reported"]
        check_figures(lv)
        # Token counts are the server's usage, and exact: token-id prompts, outputs with ignore_eos.
        assert lv["prompt_tokens"] == sum(r.prompt_len for r in expected)
        assert lv["output_tokens"] == data["expected_output_tokens"] == sum(r.output_len for r in expected)
        # A TTFT limit every request meets and a TPOT limit none can: goodput counts neither alone.
        assert lv["goodput"] == 0.0
    # ... and add up to what the server counted in the same time.
    assert after[0] - before[0] == sum(lv["prompt_tokens"] for lv in levels)
    assert after[1] - before[1] == sum(lv["output_tokens"] for lv in levels)

    table = printed[printed.index("level "):]
    assert "concurrency 1 " in table and "concurrency 4 " in table
    for figure in ("TTFT ms", "TPOT ms", "ITL ms", "E2E ms", "goodput 0.00 req/s"):
        assert figure in printed
    assert (tmp_path / "bench.png").read_bytes()[:8] == PNG_MAGIC


def test_two_client_processes_merge_into_one_report(server, tmp_path, capsys):
    """The level's requests are split over two spawned client processes; the merged report counts what the
    server counted, and its percentiles are those of all requests together."""
    before = (*token_counters(server.url), completions_served(server.url))
    rc, data, printed = run_bench(["serve", "--base-url", server.url, "--random-token-range", TINY_TOKENS,
                                   "--input-len", "8:24", "--output-len", "4:10", "--num-requests", "14",
                                   "--concurrency", "4", "--client-processes", "2", "--warmup-requests", "0",
                                   "--save-requests", "--slo-ttft-ms", "60000"], tmp_path, capsys)
    assert rc == 0, printed
    after = (*token_counters(server.url), completions_served(server.url))
    (level,) = data["levels"]
    assert (level["completed"], level["failed"], level["incomplete"]) == (14, 0, 0)
    check_figures(level)
    # Two processes each sent part of the level, and together exactly --num-requests.
    assert level["client_processes"] == 2 and [c["streams"] for c in level["clients"]] == [2, 2]
    records = level["requests"]
    assert len(records) == sum(c["requests"] for c in level["clients"]) == 14
    assert {r["client"] for r in records} == {0, 1}
    for c in level["clients"]:
        assert 0 < c["cpu_s"] and 0 < c["wall_s"] and c["busy"] == pytest.approx(c["cpu_s"] / c["wall_s"], abs=1e-3)
    # The merged counts are the server's own.
    assert after[2] - before[2] == level["completed"] == 14
    assert after[0] - before[0] == level["prompt_tokens"]
    assert after[1] - before[1] == level["output_tokens"] == data["expected_output_tokens"]
    # Percentiles over the union of both processes' records (not an average of per-process figures).
    done = [RequestResult(**r) for r in records]
    union = {"ttft_ms": [r.ttft for r in done], "e2e_ms": [r.e2e for r in done], "tpot_ms": [r.tpot for r in done],
             "itl_ms": [gap for r in done for gap in r.itls]}
    for key, values in union.items():
        p50, p95, p99 = np.percentile(np.asarray(values) * 1000, [50, 95, 99])
        assert (level[key]["p50"], level[key]["p95"], level[key]["p99"]) == pytest.approx((p50, p95, p99)), key
    assert level["duration_s"] == pytest.approx(max(r.start + r.e2e for r in done))
    recomputed = summarize(done, level["duration_s"], SLO(ttft_ms=60000))
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "goodput", "output_tokens", "prompt_tokens"):
        assert recomputed[key] == pytest.approx(level[key]), key
    assert "load generator: 2 client process(es), CPU busy" in printed


def test_levels_split_so_totals_hold():
    # Closed loop: streams add up; open loop: Poisson rates add up (R/N each), and so do the caps.
    assert [s.concurrency for s in split_level({"concurrency": 7}, 3, 100, seed=0)] == [3, 2, 2]
    rate = split_level({"request_rate": 9.0, "max_concurrency": 5}, 2, 100, seed=0)
    assert sum(s.request_rate for s in rate) == 9.0 and [s.max_concurrency for s in rate] == [3, 2]
    assert len({s.seed for s in rate}) == 2  # independent arrival streams
    burst = split_level({"request_rate": math.inf, "max_concurrency": None}, 3, 10, seed=0)
    assert [s.quota for s in burst] == [4, 3, 3]  # all at once: split by count
    # One process per 64 streams, capped by the cores and by the level's streams; an explicit count holds.
    assert client_count({"concurrency": 1}, 32, None) == 1
    assert client_count({"concurrency": 8}, 32, 4) == 4 and client_count({"concurrency": 2}, 32, 4) == 2
    assert client_count({"concurrency": 64 * 512}, 10**5, None) == len(__import__("os").sched_getaffinity(0))
    counter = RequestCounter(5)
    assert [counter.take() for _ in range(7)] == [0, 1, 2, 3, 4, None, None]


def test_a_saturated_client_is_never_shown_without_a_warning():
    level = {"level": {"concurrency": 256}, "completed": 1, "failed": 0, "request_throughput": 1.0,
             "output_throughput": 1.0, "goodput": None, "itl_burst_share": 0.0,
             **{f"{m}_ms": {"p50": 1.0, "p99": 1.0} for m in LATENCIES}}
    calm = {**level, **client_report([ClientLoad(0, 128, 10, cpu_s=3.0, wall_s=10.0, lag_p90_ms=0.4)] * 2)}
    hot = {**level, **client_report([ClientLoad(0, 128, 10, 3.0, 10.0), ClientLoad(1, 128, 10, 9.7, 10.0)])}
    # Busy for little more than half a core, yet its loop woke 6 ms late: the H200 run with one client.
    late = {**level, **client_report([ClientLoad(0, 256, 10, 5.8, 10.0, lag_p50_ms=3.0, lag_p90_ms=6.0)])}
    assert not calm["client_saturated"] and hot["client_saturated"] and hot["client_busy_max"] == 0.97
    assert late["client_saturated"] and late["client_lag_p90_ms"] == 6.0
    assert "WARNING" not in sweep_table([calm])
    table = sweep_table([calm, hot])
    assert "97% !" in table and "WARNING at concurrency 256 (marked !): a load-generator process was saturated" in table
    assert "58% !" in sweep_table([late]) and "late by 6.0 ms" in sweep_table([late])
    # Tokens read in bursts (gaps under 0.2 ms) are warned about even when no client looks busy.
    bursts = {**calm, "itl_burst_share": 0.6}
    assert "60% of inter-token gaps were under 0.2 ms" in sweep_table([bursts])
    assert "bursts" in comparison_table([{"name": "a", "levels": [calm]}, {"name": "b", "levels": [bursts]}])


def test_loop_lag_probe_sees_a_blocked_event_loop():
    async def run(block_s: float) -> dict:
        lag = LoopLag()
        lag.start()
        for _ in range(20):
            await asyncio.sleep(0.006)
            time.sleep(block_s)  # a loop busy with other streams' chunks
        return await lag.stop()

    blocked = asyncio.run(run(0.02))
    assert blocked["lag_p90_ms"] > 10  # woken about 20 ms late, whatever the machine's noise
    # Late of its own doing: it never waited for a CPU.
    assert ClientLoad(0, 1, 1, 0.1, 1.0, **blocked, cpu_wait_s=0.0).saturated


def test_a_busy_host_is_named_as_the_cause_not_the_client():
    level = {"level": {"concurrency": 4}, "completed": 1, "failed": 0, "request_throughput": 1.0,
             "output_throughput": 1.0, "goodput": None, "itl_burst_share": 0.0, "host_load_average": 5.3,
             **{f"{m}_ms": {"p50": 1.0, "p99": 1.0} for m in LATENCIES}}
    # 2% of a core, its loop 6 ms late, and 40% of the level spent waiting for a CPU others held.
    idle = ClientLoad(0, 4, 10, cpu_s=0.2, wall_s=10.0, lag_p90_ms=6.0, cpu_wait_s=4.0)
    assert idle.host_busy and not idle.saturated
    table = sweep_table([{**level, **client_report([idle])}])
    assert "the host was busy (load average 5.3" in table and "waited for a CPU 40% of the time" in table
    assert "2% of a core" in table and "was not saturated" in table
    assert "a load-generator process was saturated" not in table
    # Where the OS does not say how long it waited: that late while that idle is not its own work either.
    assert ClientLoad(0, 4, 10, 0.2, 10.0, lag_p90_ms=6.0).host_busy
    # A client busy with its own streams stays "saturated", whatever the host.
    assert ClientLoad(0, 4, 10, 9.7, 10.0, lag_p90_ms=6.0, cpu_wait_s=0.0).saturated


def test_cpu_wait_is_measured_while_another_process_holds_the_core():
    import os
    import subprocess
    import sys

    from kvloom.bench.clients import cpu_wait_seconds

    core = min(os.sched_getaffinity(0))
    spinner = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}}); "
                                "print('spinning', flush=True)\nwhile True: pass"], stdout=subprocess.PIPE, text=True)
    mask = os.sched_getaffinity(0)
    try:
        assert spinner.stdout.readline().strip() == "spinning"
        os.sched_setaffinity(0, {core})  # this thread now shares one core with the spinner
        before, end = cpu_wait_seconds(), time.monotonic() + 0.6
        while time.monotonic() < end:
            pass
        waited = cpu_wait_seconds() - before
    finally:
        os.sched_setaffinity(0, mask)
        spinner.kill()
        spinner.wait()
    assert waited > 0.1  # about half of the 0.6 s went to the spinner


def test_bursts_count_gaps_under_the_burst_gap():
    fast = RequestResult(ok=True, output_tokens=5, chunk_times=[0.1, 0.1, 0.1001, 0.12, 0.14], e2e=0.14)
    summary = summarize([fast], 1.0)
    assert summary["itl_burst_share"] == pytest.approx(0.5)  # two of the four gaps are under 0.2 ms


def test_goodput_counts_requests_within_every_slo():
    fast = RequestResult(ok=True, output_tokens=3, chunk_times=[0.01, 0.02, 0.03], e2e=0.03)
    slow = RequestResult(ok=True, output_tokens=3, chunk_times=[0.5, 0.6, 0.7], e2e=0.7)
    failed = RequestResult(error="HTTP 500")
    s = summarize([fast, slow, failed], duration=2.0, slo=SLO(ttft_ms=100))
    assert (s["completed"], s["failed"], s["goodput"], s["request_throughput"]) == (2, 1, 0.5, 1.0)
    assert s["tpot_ms"]["mean"] == pytest.approx((10 + 100) / 2)  # (e2e - ttft) / (tokens - 1)
    assert s["itl_ms"]["p50"] == pytest.approx(55)  # gaps 10, 10, 100, 100
    assert summarize([fast], 1.0)["goodput"] is None  # no SLO given


@pytest.mark.parametrize("argv", [
    ["--endpoint", "chat", "--workload", "shared-prefix", "--prefix-len", "24", "--input-len", "4",
     "--request-rate", "50"],
    ["--workload", "shared-prefix", "--num-prefixes", "2", "--prefix-len", "32", "--input-len", "4:8",
     "--random-token-range", TINY_TOKENS, "--request-rate", "inf", "--max-concurrency", "3"],
    ["--workload", "jsonl", "--prompts-file", "PROMPTS", "--endpoint", "chat", "--concurrency", "2"],
], ids=["chat-poisson", "shared-prefix-burst", "jsonl-chat"])
def test_serve_workloads_and_load_modes(server, tmp_path, capsys, argv):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "The capital of France is", "output_len": 12}\n'
                       '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]}\n')
    argv = [str(prompts) if a == "PROMPTS" else a for a in argv]
    rc, data, printed = run_bench(["serve", "--base-url", server.url, "--num-requests", "6", "--output-len", "8",
                                   "--slo-e2e-ms", "60000", *argv], tmp_path, capsys)
    assert rc == 0, printed
    (level,) = data["levels"]
    assert (level["completed"], level["failed"]) == (6, 0)
    check_figures(level)
    assert level["output_tokens"] == data["expected_output_tokens"]
    assert level["goodput"] == pytest.approx(level["request_throughput"])


def test_max_duration_cuts_a_level_off(server, tmp_path, capsys):
    rc, data, printed = run_bench(["serve", "--base-url", server.url, "--random-token-range", TINY_TOKENS,
                                   "--input-len", "8", "--output-len", "480", "--num-requests", "20",
                                   "--concurrency", "2", "--max-duration", "1", "--warmup-requests", "0"],
                                  tmp_path, capsys)
    (level,) = data["levels"]
    assert level["incomplete"] >= 1 and level["failed"] == 0, printed
    assert level["completed"] + level["incomplete"] < 20
    assert level["duration_s"] < 5
    assert "cut off at --max-duration" in printed


def test_bad_targets_and_values_are_clear_errors(capsys):
    from tests.server_utils import free_port

    assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--no-progress"]) == 1
    assert "ConnectError" in capsys.readouterr().err
    for argv, words in [(["--concurrency", "0"], "--concurrency"), (["--num-requests", "0"], "--num-requests"),
                        (["--request-rate", "1", "--concurrency", "2"], "exactly one"),
                        (["--input-len", "9:3"], "--input-len"), (["--base-url", "ftp://x"], "http://")]:
        assert main(["bench", "serve", *argv]) == 2
        assert words in capsys.readouterr().err
    assert main(["bench", "ab", "--plugins", "", "--plugins", "no_such_plugin"]) == 2  # before any server starts
    assert "no_such_plugin" in capsys.readouterr().err


def test_config_flags_give_back_the_config():
    config = EngineConfig(model="m.gguf", plugins=["sjf", "prefix_cache"], enforce_eager=True, max_num_seqs=7,
                          plugin_options={"sjf": {"aging_tokens_per_s": 5}}, kv_cache_memory_gib=0.5)
    assert config_from_args(build_parser().parse_args(config_flags(config))) == config


def test_ab_compares_two_plugin_combinations(tiny_llama, tmp_path, capsys):
    rc, data, printed = run_bench(
        ["ab", "--plugins", "", "--plugins", "prefix_cache", "--model", str(tiny_llama), "--num-kv-blocks", "256",
         "--workload", "shared-prefix", "--prefix-len", "64", "--input-len", "4", "--output-len", "4",
         "--random-token-range", TINY_TOKENS, "--num-requests", "8", "--concurrency", "4", "--client-processes", "2",
         "--log-dir", str(tmp_path / "logs")], tmp_path, capsys)
    assert rc == 0, printed
    assert data["combinations"] == ["none", "prefix_cache"]
    for run in data["runs"]:
        (level,) = run["levels"]
        assert (level["completed"], level["failed"]) == (8, 0)
        assert level["client_processes"] == 2  # the same split load generator as bench serve
        assert run["kv_cache"].startswith(f"KV cache: 256 blocks x {default_block_size('cpu')} tokens")
    # The same workload went to both servers, and each ran its own plugins.
    assert data["runs"][0]["levels"][0]["prompt_tokens"] == data["runs"][1]["levels"][0]["prompt_tokens"] == 8 * 68
    assert "prefix_cache=prefix_cache" in (tmp_path / "logs" / "server-1.log").read_text()
    assert "prefix_cache=" not in (tmp_path / "logs" / "server-0.log").read_text()
    assert data["runs"][0]["engine_stats"]["prefix_cache_hits"] == 0
    assert data["runs"][1]["engine_stats"]["prefix_cache_hits"] >= 64  # later requests reuse the shared prefix
    assert "prompt tokens from the prefix cache" in printed
    table = printed[printed.index("figure "):]
    header = table.splitlines()[0].split()
    assert header == ["figure", "none", "prefix_cache", "ratio"]
    assert "output tok/s" in table and "TTFT p50 ms" in table and "x\n" in table
    assert (tmp_path / "bench.png").read_bytes()[:8] == PNG_MAGIC


def test_ab_engine_line_shows_speculative_decodings_drafts():
    from kvloom.bench.report import engine_stats_line

    line = engine_stats_line({"preemptions": 0, "spec_decode_drafts": 1234, "spec_decode_accepted": 1000,
                              "spec_decode_verify_steps": 300})
    assert "1,234 drafts verified (1,000 accepted) in 300 request-steps" in line
    assert "drafts" not in engine_stats_line({"preemptions": 2})  # an engine without the counters
