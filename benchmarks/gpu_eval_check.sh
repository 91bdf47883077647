#!/usr/bin/env bash
# evaluate, analyze and the training-time attention diagnostics on one GPU (bf16), from a bare GPU image:
#   bash benchmarks/gpu_eval_check.sh .whl      (wheels from benchmarks/gpu_wheels.sh; logs and results under $OUT)
set -euo pipefail
cd "$(dirname "$0")/.."
wheels="${1:-.whl}"
out="${OUT:-outputs/gpu_eval_check}"
mkdir -p "$out"
py="${PYTHON:-python3}"
if ! "$py" -c "import megatron.core, hydra" 2> /dev/null; then  # gpu_check.sh has installed them already
  "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_check_site "$wheels"/*.whl
  export PYTHONPATH="/tmp/gpu_check_site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export WANDB_MODE=disabled PYTHONWARNINGS=ignore
"$py" train.py experiment=quickstart trainer.max_steps=40 trainer.eval_interval=20 trainer.attention_diagnostics=on \
  checkpoint.interval=20 logging.wandb.mode=disabled hydra.run.dir="$out/tiny_diff" > "$out/train.log" 2>&1
grep -o '"attn/[a-z_]*": [^]]*\]\?' "$out/tiny_diff/metrics.jsonl" | tail -4
"$py" -m diff_transformer.evaluate "$out/tiny_diff" --needles 2 --asked 1 --samples 2 --max-tokens 20000 \
  --out "$out/evaluate" 2>&1 | tail -6
"$py" -c "import json; d=json.load(open('$out/evaluate/eval.json')); print(d['run'])"
"$py" -m diff_transformer.analyze "$out/tiny_diff" --out "$out/analyze" 2>&1 | tail -4
"$py" -c "import json; d=json.load(open('$out/analyze/analysis.json')); print(d['run'], d['lambda_trajectory'])"
"$py" benchmarks/attention_diagnostics.py --steps 30 --out "$out"
