"""What structured outputs cost: TPOT of the same batch of concurrent chat requests through kvloom's
LLM, unconstrained and under a JSON Schema, a regex and a choice-free EBNF grammar, in one run; prints a
table and JSON with each mode's TPOT and its ratio to unconstrained.

    python benchmarks/structured_output.py                              # SmolLM2 on this machine
    python benchmarks/structured_output.py --mask-fill-only             # the host's mask fill per step only
    python benchmarks/export_tokenizer.py && python benchmarks/structured_output.py --device cuda \
        --shape qwen3-0.6b --tokenizer .smollm2-tokenizer --output-len 256 --repeat 3   # the H200, no download

``--shape`` serves dummy weights of a known shape (benchmarks/shapes.py) with SmolLM2's tokenizer and
vocabulary: random weights write nonsense, but the grammar still forces valid output, so the mask path's
cost per token is measured all the same. ``--shape-overrides`` shrinks it to check the script on a CPU.

TPOT per request is (finish - first token) / (tokens - 1); a constrained request can end early when its
grammar completes, so tokens per mode are printed beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvloom import LLM, SamplingParams
from kvloom.core.sampling_params import StructuredOutputSpec

SMOLLM2_VOCAB = {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2}

ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
        "required": ["name", "age", "tags"], "additionalProperties": False}
MODES = {
    "free": None,
    "json_schema": StructuredOutputSpec(kind="json", spec=json.dumps({"type": "array", "items": ITEM})),
    "regex": StructuredOutputSpec(kind="regex", spec=r"([A-Z][a-z]{2,9} [0-9]{1,4}(, )?)+"),
    # Words and separators, the repetition written inline: the same language as "root ::= item+ / item ::=
    # [a-z]+ sep", whose masks xgrammar fills ~4000x slower (173 ms a mask against 0.04 ms, docs/benchmarks.md).
    "grammar": StructuredOutputSpec(kind="grammar", spec='root ::= ([a-z]+ ("," | " " | "\\n"))+'),
}
PROMPT = "List people with their name, age and tags, as many as you can."


def run(llm: LLM, prompts: list[str], spec, args) -> dict:
    # The constrained modes may finish early (a completed grammar allows only EOS); ignore_eos keeps the
    # unconstrained one at full length, and every mode is measured per token.
    params = SamplingParams(temperature=args.temperature, seed=args.seed, max_tokens=args.output_len,
                            ignore_eos=spec is None, structured=spec)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tpots, tokens = [], 0
    for o in outs:
        n = len(o.outputs[0].token_ids)
        tokens += n
        if n > 1:
            tpots.append((o.metrics.finish_time - o.metrics.first_token_time) / (n - 1))
    # Every prompt is the same and so is the seed: a mode whose language lets the first token end the
    # output (EOS allowed at once) ends every request there, and that round has no TPOT to give.
    return {"tpot_ms": 1000 * statistics.mean(tpots) if tpots else None, "tokens": tokens, "wall_s": wall}


def mask_fill_only(llm: LLM, prompts: list[str], modes: list[str], args) -> dict:
    """Time what a constrained step costs the host: filling one mask per request for 16 requests (the
    engine's own ``StructuredOutputManager.fill_bitmasks``), step by step along a real generation of
    each mode (the tokens the model wrote under it, replayed), with no forward to hide behind. Also
    times the same fills one matcher at a time on one thread, and each mode's set-up (the tokenizer's
    vocabulary for xgrammar, then the grammar's compile)."""
    import xgrammar

    from kvloom.core.engine.step import ScheduledSeq
    from kvloom.core.engine.structured_output import StructuredOutputManager

    engine = llm.engine
    result = {}
    for name in modes:
        spec = MODES[name]
        if spec is None:
            continue
        # A seed per request: 16 different generations, so the matchers stand in different states as a
        # server's requests would (the TPOT runs share one seed, so there all 16 write the same text).
        params = [SamplingParams(temperature=args.temperature, seed=args.seed + i, max_tokens=args.output_len,
                                 structured=spec) for i in range(len(prompts))]
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        manager = StructuredOutputManager(engine.config.model, engine.config.tokenizer, engine.vocab_size,
                                          engine.eos_token_ids)
        t0 = time.perf_counter()
        for i in range(len(outputs)):
            manager.submit(_FillRequest(f"r{i}", spec))
        ready: list = []
        while len(ready) < len(outputs):
            got, failed = manager.take_compiled(wait_s=1.0)
            if failed:
                raise SystemExit(f"{name}: {failed[0][1]}")
            ready += got
        compile_s = time.perf_counter() - t0
        sp = SamplingParams(temperature=args.temperature)
        batched, single, accept_batched, accept_single = [], [], [], []
        for step in range(max(len(t) for t in outputs)):
            live = [i for i, t in enumerate(outputs) if step < len(t)]
            seqs = [ScheduledSeq(f"r{i}", [0], 0, [0], 1, sp) for i in live]
            t0 = time.perf_counter()
            manager.fill_bitmasks(seqs)
            batched.append(1000 * (time.perf_counter() - t0))
            mask = xgrammar.allocate_token_bitmask(1, engine.vocab_size)
            t0 = time.perf_counter()
            for i in live:
                manager._matchers[f"r{i}"].fill_next_token_bitmask(mask)
            single.append(1000 * (time.perf_counter() - t0))
            # The step's accept, both ways: the engine's (one call for the batch), then, rolled back, one
            # accept_token per matcher from Python.
            going = [i for i in live if not manager._matchers[f"r{i}"].is_terminated()]
            t0 = time.perf_counter()
            manager.accept_step(step, {f"r{i}": [outputs[i][step]] for i in going})
            accept_batched.append(1000 * (time.perf_counter() - t0))
            for i in going:
                manager._matchers[f"r{i}"].rollback(1)
            t0 = time.perf_counter()
            for i in going:
                manager._matchers[f"r{i}"].accept_token(outputs[i][step])
            accept_single.append(1000 * (time.perf_counter() - t0))
        manager.close()
        result[name] = {
            "compile_s": round(compile_s, 3), "steps": len(batched), "tokens": sum(len(t) for t in outputs),
            "batched_ms": {"mean": round(statistics.mean(batched), 3), "median": round(statistics.median(batched), 3),
                           "p90": round(sorted(batched)[int(0.9 * (len(batched) - 1))], 3),
                           "max": round(max(batched), 3)},
            "one_by_one_ms": {"mean": round(statistics.mean(single), 3), "median": round(statistics.median(single), 3),
                              "max": round(max(single), 3)},
            "accept_ms": {"batched": round(statistics.mean(accept_batched), 4),
                          "one_by_one": round(statistics.mean(accept_single), 4)},
        }
    return result


class _FillRequest:
    """What ``StructuredOutputManager.submit`` reads of a request."""

    def __init__(self, request_id: str, spec) -> None:
        self.request_id = request_id
        self.sampling = SamplingParams(structured=spec)


def shape_with_smollm2_vocab(shape: str, overrides: dict, tokenizer: str | None) -> str:
    """A config-only folder of ``shape`` with SmolLM2's vocabulary and special tokens (its tokenizer's)."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from shapes import SHAPES, shape_folder

    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    if not tokenizer or not os.path.isfile(os.path.join(tokenizer, "tokenizer.json")):
        raise SystemExit(f"--shape needs --tokenizer, a folder with tokenizer.json (got {tokenizer!r}): run "
                         "python benchmarks/export_tokenizer.py first")
    name = f"{shape}-smollm2-vocab"
    SHAPES[name] = {**SHAPES[shape], **SMOLLM2_VOCAB, "max_position_embeddings": 8192, **overrides}
    return str(shape_folder(name))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--device", default="auto")
    p.add_argument("--concurrency", type=int, default=16, help="Requests in the batch.")
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=1, help="Rounds over the modes (the median is reported).")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--async-scheduling", choices=["on", "off", "auto"], default="auto",
                   help="The engine's async scheduling (auto: on for CUDA only), to measure it either way.")
    p.add_argument("--output-json", help="Also write the JSON here.")
    p.add_argument("--shape", help="Dummy weights of this shape (benchmarks/shapes.py) instead of --model, "
                   "with SmolLM2's vocabulary; needs --tokenizer.")
    p.add_argument("--tokenizer", help="SmolLM2's tokenizer folder (python benchmarks/export_tokenizer.py).")
    p.add_argument("--shape-overrides", default="{}", help="JSON merged into the shape's config (e.g. a tiny one).")
    p.add_argument("--mask-fill-only", action="store_true",
                   help="Time the host's mask fill per step for --concurrency requests of each constrained mode "
                   "along a generation, instead of the TPOT runs.")
    args = p.parse_args()

    options = dict(device=args.device, max_model_len=1024, max_num_seqs=max(16, args.concurrency),
                   async_scheduling=args.async_scheduling)
    model = args.model
    if args.shape:
        model = shape_with_smollm2_vocab(args.shape, json.loads(args.shape_overrides), args.tokenizer)
        options.update(load_format="dummy", tokenizer=args.tokenizer)
    llm = LLM(model, **options)
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                             add_generation_prompt=True)
    prompts = [chat] * args.concurrency
    modes = args.modes.split(",")
    if args.mask_fill_only:
        fills = mask_fill_only(llm, prompts, modes, args)
        print(f"{'mode':<12} {'set-up s':>9} {'steps':>6} {'fill ms/step: mean':>19} {'median':>7} {'p90':>7} "
              f"{'max':>7} {'one by one':>11} {'accept ms/step':>15} {'one by one':>11}")
        for name, f in fills.items():
            b = f["batched_ms"]
            print(f"{name:<12} {f['compile_s']:>9.3f} {f['steps']:>6} {b['mean']:>19.3f} {b['median']:>7.3f} "
                  f"{b['p90']:>7.3f} {b['max']:>7.3f} {f['one_by_one_ms']['mean']:>11.3f} "
                  f"{f['accept_ms']['batched']:>15.4f} {f['accept_ms']['one_by_one']:>11.4f}")
        text = json.dumps({"model": args.shape or args.model, "concurrency": args.concurrency,
                           "output_len": args.output_len, "temperature": args.temperature, "fill": fills}, indent=2)
        print(text)
        if args.output_json:
            with open(args.output_json, "w") as f:
                f.write(text + "\n")
        return
    # Warm up each mode once (compiles and caches the grammars, as a server's first request would).
    for name in modes:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, structured=MODES[name]), use_tqdm=False)
    rounds: dict[str, list[dict]] = {name: [] for name in modes}
    for _ in range(args.repeat):
        for name in modes:  # interleaved, so machine noise spreads over every mode alike
            rounds[name].append(run(llm, prompts, MODES[name], args))
    result = {"model": args.shape or args.model, "device": str(llm.engine.device),
              "async_scheduling": llm.engine.async_scheduling, "concurrency": args.concurrency,
              "output_len": args.output_len, "temperature": args.temperature, "repeat": args.repeat, "modes": {}}
    def median_tpot(rs: list[dict]) -> float | None:
        measured = [r["tpot_ms"] for r in rs if r["tpot_ms"] is not None]
        return statistics.median(measured) if measured else None

    base = median_tpot(rounds["free"]) if "free" in rounds else None
    print(f"{'mode':<12} {'TPOT ms':>9} {'vs free':>8} {'tokens':>7}")
    for name, rs in rounds.items():
        tpot = median_tpot(rs)
        tokens = statistics.median(r["tokens"] for r in rs)
        ratio = tpot / base if base and tpot is not None else None
        result["modes"][name] = {"tpot_ms": tpot and round(tpot, 3), "ratio_to_free": ratio and round(ratio, 3),
                                 "tokens": tokens, "runs": rs}
        shown = f"{tpot:>9.2f}" if tpot is not None else f"{'-':>9}"
        print(f"{name:<12} {shown} {ratio if ratio else float('nan'):>8.3f} {tokens:>7.0f}")
        if tpot is None:
            print(f"  {name}: every request ended at its first token in every round: no TPOT to measure")
    text = json.dumps(result, indent=2)
    print(text)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
