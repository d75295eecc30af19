"""vLLM's per-request metric series (prompt and generation tokens, the most tokens of a prompt's n
completions, prefill and decode time) on the real server, and the shipped Grafana dashboard
(docs/grafana/kvloom.json): every PromQL query in it parsed, and every series and label it names
found in a live /metrics."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.server_utils import REPO_ROOT, EngineServer, metric_samples


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    srv = EngineServer(["--model", str(tiny_llama), "--num-kv-blocks", "256"], tmp_path_factory.mktemp("metrics"))
    with srv:
        yield srv


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


# --- metrics: vLLM's per-request series, and the Grafana dashboard's queries ---------------------------
def test_per_request_token_and_phase_histograms(server):
    before = metric_samples(server.url)
    prompt = post(server, "/tokenize", {"prompt": "count me in"}).json()["count"]
    r = post(server, "/v1/completions", {"prompt": "count me in", "max_tokens": 5, "ignore_eos": True, "n": 2})
    assert r.status_code == 200
    after = metric_samples(server.url)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("kvloom_request_prompt_tokens_count") == 2 and grew("kvloom_request_prompt_tokens_sum") == 2 * prompt
    assert grew("kvloom_request_generation_tokens_count") == 2 and grew("kvloom_request_generation_tokens_sum") == 10
    # one prompt, n=2: one observation of the most either completion generated
    assert grew("kvloom_request_max_num_generation_tokens_count") == 1
    assert grew("kvloom_request_max_num_generation_tokens_sum") == 5
    for phase in ("prefill", "decode"):
        assert grew(f"kvloom_request_{phase}_time_seconds_count") == 2
        assert grew(f"kvloom_request_{phase}_time_seconds_sum") > 0


def dashboard_queries() -> list[str]:
    dash = json.loads((REPO_ROOT / "docs" / "grafana" / "kvloom.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_grafana_dashboard_queries_name_only_series_kvloom_serves(server):
    import promql_parser

    post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    post(server, "/v1/completions", {"prompt": "x", "max_tokens": -1})  # a refusal: kvloom_rejections_total
    text = httpx.get(server.url + "/metrics", timeout=10).text
    served = {line.split("{")[0].split()[0] for line in text.splitlines() if line and not line.startswith("#")}
    labels = set(re.findall(r"[{,]([a-z_]+)=", text))
    queries = dashboard_queries()
    assert len(queries) >= 20
    for query in queries:
        # Grafana fills these in; anything else must be PromQL as Prometheus reads it.
        expr = query.replace("$__rate_interval", "5m").replace("$model", ".*")
        if expr.startswith("label_values("):
            metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", expr).groups()
            assert metric in served and label in labels, query
            continue
        selectors = []
        promql_parser.walk(promql_parser.parse(expr),
                           lambda node: selectors.append(node) if isinstance(node, promql_parser.VectorSelector)
                           else None)
        assert selectors, query
        for sel in selectors:
            assert sel.name in served, f"{sel.name} (in {query}) is not in /metrics"
            assert all(m.name in labels for m in sel.matchers.matchers), query
