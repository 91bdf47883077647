#!/usr/bin/env bash
# Long context on one GPU (README, "Long context"), from a bare GPU image, in about 5 minutes:
#   bash benchmarks/long_context_gpu.sh .whl      (wheels from benchmarks/gpu_wheels.sh; logs and results under $OUT)
# 1. the ring's CUDA block primitive (flash for bf16 with equal head sizes, memory-efficient otherwise) inside a ring
#    of two threads sharing the GPU, against the fp64 reference, and DIFF's fused ring (the compiled kernel pieces,
#    bf16) against the fp32 eager maps (the gpu tests of tests/test_context_parallel.py);
# 2. the fused kernel's forward+backward time and peak memory at N = 8K, 16K, 32K and 64K for one 3b layer shape
#    (12 differential heads of d = 128, bf16, batch 1), next to two SDPA calls and the baseline (benchmarks/attention.py;
#    memory linear in N: the peak at 64K about twice the one at 32K);
# 3. evaluate's NIAH (6 needles, 2 asked) and perplexity at 32K on a quickstart model trained at 128 tokens, with the
#    fused kernel: time and peak memory (eval.json's peak_memory_gib).
# One GPU cannot run context parallelism itself (several ranks on one GPU under NCCL are refused); the CPU tests run it.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels="${1:-.whl}"
out="${OUT:-outputs/long_context_gpu}"
mkdir -p "$out"
py="${PYTHON:-python3}"
if ! "$py" -c "import megatron.core, hydra" 2> /dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_check_site "$wheels"/*.whl
  export PYTHONPATH="/tmp/gpu_check_site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export WANDB_MODE=disabled PYTHONWARNINGS=ignore
step() {  # name, time limit in seconds, command...: one failure hides no other result
  local name="$1" limit="$2"
  shift 2
  echo "== $name"
  if timeout "$limit" "$@" > "$out/$name.log" 2>&1; then echo "ok ($name)"; else echo "FAILED ($name): $out/$name.log"; fi
  tail -25 "$out/$name.log"
}
step ring_cuda 240 "$py" -m pytest -q -m gpu tests/test_context_parallel.py -k cuda
step kernel_3b_long 420 "$py" benchmarks/attention.py --seq-lens 8192 16384 32768 65536 --tokens 65536 --heads 12 \
  --head-dim 128 --no-write
step quickstart 300 "$py" train.py experiment=quickstart trainer.max_steps=100 trainer.eval_interval=50 \
  checkpoint.interval=100 logging.wandb.mode=disabled hydra.run.dir="$out/quickstart"
step niah_32k 600 "$py" -m diff_transformer.evaluate "$out/quickstart" --tasks niah,ppl --seq-length 32768 \
  --lengths 32768 --needles 6 --asked 2 --depths 0,0.25,0.5,0.75,1 --samples 2 --batch-size 1 --max-tokens 140000 \
  --backend triton --out "$out/niah_32k"
if [ -f "$out/niah_32k/eval.json" ]; then
  "$py" -c "import json; d=json.load(open('$out/niah_32k/eval.json')); print(d['run'], d['peak_memory_gib'], \
d['niah']['accuracy'], d['ppl']['validation']['nll'])"
fi
