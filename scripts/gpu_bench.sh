#!/usr/bin/env bash
# The medium workload (bench/medium.py) at Qwen3-0.6B's shape in bf16 on one GPU (prepared for when a GPU is lent;
# issue 62): 8 prompts of 128 tokens x 8 completions of exactly 256 tokens, on a Qwen3 of random weights with
# Qwen3-0.6B's dims and vocabulary (hidden 1024, 28 layers, MLP 3072, 16 query and 8 KV heads of 128, 151,936
# tokens, tied embeddings), built once under $LIT_RLVR_CACHE/medium/.
#   1. generation.py: each engine against its roofline (published bf16 peak and memory bandwidth of the GPU,
#      lit_rlvr/run/perf.py): hf in this Python; vllm and sglang when VLLM_VENV / SGLANG_VENV name GPU builds of
#      them (each runs bench/engine_runner.py in its own environment);
#   2. the roofline figure of that JSON (bench/plot_roofline.py);
#   3. step_time.py: lit-rlvr's GRPO step on the workload (trainer=gpu: bf16-mixed over fp32 weights), its tokens/s
#      and MFU of generation and update (the row prime-rl's ~11.9k tokens/s, 11 % MFU for a Qwen3-0.6B trainer step
#      is the anchor for).
#
#   scripts/gpu_bench.sh            # outputs: $BENCH_OUT (default outputs/gpu_bench): generation.json, roofline.png,
#                                   # step_time.json, and each command's stderr beside its output
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUT=${BENCH_OUT:-outputs/gpu_bench}
STEPS=${BENCH_STEPS:-5}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SHAPE=(--medium vocab=151936 --medium hidden=1024 --medium layers=28 --medium intermediate=3072 --medium heads=16
       --medium kv_heads=8 --medium head_dim=128)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__)"
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true

ENGINES=hf
[ -n "${VLLM_VENV:-}" ] && ENGINES+=,vllm || echo "VLLM_VENV not set: vllm left out"
[ -n "${SGLANG_VENV:-}" ] && ENGINES+=,sglang || echo "SGLANG_VENV not set: sglang left out"

echo "== generation: $ENGINES"
$PY bench/generation.py --workload medium "${SHAPE[@]}" --dtype bfloat16 --device cuda --engines "$ENGINES" \
  --repeats 3 --warmup 1 --json > "$OUT/generation.json" 2> "$OUT/generation.err" \
  || { echo "generation.py failed: see $OUT/generation.err"; tail -5 "$OUT/generation.err"; }
[ -s "$OUT/generation.json" ] && $PY bench/plot_roofline.py "$OUT/generation.json" --out "$OUT/roofline.png" \
  --title "medium workload at Qwen3-0.6B's shape, bf16, $(head -1 "$OUT/gpu.txt" | cut -d, -f1)"

echo "== GRPO step (step_time.py, $STEPS steps)"
$PY bench/step_time.py --workload medium "${SHAPE[@]}" --steps "$STEPS" --warmup 2 --override trainer=gpu \
  --override algorithm.micro_batch_size=16 --json > "$OUT/step_time.json" 2> "$OUT/step_time.err" \
  || { echo "step_time.py failed: see $OUT/step_time.err"; tail -5 "$OUT/step_time.err"; }
tail -c 2000 "$OUT/generation.json" "$OUT/step_time.json" 2>/dev/null || true
