"""The ``engine bench serve`` and ``engine bench ab`` subcommands: their flags and what they print."""

from __future__ import annotations

import argparse
import logging
import math
import sys

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the parser is built on every ``engine`` start: no numpy/httpx imports until a bench runs
    from kvloom.bench.serve import LoadSpec
    from kvloom.bench.workloads import Workload


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _float_list(text: str) -> list[float]:
    return [math.inf if x.strip() in ("inf", "infinity") else float(x) for x in text.split(",") if x.strip()]


def add_load_flags(parser: argparse.ArgumentParser) -> None:
    load = parser.add_argument_group("load (one level, or a comma-separated list to sweep)")
    load.add_argument("--concurrency", type=_int_list, metavar="N[,N...]",
                      help="Closed loop: keep N requests in flight (default: 1 unless --request-rate is given).")
    load.add_argument("--request-rate", type=_float_list, metavar="R[,R...]",
                      help="Open loop: Poisson arrivals at R requests/s (inf: all at once).")
    load.add_argument("--max-concurrency", type=int, help="With --request-rate: most requests in flight.")
    load.add_argument("--num-requests", type=int, default=32, help="Requests per level.")
    load.add_argument("--max-duration", type=float, default=600.0,
                      help="Seconds per level; requests still running then are cut off and counted apart.")
    load.add_argument("--request-timeout", type=float, default=600.0, help="Seconds one request may take.")
    load.add_argument("--warmup-requests", type=int, default=1, help="Requests sent before the first level, not counted.")
    load.add_argument("--client-processes", type=int, metavar="N",
                      help="Load-generator processes per level; the level's streams, rate and cap are split over "
                           "them and their requests merged (default: one per 64 streams, at most the available "
                           "cores). A client busy for most of a core times itself, not the server: the report "
                           "warns when one was.")

    work = parser.add_argument_group("workload")
    work.add_argument("--workload", choices=("random", "shared-prefix", "jsonl"), default="random",
                      help="random: prompts of --input-len random token ids; shared-prefix: one of "
                           "--num-prefixes shared prefixes of --prefix-len tokens (a system prompt) followed by "
                           "--input-len distinct ones (a question); jsonl: prompts from --prompts-file.")
    work.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                      help="/v1/completions (synthetic prompts as token ids: exact lengths) or "
                           "/v1/chat/completions (synthetic prompts as words).")
    work.add_argument("--input-len", default="128", metavar="N|LOW:HIGH", help="Prompt (or question) length.")
    work.add_argument("--output-len", default="32", metavar="N|LOW:HIGH",
                      help="Output tokens (max_tokens; exact with --ignore-eos). JSONL lines may set output_len.")
    work.add_argument("--random-token-range", default="1000:10000", metavar="LOW:HIGH",
                      help="Synthetic prompt token ids are drawn from [LOW, HIGH): keep it inside the vocabulary.")
    work.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens (or words) of each prefix.")
    work.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: distinct prefixes, used in turn.")
    work.add_argument("--prompts-file", help='jsonl: lines {"prompt": ...} or {"messages": [...]}, optional "output_len".')
    work.add_argument("--workload-seed", type=int, default=0, help="Seed of the workload and of the Poisson arrivals.")
    work.add_argument("--temperature", type=float, default=0.0)
    work.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                      help="Ask the server to ignore EOS so outputs have exactly --output-len tokens.")

    report = parser.add_argument_group("objectives and report")
    report.add_argument("--slo-ttft-ms", type=float, help="Goodput counts requests with TTFT at most this.")
    report.add_argument("--slo-tpot-ms", type=float, help="... and TPOT at most this.")
    report.add_argument("--slo-e2e-ms", type=float, help="... and end-to-end latency at most this.")
    report.add_argument("--output-json", metavar="PATH",
                        help="Write every figure as JSON here, and the plot as a PNG beside it.")
    report.add_argument("--save-requests", action="store_true",
                        help="Keep every request's record (start, chunk arrival times, tokens, client process) in "
                             "the JSON, to recompute any figure.")
    report.add_argument("--no-progress", action="store_true", help="No progress bar.")


def add_bench_parser(sub, add_engine_flags) -> None:
    bench = sub.add_parser("bench", help="Load tests: 'bench serve' against a server, 'bench ab' of plugin "
                                         "combinations.")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="{serve,ab}", required=True)
    serve = bench_sub.add_parser(
        "serve", help="Load an OpenAI-compatible server (ours or another) and report throughput and latency.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Load an OpenAI-compatible endpoint by fixed concurrency or Poisson request rate; report "
                    "TTFT, TPOT, ITL and end-to-end latency (mean, p50, p95, p99), throughput and goodput. "
                    "Only the --base-url given is contacted.")
    target = serve.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="The server (with or without /v1).")
    target.add_argument("--model", dest="target_model", help="Model name to send (default: the first of /v1/models).")
    target.add_argument("--api-key", help="Sent as 'Authorization: Bearer KEY'.")
    add_load_flags(serve)

    ab = bench_sub.add_parser(
        "ab", help="Start the engine once per plugin combination, run the same load, compare.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Start 'engine' once per --plugins combination on the same model and options (loopback, a "
                    "free port), run the same load against each, and print each figure with its ratio to the "
                    "first combination. Example: engine bench ab --plugins '' --plugins prefix_cache "
                    "--workload shared-prefix --concurrency 8")
    ab.add_argument("--plugins", dest="combinations", action="append", required=True, metavar="A,B",
                    help="A plugin combination (repeat for each; '' for none).")
    ab.add_argument("--server-start-timeout", type=float, default=900.0, help="Seconds to wait for each server.")
    ab.add_argument("--log-dir", help="Keep the servers' logs here (default: a temporary folder).")
    add_load_flags(ab)
    add_engine_flags(ab, skip=("plugins",))


def load_from_args(args: argparse.Namespace, **target) -> tuple[LoadSpec, Workload]:
    from kvloom.bench.metrics import SLO
    from kvloom.bench.serve import LoadSpec
    from kvloom.bench.workloads import Workload, parse_range

    if args.concurrency is None and args.request_rate is None:
        args.concurrency = [1]
    spec = LoadSpec(
        num_requests=args.num_requests, concurrency=args.concurrency or [], request_rate=args.request_rate or [],
        max_concurrency=args.max_concurrency, max_duration_s=args.max_duration, request_timeout_s=args.request_timeout,
        warmup_requests=args.warmup_requests, ignore_eos=args.ignore_eos, sampling={"temperature": args.temperature},
        slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms), client_processes=args.client_processes,
        save_requests=args.save_requests, progress=not args.no_progress, **target,
    )
    spec.validate()
    token_range = parse_range(args.random_token_range, "--random-token-range")
    if token_range[1] <= token_range[0]:
        raise ValueError(f"--random-token-range={args.random_token_range!r}: need LOW < HIGH")
    workload = Workload(
        kind=args.workload, endpoint=args.endpoint, input_len=parse_range(args.input_len, "--input-len"),
        output_len=parse_range(args.output_len, "--output-len"), token_range=token_range, prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes, prompts_file=args.prompts_file, seed=args.workload_seed,
    )
    if workload.kind == "jsonl" and not workload.prompts_file:
        raise ValueError("--workload jsonl needs --prompts-file FILE.jsonl")
    if workload.prefix_len < 1 or workload.num_prefixes < 1:
        raise ValueError("--prefix-len and --num-prefixes must be >= 1")
    return spec, workload


def _print_level(summary, name: str | None = None) -> None:
    from kvloom.bench.report import level_detail

    print((f"[{name}] " if name else "") + level_detail(summary), flush=True)


def run_bench(args: argparse.Namespace, config, config_flags) -> int:
    """Run ``bench serve`` or ``bench ab`` (with the engine ``config`` and ``config_flags``, which turns a
    config into ``engine`` flags for each server it starts)."""
    try:
        import httpx
    except ImportError:
        print("engine bench: error: httpx is missing; pip install 'kvloom[bench]'", file=sys.stderr)
        return 2

    from kvloom.bench import report

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise

    try:
        if args.bench_command == "serve":
            spec, workload = load_from_args(args, base_url=args.base_url, model=args.target_model,
                                            api_key=args.api_key)
        else:
            from kvloom.plugins.manager import PluginManager

            spec, workload = load_from_args(args)
            combos = [[p.strip() for p in c.split(",") if p.strip()] for c in args.combinations]
            for combo in combos:  # an unknown plugin or a conflict fails before any server starts
                PluginManager.from_config(config.replace(plugins=combo))
    except (ValueError, OSError) as e:
        print(f"engine bench: error: {e}", file=sys.stderr)
        return 2
    try:
        if args.bench_command == "serve":
            from kvloom.bench.serve import run_sweep

            result = run_sweep(spec, workload, on_level=_print_level)
            runs = [dict(result, name=result["model"])]
            print("\n" + report.sweep_table(result["levels"]))
        else:
            from kvloom.bench.ab import run_ab

            result = run_ab(config, combos, spec, workload, config_flags, start_timeout=args.server_start_timeout,
                            log_dir=args.log_dir, on_level=lambda name, s: _print_level(s, name))
            runs = result["runs"]
            for run in runs:
                print(f"\n{run['name']}: {run['kv_cache'] or ''}\n{report.engine_stats_line(run['engine_stats'])}\n"
                      + report.sweep_table(run["levels"]))
            for i in range(len(spec.levels())):
                print("\n" + report.comparison_table(runs, i))
    except httpx.HTTPError as e:
        where = e.request.url if getattr(e, "_request", None) is not None else "the server"
        print(f"engine bench: error: {type(e).__name__} from {where}: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError, RuntimeError) as e:
        print(f"engine bench: error: {e}", file=sys.stderr)
        return 1
    if args.output_json:
        path = report.write_json(result, args.output_json)
        png = path.with_suffix(".png")
        try:
            if args.bench_command == "serve" or len(spec.levels()) > 1:
                report.plot_sweep(runs, png)
            else:
                report.plot_comparison(runs, png)
            print(f"\nWrote {path} and {png}")
        except ImportError:
            print(f"\nWrote {path} (no plot: matplotlib is missing; pip install 'kvloom[bench]')")
    return 0 if all(s["completed"] for run in runs for s in run["levels"]) else 1
