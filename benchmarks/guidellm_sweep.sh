#!/usr/bin/env bash
# guidellm (the vLLM project's benchmark tool) runs a short sweep against kvloom end to end: `engine`
# with its defaults (SmolLM2-135M-Instruct) on a free loopback port, guidellm's OpenAI HTTP backend
# with its own request options (streams with stream_options.continuous_usage_stats, ignore_eos),
# a synchronous level, a throughput level and constant rates between them. guidellm lives in its own
# virtual environment:
#
#   python -m venv /work/venvs/guidellm && /work/venvs/guidellm/bin/pip install guidellm==0.8.1
#   bash benchmarks/guidellm_sweep.sh [OUT_DIR]
#
# Knobs (environment): GUIDELLM (the guidellm command), SWEEP_SIZE (levels, default 4), SECONDS_PER_LEVEL
# (default 30), PROMPT_TOKENS (64), OUTPUT_TOKENS (32), MAX_CONCURRENCY (the throughput level's streams,
# default 16: guidellm's 512 leave a 2-core CPU server no request finished in a short level, and the
# constant rates after it are derived from that level). guidellm reads synthetic prompts with
# SmolLM2's tokenizer, written here from the GGUF by benchmarks/export_tokenizer.py (no hub download).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${TMPDIR:-/tmp}/kvloom-guidellm}
GUIDELLM=${GUIDELLM:-/work/venvs/guidellm/bin/guidellm}
mkdir -p "$OUT"
TOKENIZER="$OUT/tokenizer"
[ -f "$TOKENIZER/tokenizer.json" ] || PYTHONPATH=. python benchmarks/export_tokenizer.py "$TOKENIZER"
PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

PYTHONPATH=. python -m kvloom.cli --port "$PORT" > "$OUT/kvloom.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 "$SERVER" 2>/dev/null || { cat "$OUT/kvloom.log"; exit 1; }
  sleep 0.5
done

HF_HUB_OFFLINE=1 "$GUIDELLM" run \
  --backend "kind=openai_http,target=http://127.0.0.1:$PORT" \
  --profile "kind=sweep,sweep_size=${SWEEP_SIZE:-4},max_concurrency=${MAX_CONCURRENCY:-16}" \
  --data "kind=synthetic_text,prompt_tokens=${PROMPT_TOKENS:-64},output_tokens=${OUTPUT_TOKENS:-32}" \
  --constraint "kind=max_duration,seconds=${SECONDS_PER_LEVEL:-30}" \
  --tokenizer "kind=hf_auto,model=$TOKENIZER" \
  --output "kind=json,path=$OUT/benchmarks.json" \
  --output kind=console \
  --disable-console-interactive
echo "guidellm finished; report in $OUT/benchmarks.json, kvloom's log in $OUT/kvloom.log"
