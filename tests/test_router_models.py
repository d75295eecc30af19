"""Several models behind one real server: two tiny models of different families served by name from
``[[models]]`` tables, each answering as it does served alone, over HTTP and the ZMQ gateway; the 404
naming the served models; /v1/models; per-model metrics (latencies, counts, engine series); and the
config checks (repeated --model NAME=PATH, memory shares)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvloom.cli.main import build_parser, config_from_args, served_models_from_args, server_config_from_args
from kvloom.client import AsyncClient, Client, GatewayError
from kvloom.core.config import ConfigError, EngineConfig
from kvloom.launch.served_models import ServedModel, check_memory_shares
from tests.conftest import make_tiny_model
from tests.server_utils import EngineServer, free_port

PROMPTS = ["Once upon a time", "The capital of France is", "1, 2, 3, 4,", "def fib(n):"]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-models"), "qwen3", seed=1)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 1.0, "seed": 3}


def greedy(server: EngineServer, model: str, prompt: str) -> str:
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": 12, "ignore_eos": True, "temperature": 0.0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def alone(tiny_llama, tiny_qwen3, tmp_path_factory):
    """Each model's answers served alone: texts(), a chat, greedy completions of PROMPTS. The servers run
    one at a time, before the two-model one, so that the module never holds three servers' processes."""
    tmp = tmp_path_factory.mktemp("alone")
    answers = {}
    for name, args in (
        ("llama", ["--model", f"llama={tiny_llama}", "--num-kv-blocks", "96", "--max-model-len", "256",
                   "--max-num-seqs", "8"]),
        ("qwen", ["--model", f"qwen={tiny_qwen3}", "--num-kv-blocks", "64", "--max-model-len", "128",
                  "--max-num-seqs", "8", "--plugins", "prefix_cache"]),
    ):
        with EngineServer(args, tmp) as srv:
            chat = httpx.post(srv.url + "/v1/chat/completions", json={"model": name, **CHAT}, timeout=60).json()
            answers[name] = {"texts": texts(srv, name), "chat": chat["choices"][0]["message"],
                             "greedy": {prompt: greedy(srv, name, prompt) for prompt in PROMPTS[:2]}}
    return answers


@pytest.fixture(scope="module")
def servers(alone, tiny_llama, tiny_qwen3, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("models")
    port = free_port()
    config = tmp / "two.toml"
    gateway = f"ipc://{tmp}/gw.sock"
    config.write_text(f'port = {port}\nmax_num_seqs = 8\ngateway = "{gateway}"\n'
                      f'[[models]]\nname = "llama"\nmodel = "{tiny_llama}"\nnum_kv_blocks = 96\nmax_model_len = 256\n'
                      f'[[models]]\nname = "qwen"\nmodel = "{tiny_qwen3}"\nnum_kv_blocks = 64\nmax_model_len = 128\n'
                      'plugins = ["prefix_cache"]\n')
    started = {"both": EngineServer(["--config", str(config)], tmp, port=port)}
    started["both"].gateway = gateway
    try:
        for s in started.values():
            s.wait_ready()
        yield started
    finally:
        for s in started.values():
            s.stop()


def texts(server: EngineServer, model: str) -> list[str]:
    out = []
    for i, prompt in enumerate(PROMPTS):
        for extra in ({"temperature": 0.0}, {"temperature": 1.0, "seed": i}):
            r = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"model": model, "prompt": prompt, "max_tokens": 12, "ignore_eos": True, **extra})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
            out.append(r.json()["choices"][0]["text"])
    return out


def test_two_models_answer_by_name_as_each_does_alone(servers, alone):
    both = servers["both"]
    for name in ("llama", "qwen"):
        assert texts(both, name) == alone[name]["texts"], name
    # A chat goes to its model too (each model's own tokenizer and template).
    for name in ("llama", "qwen"):
        got = httpx.post(both.url + "/v1/chat/completions", json={"model": name, **CHAT}, timeout=60).json()
        assert got["choices"][0]["message"] == alone[name]["chat"]


def test_models_list_unknown_model_404_and_per_model_limits(servers):
    both = servers["both"]
    listed = httpx.get(both.url + "/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in listed] == [("llama", 256), ("qwen", 128)]
    assert httpx.get(both.url + "/v1/models/qwen", timeout=10).json()["id"] == "qwen"

    r = httpx.post(both.url + "/v1/completions", json={"model": "gpt-4", "prompt": "hi", "max_tokens": 2}, timeout=10)
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["param"] == "model" and "`gpt-4` does not exist" in error["message"]
    assert "`llama`" in error["message"] and "`qwen`" in error["message"]
    assert httpx.get(both.url + "/v1/models/gpt-4", timeout=10).status_code == 404

    # Each model validates against its own context: 200 prompt tokens fit llama's 256, not qwen's 128.
    long = {"prompt": [5] * 200, "max_tokens": 4}
    assert httpx.post(both.url + "/v1/completions", json={**long, "model": "llama"}, timeout=60).status_code == 200
    r = httpx.post(both.url + "/v1/completions", json={**long, "model": "qwen"}, timeout=60)
    assert r.status_code == 400 and "maximum context length is 128" in r.json()["error"]["message"]
    tok = httpx.post(both.url + "/tokenize", json={"model": "qwen", "prompt": "hello"}, timeout=10).json()
    assert tok["max_model_len"] == 128


def test_metrics_and_health_name_each_model(servers):
    from prometheus_client.parser import text_string_to_metric_families

    both = servers["both"]
    text = httpx.get(both.url + "/metrics", timeout=10).text
    blocks = {s.labels["model"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
              if s.name == "kvloom_kv_cache_total_blocks"}
    assert blocks == {"llama": 96, "qwen": 64}
    health = httpx.get(both.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and sorted(health["models"]) == ["llama", "qwen"]


def test_the_gateway_serves_each_model_by_name(servers, alone):
    both, gateway = servers["both"], servers["both"].gateway
    with Client(gateway, timeout=60) as gw:
        pong = gw.ping()
        assert pong.healthy and pong.models == ["llama", "qwen"] and (pong.model, pong.max_model_len) == ("llama", 256)
        for name in ("llama", "qwen"):
            for prompt in PROMPTS[:2]:
                got = gw.generate(prompt, model=name, max_tokens=12, ignore_eos=True, temperature=0.0)
                assert got.text == alone[name]["greedy"][prompt], (name, prompt)
        # No model named: the first one answers.
        assert (gw.generate(PROMPTS[0], max_tokens=12, ignore_eos=True, temperature=0.0).text
                == gw.generate(PROMPTS[0], model="llama", max_tokens=12, ignore_eos=True, temperature=0.0).text)
        with pytest.raises(GatewayError) as err:
            gw.generate("hi", model="gpt-4", max_tokens=2)
        assert err.value.status == 404
        assert "`gpt-4` does not exist" in err.value.message and "`llama`, `qwen`" in err.value.message
        # Each model's own limit: 200 prompt tokens fit llama's 256, not qwen's 128.
        assert gw.generate(prompt_token_ids=[5] * 200, model="llama", max_tokens=2).finish_reason == "length"
        with pytest.raises(GatewayError, match="128") as err:
            gw.generate(prompt_token_ids=[5] * 200, model="qwen", max_tokens=2)
        assert err.value.status == 400

    async def both_at_once():  # concurrent streams to both models over one connection
        async with AsyncClient(gateway, timeout=60) as gw:
            return await asyncio.gather(*(gw.generate(PROMPTS[2], model=name, max_tokens=8, ignore_eos=True,
                                                      temperature=0.0) for name in ("llama", "qwen", "llama")))

    llama, qwen, llama_again = asyncio.run(both_at_once())
    assert llama.text == llama_again.text
    for name, got in (("llama", llama), ("qwen", qwen)):
        alone = httpx.post(both.url + "/v1/completions", timeout=60, json={
            "model": name, "prompt": PROMPTS[2], "max_tokens": 8, "ignore_eos": True, "temperature": 0.0}).json()
        assert got.text == alone["choices"][0]["text"], name


def model_samples(url: str) -> dict[tuple[str, str], float]:
    """{(sample name, model): value}, summed over other labels but a histogram's ``le`` (dropped:
    only ``_count`` and ``_sum`` are read) and the HTTP path and status (kept as part of the name)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if "le" in s.labels or "model" not in s.labels:
                continue
            name = s.name if "path" not in s.labels else f"{s.name}{{{s.labels['path']},{s.labels['status']}}}"
            out[name, s.labels["model"]] = out.get((name, s.labels["model"]), 0.0) + s.value
    return out


def test_latency_metrics_and_counts_carry_each_model(servers):
    both = servers["both"]
    before = model_samples(both.url)
    sent = {"llama": 2, "qwen": 3}
    for name, count in sent.items():
        for i in range(count):
            r = httpx.post(both.url + "/v1/completions", timeout=60, json={
                "model": name, "prompt": PROMPTS[i], "max_tokens": 5, "ignore_eos": True})
            assert r.status_code == 200, r.text
    after = model_samples(both.url)

    def delta(name: str, model: str) -> float:
        return after.get((name, model), 0.0) - before.get((name, model), 0.0)

    for model, count in sent.items():
        for histogram in ("kvloom_time_to_first_token_seconds", "kvloom_time_per_output_token_seconds",
                          "kvloom_request_latency_seconds"):
            assert delta(histogram + "_count", model) == count, (histogram, model)
        assert delta("kvloom_request_success_total", model) == count
        assert delta("kvloom_generation_tokens_total", model) == 5 * count
        assert delta("kvloom_http_requests_total{/v1/completions,200}", model) == count
        # The engine's series: one replica per model, counted once (here: the prefix cache only qwen has).
        assert after["kvloom_engine_healthy", model] == 1
    assert after["kvloom_kv_cache_total_blocks", "llama"] == 96 and after["kvloom_kv_cache_total_blocks", "qwen"] == 64
    assert delta("kvloom_prefix_cache_queries_total", "qwen") > 0 == delta("kvloom_prefix_cache_queries_total", "llama")


# --- the config, without a server ------------------------------------------------------------------
def parse(argv: list[str]) -> tuple[list[ServedModel] | None, object]:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    return served_models_from_args(args, config, server_config_from_args(args))


def test_repeated_model_flags_name_each_model(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    models, server = parse(["--model", f"small={a}", "--model", f"big={b}", "--dtype", "float32"])
    assert [(m.name, m.engine.model, m.engine.dtype) for m in models] == [("small", str(a), "float32"),
                                                                           ("big", str(b), "float32")]
    models, server = parse(["--model", f"small={a}"])
    assert models is None and server.served_model_name == "small"
    with pytest.raises(ConfigError, match="the served model name 'x' is given twice"):
        parse(["--model", f"x={a}", "--model", f"x={b}"])


def test_models_tables_take_engine_keys_and_refuse_bad_ones(tmp_path):
    config = tmp_path / "m.toml"
    config.write_text('dtype = "float32"\n[[models]]\nname = "a"\nmodel = "/m/a"\nmax_model_len = 64\n'
                      '[[models]]\nname = "b"\nmodel = "/m/b"\nplugins = ["prefix_cache"]\n')
    models, _ = parse(["--config", str(config)])
    assert [(m.name, m.engine.max_model_len, m.engine.plugins, m.engine.dtype) for m in models] == [
        ("a", 64, [], "float32"), ("b", None, ["prefix_cache"], "float32")]
    config.write_text('[[models]]\nname = "a"\nmodel = "/m/a"\nmax_num_seqz = 4\n')
    with pytest.raises(ConfigError, match="unknown config keys \\['max_num_seqz'\\]"):
        parse(["--config", str(config)])
    config.write_text('[[models]]\nmodel = "/m/a"\n')
    with pytest.raises(ConfigError, match="table 1 needs a name"):
        parse(["--config", str(config)])
    config.write_text('[[models]]\nname = "a"\nmodel = "/m/a"\n')
    with pytest.raises(ConfigError, match="either as \\[\\[models\\]\\] tables .* or as --model"):
        parse(["--config", str(config), "--model", "b=/m/b"])


def test_memory_shares_are_checked_before_anything_loads():
    two = [ServedModel("big", EngineConfig(model="x", gpu_memory_utilization=0.7)),
           ServedModel("small", EngineConfig(model="y", gpu_memory_utilization=0.4))]
    with pytest.raises(ConfigError, match=r"shares add up to 1.1 \(big=0.7, small=0.4\), over the 1.0 of one GPU"):
        check_memory_shares(two, "cuda")
    two[1].engine = two[1].engine.replace(gpu_memory_utilization=0.25)
    check_memory_shares(two, "cuda")
    cpu = [ServedModel("a", EngineConfig(model="x", kv_cache_memory_gib=6.0)),
           ServedModel("b", EngineConfig(model="y", kv_cache_memory_gib=3.0))]
    with pytest.raises(ConfigError, match=r"kv_cache_memory_gib add up to 9 GiB \(a=6, b=3\), more than the 6.0 GiB"):
        check_memory_shares(cpu, "cpu", total_cpu_gib=8.0)
    check_memory_shares(cpu, "cpu", total_cpu_gib=16.0)


def test_the_cli_refuses_two_models_for_one_model_commands(tmp_path, capsys):
    from kvloom.cli.main import main

    assert main(["generate", "--model", "a=/m/a", "--model", "b=/m/b", "--prompt", "hi"]) == 2
    assert "runs one model: give --model once" in capsys.readouterr().err
