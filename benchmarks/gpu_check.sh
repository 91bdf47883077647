#!/usr/bin/env bash
# One GPU check, from a bare GPU machine (torch >= 2.6 with its own Triton, no network) in under 9 minutes:
#   1. the GPU tests (pytest -m gpu);
#   2. benchmarks/attention.py at N = 2K, 4K, 8K, 16K (d = 128, bf16, causal): fused V1 and V2 vs SDPA, vs the
#      2H-head baseline; fwd, bwd, both, TFLOP/s, peak memory;
#   3. training throughput of 830m at sequence 2048: DIFF sdpa, DIFF triton, vanilla sdpa (tokens/s, MFU, peak
#      memory, first and last loss).
# Writes benchmarks/results/*_<gpu>_<date>.md and prints a one-screen summary; logs go to $OUT (or ./gpu_check_out).
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
step() {  # name, command...: run, log to $out/<name>.log, remember a failure, go on with the next step
  local name="$1"; shift
  echo "=== $name: $*"
  local start=$SECONDS
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
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
export DIFF_ATTN_CACHE_DIR="$out/diff_attn_cache"

if [ $dry_run -eq 1 ]; then
  export TRITON_INTERPRET=1  # the fused kernel on CPU tensors
  step gpu_tests "$py" -m pytest -q -p no:cacheprovider tests/test_diff_attn_kernel.py -x
  step attention "$py" benchmarks/attention.py --smoke
  step train_throughput "$py" benchmarks/train_throughput.py --model debug --steps 6 --tp 1 --out "$out" \
    --kinds diff:sdpa diff:triton vanilla:sdpa
else
  step gpu_tests "$py" -m pytest -q -p no:cacheprovider -m gpu --timeout 240
  step attention "$py" benchmarks/attention.py --seq-lens 2048 4096 8192 16384 --head-dim 128 --tokens 16384
  step train_throughput "$py" benchmarks/train_throughput.py trainer.micro_batch_size=4 trainer.global_batch_size=8 \
    model.seq_length=2048 --model 830m --steps 30 --tp 1 --kinds diff:sdpa diff:triton vanilla:sdpa
fi

echo
echo "=== summary ($( [ $dry_run -eq 1 ] && echo dry run || echo GPU ))"
grep -h -E "passed|failed|error" "$out/gpu_tests.log" | tail -n 1
grep -h -E "^\| V1 fused|^\| base" "$out/attention.log" | head -n 8
grep -h -E "tok/s|MFU|ratio" "$out/train_throughput.log" | head -n 12
ls -1 benchmarks/results/*"$(date +%Y-%m-%d)"* 2>/dev/null
exit $status
