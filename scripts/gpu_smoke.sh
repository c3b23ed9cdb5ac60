#!/usr/bin/env bash
# GPU smoke check (not in CI): 5 GRPO and 5 C3PO steps on one GPU, then the same through FSDP2 (torchrun, one
# rank, NCCL, bf16 compute over fp32 master weights), then GRPO with asynchronous rollouts (rollout.mode=async,
# S = 1); prints tokens/s, weight-sync seconds, the model FLOPs utilisation of generation and update
# (perf/mfu_gen, perf/mfu_update against the GPU's published bf16 peak, lit_rlvr.run.perf; PEAK_FLOPS=FLOP/s sets
# it for a GPU the table lacks), decode's memory-bandwidth utilisation (perf/mbu_gen) and, for the async run, the
# share of the step the trainer waited for data (async/trainer_wait_frac) per run. Then C3PO with asynchronous
# rollouts (its samples drawn from a snapshot of the posterior) and, on the HF engine, partial rollouts, also with
# the engine in a process of its own (engine.options.process=true). Last, rollout servers (docs/scaling.md): a
# server started with `lit-rlvr-serve` on the same GPU (SGLang's when it imports, else vLLM's; 0.3 of the GPU's
# memory), and GRPO plus asynchronous GRPO over it (engine=sglang_server / vllm_server), pushing weights through
# the server's update routes after every step (engine/servers_alive, engine/sync_logp_diff per step).
#
#   scripts/gpu_smoke.sh                 # the built-in tiny model, saved to disk by its warm-up
#   scripts/gpu_smoke.sh /path/to/model  # any local HF causal LM (e.g. Qwen3-4B), with the arithmetic task
#
# It installs the sglang extra first (LIT_RLVR_SKIP_INSTALL=1 skips that, for machines set up by hand) and uses
# engine=sglang when sglang imports, else says so and uses the in-process HF engine. Outputs: $SMOKE_OUT
# (default outputs/gpu_smoke), one run dir per check, each with metrics.csv and summary.json.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${1:-tiny}
PY=${PYTHON:-python3}
OUT=${SMOKE_OUT:-outputs/gpu_smoke}
STEPS=${SMOKE_STEPS:-5}
export PYTHONUNBUFFERED=1

if [ "${LIT_RLVR_SKIP_INSTALL:-0}" != 1 ]; then
  $PY -m pip install -q -e ".[sglang]" || echo "WARNING: pip install -e '.[sglang]' failed; continuing with what is installed"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name())"
# the peak perf/mfu_* divide by: trainer=gpu and trainer=fsdp compute in bf16
$PY -c "import torch; from lit_rlvr.run.perf import published_peak; p = published_peak(torch.cuda.get_device_name(), torch.bfloat16); print('peak bf16 FLOP/s:', p or 'not in lit_rlvr.run.perf.PUBLISHED_PEAKS (set PEAK_FLOPS=...)')"

if $PY -c "import sglang" 2>/dev/null; then
  ENGINE=(engine=sglang)
  FSDP_ENGINE=(engine=sglang)
  echo "engine: sglang $($PY -c 'import sglang; print(sglang.__version__)')"
else
  ENGINE=(engine=hf)
  FSDP_ENGINE=(engine=hf engine.options.mode=copy)
  echo "engine: sglang is NOT importable here; using the HF engine (shared mode on one GPU, copy mode under FSDP)"
fi

if [ "$MODEL" = tiny ]; then MODEL_ARGS=(model=tiny); else MODEL_ARGS=(model=qwen3_4b "model.name_or_path=$MODEL"); fi
COMMON=("${MODEL_ARGS[@]}" "trainer.max_steps=$STEPS" data.num_test=64 callbacks.progress=null)
if [ -n "${PEAK_FLOPS:-}" ]; then COMMON+=("perf.peak_flops=$PEAK_FLOPS"); fi

run() {  # name, launcher..., -- overrides...
  local name=$1; shift
  local start=$SECONDS
  "$@" "hydra.run.dir=$OUT/$name" > "$OUT/$name.log" 2>&1 || { echo "FAILED: $name (log: $OUT/$name.log)"; tail -40 "$OUT/$name.log"; exit 1; }
  echo "done: $name in $((SECONDS - start)) s"
}

mkdir -p "$OUT"
run grpo $PY train.py trainer=gpu algorithm=grpo "${ENGINE[@]}" "${COMMON[@]}"
run c3po $PY train.py trainer=gpu algorithm=c3po "${ENGINE[@]}" "${COMMON[@]}" model.dtype=float32  # IVON: fp32 weights
run fsdp_grpo $PY -m torch.distributed.run --nproc_per_node 1 --master_port 29531 train.py trainer=fsdp trainer.devices=1 \
  algorithm=grpo "${FSDP_ENGINE[@]}" "${COMMON[@]}"
run fsdp_c3po $PY -m torch.distributed.run --nproc_per_node 1 --master_port 29532 train.py trainer=fsdp trainer.devices=1 \
  algorithm=c3po "${FSDP_ENGINE[@]}" "${COMMON[@]}" model.dtype=float32
run async_grpo $PY train.py trainer=gpu algorithm=grpo "${ENGINE[@]}" "${COMMON[@]}" rollout.mode=async \
  rollout.max_staleness=1  # the HF engine keeps its own copy in async mode
run async_c3po $PY train.py trainer=gpu algorithm=c3po "${ENGINE[@]}" "${COMMON[@]}" model.dtype=float32 \
  rollout.mode=async rollout.max_staleness=1  # N = 4: each sample drawn from the posterior's snapshot when pushed
if [ "${ENGINE[0]}" = engine=hf ]; then  # pushes that land mid-batch: the HF engine only
  run async_partial $PY train.py trainer=gpu algorithm=grpo engine=hf "${COMMON[@]}" rollout.mode=async \
    rollout.max_staleness=1 rollout.partial_rollout=true engine.options.sync_check_every=0
  # the engine in a process of its own, on the same GPU (its own CUDA context), pushes landing mid-batch there
  run async_process $PY train.py trainer=gpu algorithm=grpo engine=hf "${COMMON[@]}" rollout.mode=async \
    rollout.max_staleness=1 engine.options.process=true rollout.partial_rollout=true engine.options.sync_check_every=0
fi

# rollout servers: lit-rlvr-serve in a process group of its own (so that stopping it stops its engine's children)
if $PY -c "import sglang" 2>/dev/null; then SERVE=sglang; SERVE_MEM=(--mem-fraction-static 0.3)
elif $PY -c "import vllm" 2>/dev/null; then SERVE=vllm; SERVE_MEM=(--gpu-memory-utilization 0.3)
else SERVE=""; echo "server-engine runs skipped: neither sglang nor vllm imports here"
fi
if [ -n "$SERVE" ]; then
  PORT=${SMOKE_SERVE_PORT:-8101}
  setsid $PY -m lit_rlvr.app.serve --engine "$SERVE" --model "$MODEL" --port "$PORT" "${SERVE_MEM[@]}" \
    > "$OUT/server.log" 2>&1 &
  SERVER_PGID=$!
  trap 'kill -- -$SERVER_PGID 2>/dev/null || true' EXIT
  $PY - "http://127.0.0.1:$PORT/health" "$SERVER_PGID" <<'EOF' || { tail -40 "$OUT/server.log"; exit 1; }
import os, sys, time
import requests
url, pid = sys.argv[1], int(sys.argv[2])
for _ in range(600):  # a model's load and the engine's warm-up
    try:
        if requests.get(url, timeout=5).status_code == 200:
            sys.exit(print("server ready:", url))
    except requests.RequestException:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit(f"the server exited before {url} answered")
    time.sleep(2)
sys.exit(f"no answer from {url} in 20 min")
EOF
  SERVER=("engine=${SERVE}_server" "engine.options.urls=[http://127.0.0.1:$PORT]")
  run server_grpo $PY train.py trainer=gpu algorithm=grpo "${SERVER[@]}" "${COMMON[@]}"
  run server_async $PY train.py trainer=gpu algorithm=grpo "${SERVER[@]}" "${COMMON[@]}" rollout.mode=async \
    rollout.max_staleness=1  # pushes land between generation calls, the server paused around each
  kill -- -$SERVER_PGID 2>/dev/null || true
fi

$PY - "$OUT" <<'EOF'
import csv, json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
print(f"{'run':<11} {'steps':>5} {'tokens/s':>9} {'sync_s':>8} {'gen_s':>7} {'train_s':>7} {'step_s':>7} "
      f"{'mfu_gen':>8} {'mfu_upd':>8} {'mbu_gen':>8} {'wait':>9} {'reward':>7} {'acc before→after':>18}")
for name in ("grpo", "c3po", "fsdp_grpo", "fsdp_c3po", "async_grpo", "async_c3po", "async_partial", "async_process",
             "server_grpo", "server_async"):
    if not (out / name / "summary.json").exists():  # (async_partial, async_process: HF only; server_*: an engine)
        continue
    rows = [r for r in csv.DictReader((out / name / "metrics.csv").open()) if r.get("reward/mean")]
    med = lambda k: statistics.median(float(r[k]) for r in rows[1:] or rows)  # step 1 includes warm-up work
    pct = lambda k: f"{100 * med(k):.3g}%" if rows[-1].get(k) else "n/a"  # no peak known: no MFU column
    s = json.loads((out / name / "summary.json").read_text())
    print(f"{name:<11} {len(rows):>5} {med('perf/tokens_per_s'):>9.0f} {med('time/sync_s'):>8.4f} {med('time/gen_s'):>7.3f} "
          f"{med('time/train_s'):>7.3f} {med('time/step_s'):>7.3f} {pct('perf/mfu_gen'):>8} {pct('perf/mfu_update'):>8} "
          f"{pct('perf/mbu_gen'):>8} {pct('async/trainer_wait_frac'):>9} {float(rows[-1]['reward/mean']):>7.3f} {s['accuracy_before']:>8.3f} → {s['accuracy_after']:.3f}")
partial = out / "async_partial" / "metrics.csv"
if partial.exists():
    fracs = [float(r["async/partial_frac"]) for r in csv.DictReader(partial.open()) if r.get("async/partial_frac")]
    print("async_partial: async/partial_frac per step (completions spanning two versions):", fracs)
for name in ("server_grpo", "server_async"):
    if (out / name / "metrics.csv").exists():
        rows = [r for r in csv.DictReader((out / name / "metrics.csv").open()) if r.get("reward/mean")]
        print(f"{name}: engine/servers_alive {[r.get('engine/servers_alive') for r in rows]}, "
              f"engine/sync_logp_diff {[r.get('engine/sync_logp_diff') for r in rows]}")
print("medians over steps 2..N; sync_s = weight pushes into the engine per step (C3PO: one per weight sample);")
print("mfu_* = model FLOPs of the phase / its seconds / the peak above, per GPU; mbu_gen = decode's bytes / gen_s /")
print("the GPU's published memory bandwidth (docs/mfu.md); wait = async/trainer_wait_frac (the async runs only)")
EOF
