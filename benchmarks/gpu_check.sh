#!/usr/bin/env bash
# One GPU check, from a bare GPU machine (torch >= 2.6 with its own Triton, no network), in under 9 minutes:
#   1. benchmarks/core_attention.py at d=128, N=4096, B=4, H=8 (bf16): one layer forward+backward of each core
#      attention module (DIFF sdpa with the unfused, Triton and torch.compile epilogues, DIFF's fused kernel, V2, the
#      baseline), each checked against eager first, its ratio to the baseline and the SDPA kernel of every call;
#   2. the GPU tests of the fast paths (bf16 backends in the model, the fused epilogue in bf16, the compiled one);
#   3. 830m at sequence 2048, micro-batches of 4, 8 per step: DIFF and vanilla each at its best
#      (model.attention_backend=auto, trainer.fusions auto = on): tokens/s, MFU, peak memory against the plan,
#      auto's choice and timings, the SDPA kernels, and one step's profile by kind of work;
#   4. 3b at sequence 4096, micro-batch 1, 8 per step, with the recomputation that fits 80 GiB: the same.
# The earlier checks (smoke training with a resume on sdpa and triton, every GPU test, benchmarks/attention.py at
# N = 2K-16K, benchmarks/gpu_eval_check.sh) measured on 2026-11-26 run with --all (longer than 9 minutes).
# Each step runs under its own time limit. Results (markdown) and logs go to $OUT (or ./gpu_check_out); the
# summary prints the DIFF/vanilla ratios, MFU, memory and the profile tables.
#
#   bash benchmarks/gpu_wheels.sh .whl          # once, where PyPI is reachable: the wheels the image lacks
#   bash benchmarks/gpu_check.sh [.whl]         # on the GPU machine, from the repository root
#   bash benchmarks/gpu_check.sh --dry-run      # on a CPU: the same steps at toy sizes (Triton interpreter)
#   bash benchmarks/gpu_check.sh .whl --only throughput_3b,gpu_tests   # a rerun of some steps only
set -uo pipefail
cd "$(dirname "$0")/.."
dry_run=0
all=0
only=""
wheels=".whl"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --all) all=1 ;;
    --only) only=",$2,"; shift ;;
    *) wheels="$1" ;;
  esac
  shift
done
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled PYTHONWARNINGS=ignore
status=0
step() {  # name, seconds, command...: run under a time limit, log to $out/<name>.log, remember a failure, go on
  local name="$1" limit="$2"; shift 2
  if [ -n "$only" ] && [[ "$only" != *",$name,"* ]]; then return 0; fi
  echo "=== $name (limit ${limit} s): $*"
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo "    TIMED OUT after $limit s"
  echo "    exit $rc after $((SECONDS - start)) s (log: $out/$name.log)"
  tail -n 4 "$out/$name.log" | sed 's/^/    /'
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
# caches outside $out (only results and logs come back); one inductor/Triton cache for every step
export DIFF_ATTN_CACHE_DIR="${TMPDIR:-/tmp}/gpu_check_diff_attn_cache"
export DIFF_TRANSFORMER_CACHE_DIR="${TMPDIR:-/tmp}/gpu_check_diff_transformer_cache"
export TORCHINDUCTOR_CACHE_DIR="${TMPDIR:-/tmp}/gpu_check_inductor_cache"
work="$(mktemp -d)"
throughput() {  # name, limit, model args...: one train_throughput run, its markdown copied next to the logs
  local name="$1" limit="$2"; shift 2
  step "$name" "$limit" "$py" benchmarks/train_throughput.py --out "$work/$name" "$@"
  cp "$work/$name"/*.md "$out/$name.md" 2>/dev/null
}

if [ $dry_run -eq 1 ]; then
  export TRITON_INTERPRET=1 TORCHDYNAMO_DISABLE=1  # the Triton kernels on CPU tensors; torch.compile'd code as Python
  step core_attention 300 "$py" benchmarks/core_attention.py --smoke
  step gpu_tests 300 "$py" -m pytest -q -p no:cacheprovider tests/test_diff_epilogue.py tests/test_attention.py -x
  throughput throughput_830m 600 --model debug --steps 4 --micro-batch-size 2 --micro-batches 8 trainer.fusions=on
  throughput throughput_3b 600 --model debug --steps 4 --micro-batch-size 1 --micro-batches 8 --seq-length 128 \
    --fit-gib 80 trainer.fusions=on
else
  step core_attention 75 "$py" benchmarks/core_attention.py --heads 8 --head-dim 128 --seq-len 4096 --batch 4 \
    --out "$out"
  step gpu_tests 75 "$py" -m pytest -q -p no:cacheprovider -m gpu --timeout 60 -rA \
    tests/test_diff_epilogue.py tests/test_attention.py
  throughput throughput_830m 180 --model 830m --seq-length 2048 --micro-batch-size 4 --micro-batches 8 --steps 8 \
    trainer.init_on_gpu=true
  throughput throughput_3b 190 --model 3b --seq-length 4096 --micro-batch-size 1 --micro-batches 8 --steps 5 \
    --fit-gib 80 optim=adamw_3b trainer.init_on_gpu=true
  if [ $all -eq 1 ]; then
    smoke() {
      local backend="$1" steps="$2"
      "$py" train.py experiment=smoke model.attention_backend="$backend" trainer.max_steps="$steps" \
        trainer.eval_interval=5 checkpoint.interval=5 hydra.run.dir="$work/smoke-$backend"
    }
    smoke_resume() { smoke "$1" 10 && smoke "$1" 16 && tail -n 3 "$work/smoke-$1/metrics.jsonl"; }
    export -f smoke smoke_resume
    export py work
    step smoke_auto 120 bash -c 'smoke_resume auto'
    step smoke_triton 120 bash -c 'smoke_resume triton'
    step all_gpu_tests 300 "$py" -m pytest -q -p no:cacheprovider -m gpu --timeout 120 -rA --durations=0
    step attention 80 "$py" benchmarks/attention.py --seq-lens 2048 4096 8192 16384 --head-dim 128 --tokens 16384
    step eval_check 240 env OUT="$work/eval" bash benchmarks/gpu_eval_check.sh "$wheels"
  fi
fi

echo
echo "=== summary ($( [ $dry_run -eq 1 ] && echo dry run || echo GPU ))"
grep -h -E "passed|failed|error" "$out/gpu_tests.log" 2>/dev/null | tail -n 1
sed -n '/^| module/,/^$/p' "$out/core_attention.log" 2>/dev/null
grep -h -A 4 "^SDPA kernels" "$out/core_attention.log" 2>/dev/null
for name in throughput_830m throughput_3b; do
  [ -f "$out/$name.md" ] || { echo "$name: no result (see $out/$name.log)"; continue; }
  echo "--- $name"
  sed -n '/^| attention (backend)/,/^$/p' "$out/$name.md"
  grep -h "tokens/s at TP" "$out/$name.md"
  sed -n '/^| kind of work/,/^$/p' "$out/$name.md"
done
ls -1 "$out"
exit $status
