"""Text tables, JSON and PNG plots of ``engine bench`` results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvloom.bench.clients import SATURATED_BUSY, SATURATED_LAG_MS
from kvloom.bench.metrics import BURST_GAP_S, LATENCIES, PERCENTILES
from kvloom.bench.serve import level_name
from kvloom.cli.text_table import format_table
from kvloom.core.worker.cpu_threads import available_cores

BURST_WARN_SHARE = 0.1  # more than this share of ITL gaps in bursts and ITL no longer shows the step time
LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E"}
# (figure, key in a level summary, stat of a latency distribution or None)
COMPARED = [
    ("requests/s", "request_throughput", None),
    ("output tok/s", "output_throughput", None),
    ("total tok/s", "total_token_throughput", None),
    ("goodput req/s", "goodput", None),
    *[(f"{LABELS[m]} {s} ms", f"{m}_ms", s) for m in LATENCIES for s in ("mean", "p50", "p99")],
]


def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _figure(summary: dict[str, Any], key: str, stat: str | None) -> float | None:
    value = summary.get(key)
    return value.get(stat) if stat else value


def level_detail(summary: dict[str, Any]) -> str:
    """Every figure of one level: counts, throughput, and each latency's mean and percentiles."""
    s = summary
    head = (f"{level_name(s['level'])}: {s['completed']} completed, {s['failed']} failed"
            + (f", {s['incomplete']} cut off at --max-duration" if s["incomplete"] else "")
            + f" in {s['duration_s']:.2f}s; {s['request_throughput']:.2f} req/s, "
            f"{s['output_throughput']:.1f} output tok/s, {s['total_token_throughput']:.1f} total tok/s "
            f"({s['prompt_tokens']} prompt + {s['output_tokens']} output tokens)")
    if s["goodput"] is not None:
        slo = ", ".join(f"{k.removesuffix('_ms').upper()} <= {v:g} ms" for k, v in s["slo"].items() if v is not None)
        head += f"\n  goodput {s['goodput']:.2f} req/s ({slo})"
    for err in s["errors"]:
        head += f"\n  error: {err}"
    if "clients" in s:
        head += "\n  " + client_line(s)
    rows = [[LABELS[m] + " ms", *(_num(s[f"{m}_ms"][k], 2) for k in ("mean", *(f"p{p}" for p in PERCENTILES)))]
            for m in LATENCIES]
    table = format_table(["", "mean", *(f"p{p}" for p in PERCENTILES)], rows)
    return head + "\n" + "\n".join("  " + line for line in table.splitlines())


def level_warnings(s: dict[str, Any]) -> list[str]:
    """Why a level's latencies may not be the server's: a saturated load-generator process, a busy host
    (other processes held the CPUs the load generator waited for), or tokens that reached the client in
    bursts."""
    warnings = []
    if s.get("host_busy"):
        load = s.get("host_load_average")
        host = f"load average {load:g} on {available_cores()} cores" if load is not None else "its CPUs taken"
        warnings.append(
            f"the host was busy ({host}): a load-generator process waited for a CPU "
            f"{s.get('client_cpu_wait_max', 0.0):.0%} of the time while using only {s['client_busy_max']:.0%} of "
            f"a core, so its event loop woke late by {s.get('client_lag_p90_ms', 0.0):.1f} ms at p90 and its "
            "TTFT/ITL/TPOT include those waits; the client itself was not saturated (more --client-processes "
            "would not help): rerun on a quieter host, or with the server on other cores")
    if s.get("client_saturated"):
        warnings.append(
            f"a load-generator process was saturated (busiest {s['client_busy_max']:.0%} of a core, event loop "
            f"late by {s.get('client_lag_p90_ms', 0.0):.1f} ms at p90; limits {SATURATED_BUSY:.0%} and "
            f"{SATURATED_LAG_MS:g} ms): its TTFT/ITL/TPOT are partly the client's own; rerun with more "
            "--client-processes")
    share = s.get("itl_burst_share", 0.0)
    if share > BURST_WARN_SHARE:
        warnings.append(
            f"{share:.0%} of inter-token gaps were under {BURST_GAP_S * 1000:g} ms: tokens reached the client in "
            "bursts (a client behind on its reads, or a server writing several steps at once), so ITL is not the "
            "server's step time; compare TPOT, and rerun with more --client-processes")
    return warnings


def client_line(s: dict[str, Any]) -> str:
    """The load generator's own load at one level, with a warning when its timings are not the server's."""
    busy = ", ".join(f"{c['busy']:.0%}" for c in s["clients"])
    lag = max((c.get("lag_p90_ms", 0.0) for c in s["clients"]), default=0.0)
    line = (f"load generator: {s['client_processes']} client process(es), CPU busy {busy} of a core, "
            f"event loop late by {lag:.1f} ms at p90")
    for warning in level_warnings(s):
        line += f"\n  WARNING at {level_name(s['level'])}: {warning}"
    return line


def sweep_table(levels: list[dict[str, Any]]) -> str:
    """One row per level; a level timed by a saturated client process is marked and warned about."""
    header = ["level", "done", "failed", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
              "ITL p50", "ITL p99", "E2E p50", "E2E p99", "goodput", "clients", "client busy"]
    rows = [[level_name(s["level"]), s["completed"], s["failed"], _num(s["request_throughput"], 2),
             _num(s["output_throughput"]), _num(s["ttft_ms"]["p50"]), _num(s["ttft_ms"]["p99"]),
             _num(s["tpot_ms"]["p50"]), _num(s["tpot_ms"]["p99"]), _num(s["itl_ms"]["p50"]), _num(s["itl_ms"]["p99"]),
             _num(s["e2e_ms"]["p50"]), _num(s["e2e_ms"]["p99"]), _num(s["goodput"], 2), s.get("client_processes", "-"),
             _busy(s)] for s in levels]
    text = format_table(header, rows) + ("\n(latencies in ms; goodput in req/s meeting every SLO given; client busy: "
                                         "the busiest load-generator process's CPU time / wall time)")
    for s in levels:
        for warning in level_warnings(s):
            text += f"\nWARNING at {level_name(s['level'])} (marked !): {warning}."
    return text


def _busy(s: dict[str, Any]) -> str:
    if "client_busy_max" not in s:
        return "-"
    return f"{s['client_busy_max']:.0%}" + (" !" if level_warnings(s) else "")


def engine_stats_line(stats: dict[str, float]) -> str:
    """Our engine's counters over the whole run (warm-up and every level)."""
    queries, hits = stats.get("prefix_cache_queries", 0), stats.get("prefix_cache_hits", 0)
    cache = f"{hits:,.0f} of {queries:,.0f} prompt tokens from the prefix cache" if queries else "no prefix cache lookups"
    line = f"engine: {cache}, {stats.get('preemptions', 0):,.0f} preemptions"
    if "spec_decode_drafts" in stats:
        line += (f", {stats['spec_decode_drafts']:,.0f} drafts verified ({stats.get('spec_decode_accepted', 0):,.0f} "
                 f"accepted) in {stats.get('spec_decode_verify_steps', 0):,.0f} request-steps")
    return line


def comparison_table(runs: list[dict[str, Any]], level_index: int = 0) -> str:
    """A/B: each figure per combination, and its ratio to the first combination."""
    names = [r["name"] for r in runs]
    levels = [r["levels"][level_index] for r in runs]
    header = ["figure", *[names[0]], *[x for n in names[1:] for x in (n, "ratio")]]
    rows = []
    for label, key, stat in COMPARED:
        values = [_figure(s, key, stat) for s in levels]
        if all(v is None for v in values):
            continue
        row = [label, _num(values[0], 2)]
        for v in values[1:]:
            row += [_num(v, 2), _ratio(v, values[0])]
        rows.append(row)
    text = f"{level_name(levels[0]['level'])}\n" + format_table(header, rows)
    for name, s in zip(names, levels):
        for warning in level_warnings(s):
            text += f"\nWARNING: {name}: {warning}."
    return text


def _ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}x"


def write_json(data: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(runs: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Output throughput (x) against TTFT, TPOT and E2E latency (y, p50 solid and p99 dashed), one point
    per level, one line per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for run in runs:
        levels = [s for s in run["levels"] if s["completed"]]
        x = [s["output_throughput"] for s in levels]
        for ax, metric in zip(axes, ("ttft", "tpot", "e2e")):
            p50 = ax.plot(x, [s[f"{metric}_ms"]["p50"] for s in levels], "o-", label=f"{run['name']} p50")[0]
            ax.plot(x, [s[f"{metric}_ms"]["p99"] for s in levels], "s--", color=p50.get_color(), alpha=0.6,
                    label=f"{run['name']} p99")
            for s, xi in zip(levels, x):
                ax.annotate(_short_level(s["level"]), (xi, s[f"{metric}_ms"]["p50"]),
                            textcoords="offset points", xytext=(4, 4), fontsize=8)
    for ax, metric in zip(axes, ("ttft", "tpot", "e2e")):
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(f"{LABELS[metric]} (ms)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title or "throughput vs. latency (points labelled with their load level)")
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_comparison(runs: list[dict[str, Any]], path: str | Path, level_index: int = 0) -> Path:
    """Each figure's ratio to the first combination, grouped bars (1.0 = the same)."""
    plt = _pyplot()
    figures = [(label, key, stat) for label, key, stat in COMPARED if _figure(runs[0]["levels"][level_index], key, stat)]
    fig, ax = plt.subplots(figsize=(max(8, len(figures) * 0.9), 4.5))
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        s, base = run["levels"][level_index], runs[0]["levels"][level_index]
        ratios = [(_figure(s, k, st) or 0) / _figure(base, k, st) for _, k, st in figures]
        ax.bar([j + i * width for j in range(len(figures))], ratios, width, label=run["name"])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(figures))])
    ax.set_xticklabels([f[0] for f in figures], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel(f"ratio to {runs[0]['name']}")
    ax.set_title(f"A/B at {level_name(runs[0]['levels'][level_index]['level'])} "
                 "(throughput: higher is better; latency: lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, plt, path)


def _short_level(level: dict[str, Any]) -> str:
    return f"c={level['concurrency']}" if "concurrency" in level else f"{level['request_rate']:g}/s"


def _save(fig, plt, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
