#!/usr/bin/env bash
# HTTP serving on one GPU, one command: start `engine` on Llama-3-8B-shaped dummy weights with SmolLM2's
# tokenizer (vocabulary 49,152), load it with `engine bench serve` (512 prompt + 256 output tokens,
# 256 streams, --max-num-batched-tokens 16384, one API worker), first with the default client
# processes, then with one client process for comparison, and print a summary of both (JSON per run in
# $OUT, or ./bench-out). Needs the packages the GPU image lacks on PYTHONPATH (see
# ../shared/tools/device-wheels.sh) and the tokenizer folder made here by
# `python benchmarks/export_tokenizer.py` (default .smollm2-tokenizer, 3.4 MiB).
# Usage: bash benchmarks/serve_gpu.sh [--tokenizer DIR] [--num-requests N] [--concurrency C]
#        [--client-runs "default 1"] [--shape-overrides JSON] [--device cuda|cpu] [--port P]
set -euo pipefail
out=${OUT:-bench-out}
tokenizer=.smollm2-tokenizer
num_requests=768
concurrency=256
input_len=512
output_len=256
client_runs="default 1"
shape_overrides='{}'
device=cuda
port=8123
extra_engine=()
while [ $# -gt 0 ]; do
  case $1 in
    --tokenizer) tokenizer=$2; shift 2 ;;
    --num-requests) num_requests=$2; shift 2 ;;
    --concurrency) concurrency=$2; shift 2 ;;
    --input-len) input_len=$2; shift 2 ;;
    --output-len) output_len=$2; shift 2 ;;
    --client-runs) client_runs=$2; shift 2 ;;
    --shape-overrides) shape_overrides=$2; shift 2 ;;  # e.g. a tiny shape to check the script on a CPU
    --device) device=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --) shift; extra_engine=("$@"); break ;;
    *) echo "serve_gpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -f "$tokenizer/tokenizer.json" ] || { echo "no tokenizer at $tokenizer: run python benchmarks/export_tokenizer.py $tokenizer here first" >&2; exit 2; }
python3 -c "import msgspec, zmq, starlette, uvicorn, gguf, httpx, prometheus_client, tqdm" \
  || { echo "missing packages: see ../shared/tools/device-wheels.sh" >&2; exit 2; }

# Llama-3-8B's shape with SmolLM2's vocabulary and special tokens (EOS is ignored by the load anyway).
shape=$(python3 - "$shape_overrides" <<'EOF'
import json, sys
sys.path.insert(0, "benchmarks")
from shapes import SHAPES, shape_folder
SHAPES["llama-3-8b-smollm2-vocab"] = {**SHAPES["llama-3-8b"], "vocab_size": 49152, "bos_token_id": 1,
                                      "eos_token_id": 2, **json.loads(sys.argv[1])}
print(shape_folder("llama-3-8b-smollm2-vocab"))
EOF
)
log="$out/serve_gpu_server.log"
echo "=== server ($(date +%T)): $shape"
python3 -m kvloom.cli --model "$shape" --load-format dummy --tokenizer "$tokenizer" --device "$device" \
  --max-num-seqs "$concurrency" --max-num-batched-tokens 16384 --api-workers 1 \
  --host 127.0.0.1 --port "$port" "${extra_engine[@]}" > "$log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null' EXIT
healthy() { python3 -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$port/health', timeout=2).status_code != 200)" 2>/dev/null; }
while [ $SECONDS -lt 240 ]; do  # start-up (dummy weights, CUDA graphs) within 4 minutes of the script's start
  healthy && break
  kill -0 $server 2>/dev/null || { echo "the server exited:"; tail -40 "$log"; exit 1; }
  sleep 1
done
healthy || { echo "the server was not healthy in 240 s:"; tail -40 "$log"; exit 1; }
grep -E "KV cache:|CUDA graphs|Serving" "$log" | head -5 || true

jsons=()
for clients in $client_runs; do
  flag=()
  [ "$clients" = default ] || flag=(--client-processes "$clients")
  json="$out/serve_llama3_8b_c${concurrency}_clients_${clients}.json"
  echo "=== bench serve, client processes: $clients ($(date +%T))"
  timeout 150 python3 -m kvloom.cli bench serve --base-url "http://127.0.0.1:$port" --input-len "$input_len" \
    --output-len "$output_len" --random-token-range 1000:49000 --concurrency "$concurrency" \
    --num-requests "$num_requests" --warmup-requests 2 --no-progress "${flag[@]}" --output-json "$json" \
    | tail -18
  jsons+=("$json")
done

echo "=== summary"
python3 - "${jsons[@]}" <<'EOF'
import json, sys
rows = []
for path in sys.argv[1:]:
    d = json.load(open(path))
    s = d["levels"][0]
    itl, tpot = s["itl_ms"]["p50"], s["tpot_ms"]["p50"]
    rows.append({
        "json": path, "client_processes": s["client_processes"],
        "client_busy": [c["busy"] for c in s["clients"]], "client_saturated": s["client_saturated"],
        "client_lag_p90_ms": [c.get("lag_p90_ms") for c in s["clients"]],
        "itl_burst_share": round(s.get("itl_burst_share", 0.0), 3),
        "completed": s["completed"], "failed": s["failed"], "output_tokens": s["output_tokens"],
        "output_throughput": round(s["output_throughput"], 1),
        "ttft_ms_p50": round(s["ttft_ms"]["p50"], 2), "ttft_ms_p99": round(s["ttft_ms"]["p99"], 2),
        "tpot_ms_p50": round(tpot, 2), "itl_ms_p50": round(itl, 2), "itl_ms_p99": round(s["itl_ms"]["p99"], 2),
        "itl_p50_over_tpot_p50": round(itl / tpot, 3),
        "itl_p50_within_25pct_of_tpot": abs(itl / tpot - 1) <= 0.25,
    })
print(json.dumps(rows, indent=1))
EOF
