#!/bin/bash
# One SLURM job, two kinds of nodes (docs/scaling.md, "Several trainer nodes"): the first TRAIN_NODES nodes of the
# allocation train (srun: one task per GPU, FSDP2, trainer.num_nodes=TRAIN_NODES), every other node runs one
# rollout server (`lit-rlvr-serve`, its flags in SERVE_ARGS: e.g. --tensor-parallel-size 8 for all of a node's GPUs),
# and the trainer reaches them with engine=ENGINE_server engine.options.urls=[...]. Submit from the repository:
#   MODEL=/shared/models/Qwen3-4B TRAIN_NODES=2 sbatch --nodes=3 scripts/slurm_train.sh data=dapo_math algorithm=c3po
# Arguments are train.py overrides. Settings (environment):
#   MODEL            the model: an HF folder every node reads, or a preset name (required)
#   TRAIN_NODES      trainer nodes (default: all but one); the rest are engine nodes
#   GPUS_PER_NODE    trainer tasks per node (default: $SLURM_GPUS_ON_NODE, else 8)
#   ENGINE           vllm | sglang (default vllm)
#   PORT             the servers' port (default 8101)
#   RUN_DIR          the run dir on the shared filesystem (default runs/slurm-$SLURM_JOB_ID); the pushed weight
#                    files go to RUN_DIR/weights, which the servers read
#   TRAINER          trainer preset (default fsdp; fsdp32 for sharded checkpoints)
#   SERVE_ARGS       more lit-rlvr-serve flags (passed on to the engine)
#   SERVE_TIMEOUT_S  how long to wait for every server to answer /health (default 1800)
#   PYTHON           the Python of the environment (default python)
# --dry-run (or DRY_RUN=1) prints the commands it would launch, one a line, and launches nothing.
# The servers listen on all of their node's interfaces (--host 0.0.0.0): the trainer nodes reach them by hostname.
# A router in front of the servers (e.g. SGLang's Model Gateway) is not needed: lit-rlvr spreads the requests itself.
# Tested as a dry run only; several trainer ranks with server engines are not run live yet (docs/scaling.md).
#SBATCH --nodes=3
#SBATCH --exclusive
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"  # the repository (train.py, conf/): where sbatch was called

fail() { echo "slurm_train.sh: $*" >&2; exit 2; }

if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi
DRY_RUN=${DRY_RUN:-0}
[[ -n "${SLURM_JOB_NODELIST:-}" ]] || fail "SLURM_JOB_NODELIST is not set: run it under sbatch (or set the SLURM variables for --dry-run)"
[[ -n "${MODEL:-}" ]] || fail "MODEL is not set: set MODEL=an HF folder every node reads, or a preset name (e.g. tiny_cot)"
ENGINE=${ENGINE:-vllm}
[[ "$ENGINE" == vllm || "$ENGINE" == sglang ]] || fail "ENGINE=$ENGINE: allowed: vllm, sglang"
PORT=${PORT:-8101}
[[ "$PORT" =~ ^[0-9]+$ ]] && ((PORT > 0 && PORT < 65536)) || fail "PORT=$PORT: allowed: 1-65535"
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
[[ "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]] || fail "GPUS_PER_NODE=$GPUS_PER_NODE: allowed: a whole number >= 1"
SERVE_TIMEOUT_S=${SERVE_TIMEOUT_S:-1800}
[[ "$SERVE_TIMEOUT_S" =~ ^[1-9][0-9]*$ ]] || fail "SERVE_TIMEOUT_S=$SERVE_TIMEOUT_S: allowed: whole seconds >= 1"
RUN_DIR=$(realpath -m "${RUN_DIR:-runs/slurm-${SLURM_JOB_ID:-0}}")  # absolute: the servers read its weights/
TRAINER=${TRAINER:-fsdp}
PYTHON=${PYTHON:-python}

# the allocation's hostnames: scontrol expands SLURM's compressed list (node[01-04]); a plain comma list needs none
if command -v scontrol >/dev/null; then
    mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
elif [[ "$SLURM_JOB_NODELIST" != *"["* ]]; then
    IFS=, read -r -a NODES <<<"$SLURM_JOB_NODELIST"
else
    fail "SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST needs scontrol to expand, and scontrol is not on PATH"
fi
((${#NODES[@]} >= 2)) || fail "SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST has ${#NODES[@]} node(s): the layout needs >= 2 (trainer and engine nodes)"
TRAIN_NODES=${TRAIN_NODES:-$((${#NODES[@]} - 1))}
[[ "$TRAIN_NODES" =~ ^[0-9]+$ ]] && ((TRAIN_NODES >= 1 && TRAIN_NODES < ${#NODES[@]})) \
    || fail "TRAIN_NODES=$TRAIN_NODES: allowed: 1-$((${#NODES[@]} - 1)) (of ${#NODES[@]} nodes, at least one left for the servers)"
TRAINER_HOSTS=("${NODES[@]:0:TRAIN_NODES}")
ENGINE_HOSTS=("${NODES[@]:TRAIN_NODES}")

URLS=()
for host in "${ENGINE_HOSTS[@]}"; do URLS+=("http://$host:$PORT"); done
URL_LIST=$(IFS=,; echo "[${URLS[*]}]")
read -r -a SERVE_EXTRA <<<"${SERVE_ARGS:-}"

serve_cmd() {  # SERVE_CMD: the rollout server on engine node $1
    SERVE_CMD=(srun --nodes=1 --ntasks=1 --nodelist="$1" lit-rlvr-serve --engine "$ENGINE" --model "$MODEL"
               --host 0.0.0.0 --port "$PORT" "${SERVE_EXTRA[@]}")
}
# a preset (conf/model/NAME.yaml) is picked by name, any other MODEL is a model folder or hub name
if [[ -f "conf/model/$MODEL.yaml" ]]; then MODEL_KEY="model=$MODEL"; else MODEL_KEY="model.name_or_path=$MODEL"; fi
TRAIN_CMD=(srun --nodes="$TRAIN_NODES" --ntasks-per-node="$GPUS_PER_NODE" --nodelist="$(IFS=,; echo "${TRAINER_HOSTS[*]}")"
           "$PYTHON" train.py trainer="$TRAINER" trainer.num_nodes="$TRAIN_NODES" trainer.devices="$GPUS_PER_NODE"
           engine="${ENGINE}_server" "engine.options.urls=$URL_LIST" engine.options.weight_dir="$RUN_DIR/weights"
           "$MODEL_KEY" hydra.run.dir="$RUN_DIR" "$@")

if [[ "$DRY_RUN" == 1 ]]; then
    for host in "${ENGINE_HOSTS[@]}"; do serve_cmd "$host"; echo "${SERVE_CMD[@]}"; done
    echo "${TRAIN_CMD[@]}"
    exit 0
fi

mkdir -p "$RUN_DIR/weights"
SERVERS=()
stop_servers() { for pid in "${SERVERS[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap stop_servers EXIT
for host in "${ENGINE_HOSTS[@]}"; do
    serve_cmd "$host"
    "${SERVE_CMD[@]}" >"$RUN_DIR/serve_$host.log" 2>&1 &
    SERVERS+=("$!")
done
deadline=$((SECONDS + SERVE_TIMEOUT_S))
for i in "${!URLS[@]}"; do
    until curl -sf -o /dev/null "${URLS[$i]}/health"; do
        kill -0 "${SERVERS[$i]}" 2>/dev/null || fail "the server for ${URLS[$i]} exited: see $RUN_DIR/serve_${ENGINE_HOSTS[$i]}.log"
        ((SECONDS < deadline)) || fail "${URLS[$i]}/health did not answer within SERVE_TIMEOUT_S=$SERVE_TIMEOUT_S s: see $RUN_DIR/serve_${ENGINE_HOSTS[$i]}.log"
        sleep 5
    done
done
"${TRAIN_CMD[@]}"
