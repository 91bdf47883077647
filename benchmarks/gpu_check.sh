#!/usr/bin/env bash
# One GPU check, from a bare GPU machine (torch >= 2.6 with its own Triton, no network), in about 9 minutes:
#   0. train.py's smoke experiment in bf16 with checkpoints and a resume, on sdpa and on the fused kernel;
#   1. the GPU tests (pytest -m gpu);
#   2. benchmarks/attention.py at N = 2K, 4K, 8K, 16K (d = 128, bf16, causal): fused V1 and V2 vs SDPA, vs the
#      2H-head baseline; fwd, bwd, both, TFLOP/s, peak memory;
#   3. training throughput of 830m at sequence 2048: DIFF sdpa, DIFF triton, vanilla sdpa (tokens/s, MFU, peak
#      memory, first and last loss);
#   4. benchmarks/gpu_eval_check.sh: evaluate, analyze and the attention diagnostics in bf16.
# Each step runs under its own time limit. Writes benchmarks/results/*_<gpu>_<date>.md and prints a one-screen summary; logs go to $OUT (or ./gpu_check_out).
#
#   bash benchmarks/gpu_wheels.sh .whl          # once, where PyPI is reachable: the wheels the image lacks
#   bash benchmarks/gpu_check.sh [.whl]         # on the GPU machine, from the repository root
#   bash benchmarks/gpu_check.sh --dry-run      # on a CPU: the same steps at toy sizes (Triton interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
dry_run=0
wheels=".whl"
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    *) wheels="$arg" ;;
  esac
done
out="${OUT:-gpu_check_out}"
mkdir -p "$out" benchmarks/results
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled
status=0
step() {  # name, seconds, command...: run under a time limit, log to $out/<name>.log, remember a failure, go on
  local name="$1" limit="$2"; shift 2
  echo "=== $name (limit ${limit} s): $*"
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo "    TIMED OUT after $limit s"
  echo "    exit $rc after $((SECONDS - start)) s (log: $out/$name.log)"
  tail -n 5 "$out/$name.log" | sed 's/^/    /'
  [ $rc -eq 0 ] || status=1
}

if [ -d "$wheels" ] && ls "$wheels"/*.whl > /dev/null 2>&1; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_check_site "$wheels"/*.whl || exit 1
  export PYTHONPATH="/tmp/gpu_check_site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
"$py" - <<'PY' || exit 1
import megatron.core, hydra, omegaconf, torch, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, megatron-core {megatron.core.__version__}, "
      f"CUDA {torch.cuda.is_available()}: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
PY
export DIFF_ATTN_CACHE_DIR="${TMPDIR:-/tmp}/gpu_check_diff_attn_cache"  # outside $out: only logs come back
work="$(mktemp -d)"
# train.py on the GPU (NCCL world of one, bf16): 10 steps with a checkpoint at step 5 and 10, then an automatic resume
# to step 16, for the default backend and the fused kernel.
smoke() {
  local backend="$1" steps="$2"
  "$py" train.py experiment=smoke model.attention_backend="$backend" trainer.max_steps="$steps" trainer.eval_interval=5 \
    checkpoint.interval=5 hydra.run.dir="$work/smoke-$backend"
}
smoke_resume() { smoke "$1" 10 && smoke "$1" 16 && tail -n 3 "$work/smoke-$1/metrics.jsonl"; }
export -f smoke smoke_resume  # steps run under timeout, in a child bash
export py work

if [ $dry_run -eq 1 ]; then
  export TRITON_INTERPRET=1  # the fused kernel on CPU tensors
  step smoke_sdpa 300 bash -c 'smoke_resume sdpa'
  step gpu_tests 300 "$py" -m pytest -q -p no:cacheprovider tests/test_diff_attn_kernel.py -x
  step attention 300 "$py" benchmarks/attention.py --smoke
  step train_throughput 300 "$py" benchmarks/train_throughput.py --model debug --steps 6 --tp 1 --out "$out" \
    --kinds diff:sdpa diff:triton vanilla:sdpa
else
  step smoke_sdpa 60 bash -c 'smoke_resume sdpa'
  step smoke_triton 60 bash -c 'smoke_resume triton'
  step gpu_tests 240 "$py" -m pytest -q -p no:cacheprovider -m gpu --timeout 120 -rA --durations=0
  step attention 80 "$py" benchmarks/attention.py --seq-lens 2048 4096 8192 16384 --head-dim 128 --tokens 16384
  step train_throughput 150 "$py" benchmarks/train_throughput.py trainer.micro_batch_size=4 \
    trainer.global_batch_size=8 model.seq_length=2048 --model 830m --steps 20 --tp 1 --out "$out" \
    --kinds diff:sdpa diff:triton vanilla:sdpa
  step eval_check 240 env OUT="$work/eval" bash benchmarks/gpu_eval_check.sh "$wheels"
fi

echo
echo "=== summary ($( [ $dry_run -eq 1 ] && echo dry run || echo GPU ))"
grep -h -E "passed|failed|error" "$out/gpu_tests.log" | tail -n 1
grep -h -E "^\| V1 fused|^\| base" "$out/attention.log" | head -n 8
grep -h -E "tok/s|MFU|ratio" "$out/train_throughput.log" | head -n 12
ls -1 benchmarks/results/*"$(date +%Y-%m-%d)"* 2>/dev/null
exit $status
