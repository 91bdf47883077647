#!/usr/bin/env bash
# Run train.py under torchrun on one node, or as one node of many joined by a c10d rendezvous.
#
#   launch/torchrun.sh experiment=smoke parallel.tp=2                       # one node, all local GPUs
#   NNODES=4 NODE_RANK=$i MASTER_ADDR=node0 launch/torchrun.sh model=3b     # on each of 4 nodes
#
# Environment (each optional; under srun the SLURM_* variables fill them in):
#   NNODES            nodes in the job                      (default: $SLURM_NNODES, else 1)
#   NODE_RANK         this node's index                     (default: $SLURM_NODEID, else 0)
#   NPROC_PER_NODE    processes on this node                (default: visible GPUs, else 1)
#   MASTER_ADDR       host that serves the rendezvous       (default: first node of the SLURM job, else 127.0.0.1)
#   MASTER_PORT       its port                              (default: 29500)
#   RDZV_ENDPOINT     host:port of the rendezvous           (default: $MASTER_ADDR:$MASTER_PORT)
#   RDZV_ID           id shared by every node of one job    (default: $SLURM_JOB_ID, else diff-transformer)
#   PYTHON            interpreter                           (default: <repo>/.venv/bin/python, else python3)
#   SHUTDOWN_GRACE_S  seconds the workers get to checkpoint after SIGTERM/SIGUSR1 before SIGKILL (default: 120)
# Arguments are Hydra overrides for train.py.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "${repo_root}/.venv/bin/python" ]]; then PYTHON="${repo_root}/.venv/bin/python"; else PYTHON=python3; fi
fi

count_gpus() {
  if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
    awk -F, '{print NF}' <<<"${CUDA_VISIBLE_DEVICES}"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    nvidia-smi -L | wc -l
  else
    echo 1
  fi
}

first_slurm_host() {
  scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1
}

NNODES="${NNODES:-${SLURM_NNODES:-1}}"
NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-0}}"
NPROC_PER_NODE="${NPROC_PER_NODE:-$(count_gpus)}"
if [[ -z "${MASTER_ADDR:-}" ]]; then
  if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then MASTER_ADDR="$(first_slurm_host)"; else MASTER_ADDR=127.0.0.1; fi
fi
MASTER_PORT="${MASTER_PORT:-29500}"
RDZV_ENDPOINT="${RDZV_ENDPOINT:-${MASTER_ADDR}:${MASTER_PORT}}"
RDZV_ID="${RDZV_ID:-${SLURM_JOB_ID:-diff-transformer}}"
SHUTDOWN_GRACE_S="${SHUTDOWN_GRACE_S:-120}"

for name in NNODES NODE_RANK NPROC_PER_NODE SHUTDOWN_GRACE_S; do
  if ! [[ "${!name}" =~ ^[0-9]+$ ]]; then
    echo "torchrun.sh: ${name}=${!name} is not a non-negative integer" >&2
    exit 2
  fi
done
if (( NODE_RANK >= NNODES )); then
  echo "torchrun.sh: NODE_RANK=${NODE_RANK} must be below NNODES=${NNODES} (0..$((NNODES - 1)))" >&2
  exit 2
fi

# Node 0 serves the rendezvous store; stating it avoids two "hosts" when every node resolves to one machine.
if (( NODE_RANK == 0 )); then is_host=1; else is_host=0; fi

echo "torchrun.sh: node ${NODE_RANK}/${NNODES}, ${NPROC_PER_NODE} processes, rendezvous ${RDZV_ENDPOINT} id ${RDZV_ID}" >&2

# exec: SLURM's signals reach torchrun itself, which forwards SIGUSR1/SIGTERM to the workers so they can checkpoint.
exec "${PYTHON}" -m torch.distributed.run \
  --nnodes="${NNODES}" \
  --node_rank="${NODE_RANK}" \
  --nproc_per_node="${NPROC_PER_NODE}" \
  --rdzv_backend=c10d \
  --rdzv_endpoint="${RDZV_ENDPOINT}" \
  --rdzv_id="${RDZV_ID}" \
  --rdzv_conf="is_host=${is_host}" \
  --max_restarts=0 \
  --signals_to_handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
  --shutdown_timeout="${SHUTDOWN_GRACE_S}" \
  "${repo_root}/train.py" "$@"
