"""lm-evaluation-harness through kvloom against lm-eval's own Hugging Face backend, on one model in
float32: the same accuracy and per-item loglikelihoods (max |delta| under 1e-3) from a local
multiple-choice task this script writes (lm-eval's ``dataset_path: json``; nothing is downloaded).
kvloom is driven as lm-eval drives vLLM's server: ``--model local-completions`` with batched,
concurrent scoring requests (echo + logprobs, max_tokens 0) and ``tokenizer_backend=remote``
(kvloom's /tokenizer_info, /tokenize, /detokenize), so lm-eval needs no tokenizer of its own.

lm-eval runs from its own virtual environment (never imported here)::

    python -m venv /work/venvs/lmeval
    /work/venvs/lmeval/bin/pip install torch==2.13.0 "lm-eval[api,hf]==0.4.13"
    python benchmarks/lm_eval_parity.py --lm-eval /work/venvs/lmeval/bin/lm_eval

The model is SmolLM2-135M-Instruct (kvloom's built-in GGUF, dequantized once into a float32 Hugging Face
folder by benchmarks/gguf_to_hf.py) unless --model names a Hugging Face folder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
SERVED = "parity-model"
TASK = "kvloom_parity_mc"

CAPITALS = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
            ("Japan", "Tokyo"), ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Russia", "Moscow"),
            ("China", "Beijing"), ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Norway", "Oslo")]
OPPOSITES = [("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow"), ("happy", "sad"),
             ("light", "dark"), ("old", "young"), ("open", "closed"), ("early", "late"), ("rich", "poor")]
COLOURS = [("grass", "green"), ("the sky on a clear day", "blue"), ("snow", "white"), ("a ripe banana", "yellow"),
           ("coal", "black"), ("a ripe tomato", "red"), ("an orange", "orange"), ("a violet", "purple")]


def items() -> list[dict]:
    """Small multiple-choice questions, four choices each (the answer's index varies)."""
    out = []
    for i, (country, city) in enumerate(CAPITALS):
        others = [c for _, c in CAPITALS if c != city]
        choices = [others[(i + k) % len(others)] for k in range(3)]
        choices.insert(i % 4, city)
        out.append({"question": f"The capital of {country} is", "choices": choices, "answer": i % 4})
    for i, (word, opposite) in enumerate(OPPOSITES):
        others = [o for _, o in OPPOSITES if o != opposite]
        choices = [others[(2 * i + k) % len(others)] for k in range(3)]
        choices.insert((i + 1) % 4, opposite)
        out.append({"question": f"The opposite of {word} is", "choices": choices, "answer": (i + 1) % 4})
    for i, (thing, colour) in enumerate(COLOURS):
        others = [c for _, c in COLOURS if c != colour]
        choices = [others[(3 * i + k) % len(others)] for k in range(3)]
        choices.insert((i + 2) % 4, colour)
        out.append({"question": f"The colour of {thing} is", "choices": choices, "answer": (i + 2) % 4})
    for a in range(2, 8):
        b = a + 3
        choices = [str(a + b + d) for d in (-2, -1, 1)]
        choices.insert(a % 4, str(a + b))
        out.append({"question": f"{a} + {b} =", "choices": choices, "answer": a % 4})
    return out


def write_task(folder: Path) -> None:
    data = folder / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in items()))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        "doc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: answer\n"
        "target_delimiter: \" \"\n"
        "metric_list:\n"
        "  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
        "  - {metric: acc_norm, aggregation: mean, higher_is_better: true}\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_kvloom(model: Path, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "kvloom.cli", "--model", str(model), "--dtype", "float32",
                             "--served-model-name", SERVED, "--port", str(port), "--max-model-len", "2048"],
                            env=env, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvloom exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("kvloom did not become healthy")


def run_lm_eval(lm_eval: str, model: str, model_args: str, tasks_dir: Path, out: Path, batch_size: int,
                extra: list[str]) -> tuple[dict, dict[int, list[float]], float]:
    """lm-eval's results and, per document, its choices' loglikelihoods; and the wall time."""
    start = time.monotonic()
    cmd = [lm_eval, "--model", model, "--model_args", model_args, "--tasks", TASK, "--include_path", str(tasks_dir),
           "--batch_size", str(batch_size), "--log_samples", "--output_path", str(out), *extra]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(cmd, check=True, env=env)
    wall = time.monotonic() - start
    results = json.loads(max(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime).read_text())
    samples = max(out.rglob(f"samples_{TASK}_*.jsonl"), key=lambda p: p.stat().st_mtime)
    lls = {}
    for line in samples.read_text().splitlines():
        row = json.loads(line)
        lls[row["doc_id"]] = [float(r[0][0]) for r in row["resps"]]
    return results["results"][TASK], lls, wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lm-eval", default="/work/venvs/lmeval/bin/lm_eval", help="lm-eval's command line.")
    p.add_argument("--model", help="A Hugging Face folder (default: SmolLM2-135M-Instruct exported in float32).")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-concurrent", type=int, default=4)
    p.add_argument("--max-delta", type=float, default=1e-3, help="The largest per-item |delta loglikelihood| allowed.")
    args = p.parse_args()

    if args.model:
        model = Path(args.model)
    else:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from gguf_to_hf import DEFAULT_FOLDER, export

        model = export(DEFAULT_FOLDER.with_name(DEFAULT_FOLDER.name + "-float32"), "float32")
    work = Path(tempfile.mkdtemp(prefix="kvloom-lm-eval-"))
    write_task(work)
    port = free_port()
    server = start_kvloom(model, port, work / "kvloom.log")
    try:
        kv_args = (f"model={SERVED},base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=remote,"
                   f"num_concurrent={args.num_concurrent},max_retries=1,timeout=600")
        kv, kv_lls, kv_wall = run_lm_eval(args.lm_eval, "local-completions", kv_args, work, work / "kvloom",
                                          args.batch_size, [])
    finally:
        server.terminate()
        server.wait(60)
    hf, hf_lls, hf_wall = run_lm_eval(args.lm_eval, "hf", f"pretrained={model},dtype=float32", work, work / "hf",
                                      args.batch_size, ["--device", "cpu"])
    deltas = [abs(a - b) for doc in hf_lls for a, b in zip(kv_lls[doc], hf_lls[doc], strict=True)]
    assert sorted(kv_lls) == sorted(hf_lls), "the two runs scored different documents"
    same_acc = all(math.isclose(kv[m], hf[m]) for m in ("acc,none", "acc_norm,none"))
    print(f"\nlm-eval {TASK}: {len(hf_lls)} questions, {len(deltas)} loglikelihoods, model {model}")
    print(f"{'':28}{'acc':>8}{'acc_norm':>10}{'wall s':>9}")
    print(f"{'kvloom (local-completions)':28}{kv['acc,none']:8.4f}{kv['acc_norm,none']:10.4f}{kv_wall:9.1f}")
    print(f"{'hf (transformers)':28}{hf['acc,none']:8.4f}{hf['acc_norm,none']:10.4f}{hf_wall:9.1f}")
    print(f"max |delta loglikelihood| {max(deltas):.2e} (limit {args.max_delta:g}); mean {sum(deltas) / len(deltas):.2e}")
    print(f"kvloom: batch_size {args.batch_size}, num_concurrent {args.num_concurrent}, tokenizer_backend=remote")
    ok = same_acc and max(deltas) < args.max_delta
    print("PARITY" if ok else "MISMATCH", f"(work files in {work})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
