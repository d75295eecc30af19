#!/usr/bin/env bash
# The GPU figures of the README, one command on the GPU machine: kernel and GPU tests, then the
# offline-throughput, batch-1 latency and nano-vllm-workload benchmarks, each writing JSON to $OUT
# (or ./bench-out). Usage: bash benchmarks/gpu_suite.sh [tests|llama8b|latency|qwen3|quant|quanttests|quantgputests ...]
# (quant, quanttests and quantgputests run only when named: the README's quantization table, the native 4-bit
# and FP8 kernel tests, and the quantized models' GPU tests)
set -uo pipefail
out=${OUT:-bench-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
parts=${*:-tests llama8b latency qwen3}
for part in $parts; do
  echo "=== $part ($(date +%T))"
  case $part in
    tests) timeout 240 python3 -m pytest -q tests/kernels tests/test_gpu.py 2>&1 | tail -15 ;;
    gputests) timeout 120 python3 -m pytest -q tests/test_gpu.py 2>&1 | tail -15 ;;
    # The native 4-bit and FP8 kernel tests, and the quantized models' GPU tests: together about 9 minutes on
    # a fresh H200 (2026-12-04, compiles included), more than one device call may take, so two parts.
    quanttests) timeout 570 python3 -m pytest -q --durations=10 tests/kernels/test_gluon_quant.py \
        tests/kernels/test_quant_kernels.py > "$out/quant_tests.txt" 2>&1
        tail -15 "$out/quant_tests.txt" ;;
    quantgputests) timeout 570 python3 -m pytest -q --durations=10 tests/test_gpu.py \
        -k "quant or int4 or fp8 or mma or gluon" > "$out/quant_gpu_tests.txt" 2>&1
        tail -15 "$out/quant_gpu_tests.txt" ;;
    quant) timeout 570 python3 benchmarks/quant_gpu.py --shape llama-3-8b --formats bf16,fp8,awq,gptq \
        --num-requests 256 --prompt-len 512 --output-len 256 --decode-tokens 128 --offline-passes 2 \
        --output "$out/quant_llama3_8b.json" > "$out/quant_llama3_8b.log" 2>&1
        python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print(json.dumps(d['ratios_to_baseline']))" \
        "$out/quant_llama3_8b.json" ;;
    llama8b) timeout 420 python3 benchmarks/offline_throughput.py --shape llama-3-8b --num-requests 256 \
        --prompt-len 512 --output-len 256 --hf-batch-size 64 --max-num-seqs 256 \
        --max-num-batched-tokens 16384 --quiet | tee "$out/offline_llama3_8b.json" ;;
    latency) timeout 240 python3 benchmarks/latency.py --shape llama-3-8b --prompt-len 128 --new-tokens 256 \
        | tee "$out/latency_llama3_8b.json" ;;
    qwen3) timeout 300 python3 benchmarks/offline_throughput.py --shape qwen3-0.6b --num-requests 256 \
        --prompt-len 100:1024 --output-len 100:1024 --hf-num-requests 32 --hf-batch-size 32 \
        --max-num-seqs 256 --max-num-batched-tokens 8192 --max-model-len 4096 --quiet \
        | tee "$out/offline_qwen3_0.6b.json" ;;
  esac
done
