#!/usr/bin/env bash
# Two models behind one server on one GPU, one command: `engine` with two [[models]] tables, a
# Llama-3-8B shape (gpu_memory_utilization share 0.6) and a Qwen3-0.6B shape (share 0.3), both dummy
# weights with SmolLM2's tokenizer (vocabulary 49,152), then `engine bench serve` on both models at once
# (one load per model, in parallel) and a summary of each with the engine metrics per model label.
# Needs the tokenizer folder made by `python benchmarks/export_tokenizer.py` (default .smollm2-tokenizer).
# Usage: bash benchmarks/two_models_gpu.sh [--tokenizer DIR] [--num-requests N] [--concurrency C]
#        [--device cuda|cpu] [--shape-overrides JSON] [--kv-gib "BIG SMALL"] [--port P] [--client-processes N]
set -euo pipefail
out=${OUT:-bench-out}
tokenizer=.smollm2-tokenizer
num_requests=384
concurrency=64
input_len=512
output_len=128
device=cuda
shape_overrides='{}'
kv_gib="40 20"
shares="0.6 0.3"
port=8124
client_processes=4
while [ $# -gt 0 ]; do
  case $1 in
    --tokenizer) tokenizer=$2; shift 2 ;;
    --num-requests) num_requests=$2; shift 2 ;;
    --concurrency) concurrency=$2; shift 2 ;;
    --input-len) input_len=$2; shift 2 ;;
    --output-len) output_len=$2; shift 2 ;;
    --device) device=$2; shift 2 ;;
    --shape-overrides) shape_overrides=$2; shift 2 ;;  # e.g. a tiny shape to check the script on a CPU
    --kv-gib) kv_gib=$2; shift 2 ;;
    --shares) shares=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --client-processes) client_processes=$2; shift 2 ;;
    *) echo "two_models_gpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -f "$tokenizer/tokenizer.json" ] || { echo "no tokenizer at $tokenizer: run python benchmarks/export_tokenizer.py $tokenizer here first" >&2; exit 2; }
read -r kv_big kv_small <<< "$kv_gib"
read -r share_big share_small <<< "$shares"

# Both shapes with SmolLM2's vocabulary and special tokens; the config file names each model's share.
config="$out/two_models.toml"
python3 - "$shape_overrides" "$config" "$tokenizer" "$device" "$concurrency" "$share_big" "$kv_big" "$share_small" "$kv_small" <<'EOF'
import json, sys
sys.path.insert(0, "benchmarks")
from shapes import SHAPES, shape_folder
overrides, config, tokenizer, device, seqs, share_big, kv_big, share_small, kv_small = sys.argv[1:]
vocab = {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, **json.loads(overrides)}
SHAPES["llama-3-8b-smollm2-vocab"] = {**SHAPES["llama-3-8b"], **vocab}
SHAPES["qwen3-0.6b-smollm2-vocab"] = {**SHAPES["qwen3-0.6b"], **vocab, "max_position_embeddings": 8192}
rows = [("llama3-8b", "llama-3-8b-smollm2-vocab", share_big, kv_big),
        ("qwen3-0.6b", "qwen3-0.6b-smollm2-vocab", share_small, kv_small)]
lines = [f'device = "{device}"', 'load_format = "dummy"', f'tokenizer = "{tokenizer}"', f"max_num_seqs = {seqs}",
         "max_num_batched_tokens = 8192", "max_model_len = 4096", "api_workers = 1"]
for name, shape, share, kv in rows:
    lines += ["", "[[models]]", f'name = "{name}"', f'model = "{shape_folder(shape)}"',
              f"gpu_memory_utilization = {share}", f"kv_cache_memory_gib = {kv}"]
open(config, "w").write("\n".join(lines) + "\n")
EOF
cat "$config"
log="$out/two_models_server.log"
echo "=== server ($(date +%T))"
python3 -m kvloom.cli --config "$config" --host 127.0.0.1 --port "$port" > "$log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null' EXIT
healthy() { python3 -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$port/health', timeout=2).status_code != 200)" 2>/dev/null; }
while [ $SECONDS -lt 200 ]; do
  healthy && break
  kill -0 $server 2>/dev/null || { echo "the server exited:"; tail -40 "$log"; exit 1; }
  sleep 1
done
healthy || { echo "the server was not healthy in 200 s:"; tail -40 "$log"; exit 1; }
grep -E "KV cache:|Memory profile|CUDA graphs|Serving|Loaded" "$log" | head -12 || true
python3 -c "import httpx; print(httpx.get('http://127.0.0.1:$port/v1/models').text)"

echo "=== bench serve on both models at once ($(date +%T))"
pids=()
for model in llama3-8b qwen3-0.6b; do
  timeout 150 python3 -m kvloom.cli bench serve --base-url "http://127.0.0.1:$port" --model "$model" \
    --input-len "$input_len" --output-len "$output_len" --random-token-range 1000:49000 \
    --concurrency "$concurrency" --client-processes "$client_processes" --num-requests "$num_requests" --warmup-requests 2 --no-progress \
    --output-json "$out/two_models_$model.json" > "$out/two_models_$model.txt" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for model in llama3-8b qwen3-0.6b; do echo "--- $model"; tail -6 "$out/two_models_$model.txt"; done

echo "=== summary"
python3 - "$out" "$port" <<'EOF'
import json, sys, httpx
from prometheus_client.parser import text_string_to_metric_families
out, port = sys.argv[1:]
text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
engine = {}
for fam in text_string_to_metric_families(text):
    for s in fam.samples:
        if s.name in ("kvloom_kv_cache_total_blocks", "kvloom_num_preemptions_total", "kvloom_prefix_cache_queries_total"):
            engine.setdefault(s.labels.get("model"), {})[s.name] = s.value
rows = []
for model in ("llama3-8b", "qwen3-0.6b"):
    s = json.load(open(f"{out}/two_models_{model}.json"))["levels"][0]
    rows.append({"model": model, "completed": s["completed"], "failed": s["failed"],
                 "output_throughput": round(s["output_throughput"], 1),
                 "ttft_ms_p50": round(s["ttft_ms"]["p50"], 2), "tpot_ms_p50": round(s["tpot_ms"]["p50"], 2),
                 "engine": engine.get(model)})
print(json.dumps(rows, indent=1))
EOF
grep -E "Memory profile|KV cache:" "$log" || true
exit $status
