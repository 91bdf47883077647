#!/usr/bin/env bash
# The GPU measurements, in priority order under one deadline, from a bare GPU machine (benchmarks/README.md has the
# recipe). Every result line goes to $OUT as soon as it exists: a step cut off by its limit, or a command cut off by
# the machine's, keeps what it measured.
#
#   bash benchmarks/gpu_run.sh [PLAN...] [--deadline 570] [--wheels .whl]   # on the GPU machine (no plan: the window's)
#   bash benchmarks/gpu_run.sh --dry-run first                            # on a CPU: what CI runs, one plan a test
#
# Plans (steps in order; each step has a limit, its cold-start time on one H100/H200 with room, cut to what is left of
# the deadline, and a need, the least time it can finish in (measured on an H100 where it has run, with a little
# room; an estimate where it has not): a step with less than its need left is skipped and says so, rather than spend
# the window on a run that the deadline cuts off). Without a plan named: fa4 first second kernels long, the window's
# order (what nobody has measured, then 3b, then the kernel rows); fa4 is skipped at once where its second half has
# not come yet, so that the same command line serves both of a window's commands (benchmarks/README.md):
#   fa4     flash-attn-4 (two carried halves, benchmarks/gpu_wheels.sh --fa4): installed, then 830m throughput under
#           trainer.compile with it in the layers' graphs
#   first   830m at sequence 2048 under trainer.compile on sdpa, each with one step's profile (every throughput step
#           with trainer.fusions and trainer.grad_accumulation_fusion on): DIFF and the baseline; DIFF V2 and its
#           mirrored baseline; DIFF and the baseline in 4 micro-batches of 8 (the same 32 sequences a step)
#   second  3b throughput at sequence 4096 under trainer.compile with the least recomputation whose memory plan fits
#           the card (--fit-gib auto); the fused kernel's config sweep (benchmarks/kernel_tuning.py); document
#           masking's gpu tests and core attention at 4K and 32K (benchmarks/document_mask.py); evaluate and analyze on
#           a run trained with the attention diagnostics
#   kernels trainer.fusions' compiled RoPE and cross-entropy against what they replace (benchmarks/fusions.py); the
#           host's time a core-attention call and a Triton launch (benchmarks/host_overhead.py); the GPU tests of the
#           kernels, the epilogue, RoPE, the attention backends and the CUDA ring; core attention at d=128 (N=4096) and
#           d=96 (the 830m shape), the fused kernel's row first; where flash-attn-4 is installed, its gpu tests and
#           the baseline and DIFF V1 on it against sdpa at both head dims; 830m eagerly with auto's choice
#   long    long context: the fused kernel and the baselines at N = 8K-64K; evaluate (NIAH, perplexity) at 32K
# A step already measured on this card by this code (the ledger, $GPU_RUN_LEDGER or .gpu_run/ledger.tsv: card, code
# hash, step, exit status) is skipped; the ledger stays on the machine between commands, and gpu_run.md says what each step did.
#
# Files in $OUT (flat; a command sends back at most 8): gpu_run.md (one line per step: status, seconds, the headline
# numbers), gpu_run.log (every step's output: evaluate's and analyze's tables too), step_running.log while a step
# runs, and the benchmarks' reports (core_attention_*.md, train_throughput_*.md, kernel_tuning_*.md, attention_*.md).
#
# --dry-run runs every step on the CPU at toy sizes: Triton's interpreter with the launchers planning as on an H100
# (DIFF_ATTN_SIMULATE_GPU=sm_90, kernels/gpu_target.py), the same scripts, options and step order. CI runs it
# (tests/test_gpu_run.py): on a GPU only the compiler differs from what CI ran.
set -uo pipefail
cd "$(dirname "$0")/.."
dry_run=0
deadline=""
wheels=".whl"
plans=()
default_plans=(fa4 first second kernels long)  # the window's order
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --deadline) deadline="$2"; shift ;;
    --wheels) wheels="$2"; shift ;;
    fa4|first|second|kernels|long) plans+=("$1") ;;
    *) echo "error: gpu_run.sh: unknown argument '$1'; expected plans (${default_plans[*]}), --dry-run," \
         "--deadline S, --wheels DIR" >&2
       exit 2 ;;
  esac
  shift
done
# the GPU's deadline fits one 600 s command; a CPU's dry run (toy sizes, interpreted kernels, a CI machine that may be
# busy) gets an hour and three times each step's limit, so that it never skips a step for want of time
[ -n "$deadline" ] || deadline=$([ $dry_run -eq 1 ] && echo 3600 || echo 570)
[ ${#plans[@]} -gt 0 ] || plans=("${default_plans[@]}")
started=$SECONDS
out="${OUT:-outputs/gpu_run}"
ledger="${GPU_RUN_LEDGER:-.gpu_run/ledger.tsv}"
mkdir -p "$out" "$(dirname "$ledger")"
py="${PYTHON:-python3}"
summary="$out/gpu_run.md"
log="$out/gpu_run.log"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled PYTHONWARNINGS=ignore
# caches outside $OUT, kept on the machine between commands: the second command compiles nothing twice
cache="${TMPDIR:-/tmp}/gpu_run_cache"
export DIFF_ATTN_CACHE_DIR="$cache/diff_attn" DIFF_TRANSFORMER_CACHE_DIR="$cache/diff_transformer" \
  TORCHINDUCTOR_CACHE_DIR="$cache/inductor" TRITON_CACHE_DIR="$cache/triton"

# DIR and the paths its .pth files add to sys.path, ':'-joined: Python reads .pth files only in site directories, not
# in PYTHONPATH's, and the CuTe DSL's wheel puts its packages on sys.path by one (nvidia_cutlass_dsl_packages.pth)
site_path() {
  "$py" -c "import site, sys; before = list(sys.path); site.addsitedir(sys.argv[1])
print(':'.join([sys.argv[1]] + [p for p in sys.path if p not in before and p != sys.argv[1]]))" "$1"
}

if [ $dry_run -eq 1 ]; then
  export TRITON_INTERPRET=1 DIFF_ATTN_SIMULATE_GPU=sm_90 TORCHDYNAMO_DISABLE=1 CUDA_VISIBLE_DEVICES=""
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
elif ! "$py" -c "import megatron.core, hydra" 2> /dev/null; then
  if ! ls "$wheels"/*.whl > /dev/null 2>&1; then
    echo "error: megatron-core and hydra are not importable and $wheels holds no wheels (benchmarks/gpu_wheels.sh)" >&2
    exit 2
  fi
  "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_run_site "$wheels"/*.whl || exit 1
  export PYTHONPATH="$(site_path /tmp/gpu_run_site):$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$py" -c "import torch, triton, megatron.core, hydra, omegaconf" > /dev/null; then
  echo "error: gpu_run.sh: $py cannot import torch, triton, megatron-core and hydra; set PYTHON to the interpreter that has them" >&2
  exit 2
fi
card=$("$py" -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-') if torch.cuda.is_available() else 'cpu-dry-run')")
code=$(find train.py configs diff_transformer kernels benchmarks data launch tests -type f \
         \( -name '*.py' -o -name '*.sh' -o -name '*.yaml' -o -name '*.json' \) -not -path '*/results/*' \
         -not -path '*/__pycache__/*' -not -path 'data/cache/*' | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-12)
versions=$("$py" -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}')" 2>&1)
{
  echo "# gpu_run.sh ${plans[*]}$( [ $dry_run -eq 1 ] && echo ' (dry run)'): $card, code $code, $(date -u +%FT%TZ)"
  echo
  echo "$versions; deadline ${deadline} s."
  echo
  echo "| step | status | s | result |"
  echo "|---|---|---|---|"
} >> "$summary"
echo "card $card, code $code, $versions"
status=0

# step NAME LIMIT NEED RESULT_PATTERN COMMAND...: run under min(LIMIT, what the deadline leaves) if at least NEED s
# are left, append its output to the log and one line to the summary (the lines of its output matching
# RESULT_PATTERN); a failure stops nothing
step() {
  local name="$1" limit="$2" need="$3" pattern="$4"
  shift 4
  if grep -q -P "^$card\t$code\t$name\t0\t" "$ledger" 2> /dev/null; then
    echo "| $name | measured already on this card by this code | | |" >> "$summary"
    echo "=== $name: measured already ($card, code $code)"
    return 0
  fi
  [ $dry_run -eq 1 ] && limit=$((3 * limit)) && need=$((3 * need))
  local left=$((deadline - (SECONDS - started) - 5))
  if [ $left -lt "$need" ]; then
    echo "| $name | skipped: ${left} s left of the deadline, it needs ${need} s (limit ${limit} s) | | |" >> "$summary"
    echo "=== $name: skipped (${left} s left, needs ${need} s, limit ${limit} s)"
    status=1
    return 0
  fi
  [ $left -lt "$limit" ] && limit=$left
  echo "=== $name (limit ${limit} s): $*"
  echo "=== $name (limit ${limit} s): $*" >> "$log"
  local start=$SECONDS part="$out/step_running.log"  # comes back even if the machine's limit cuts the command
  timeout -k 10 "$limit" "$@" > "$part" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  tail -c 2000000 "$part" >> "$log"  # a returned file holds at most 16 MiB, over every step
  local result
  result=$(grep -E "$pattern" "$part" | tail -n 12 | tr '\n' ' ' | sed 's/|/\\|/g' | cut -c1-1500)
  rm -f "$part"
  local what="ok"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && what="TIMED OUT at ${limit} s"
  [ $rc -ne 0 ] && [ "$what" = "ok" ] && what="FAILED (exit $rc)"
  echo "| $name | $what | $took | $result |" >> "$summary"
  printf '%s\t%s\t%s\t%s\t%s\n' "$card" "$code" "$name" "$rc" "$took" >> "$ledger"
  echo "    $what after $took s: $result"
  [ $rc -eq 0 ] || status=1
}

# The dry run runs each step's GPU command line with toy sizes appended (argparse keeps an option's last value).
core_attention() {  # name, limit, need, core_attention.py arguments (a later --out wins)
  local name="$1" limit="$2" need="$3"
  shift 3
  local toy=()
  [ $dry_run -eq 1 ] && toy=(--heads 1 --seq-len 32 --batch 1 --repeats 1 --epilogues triton unfused)
  step "$name" "$limit" "$need" '^headline' "$py" benchmarks/core_attention.py --out "$out" "$@" "${toy[@]}"
}

throughput() {  # name, limit, need, train_throughput.py arguments (a later --out wins)
  local name="$1" limit="$2" need="$3"
  shift 3
  local toy=()
  [ $dry_run -eq 1 ] && toy=(--model debug --steps 3 --micro-batch-size 1 --micro-batches 1 --seq-length 32)
  # the overrides right after the step's arguments on a GPU and in the dry run alike (an option that takes several
  # values, such as --compile, takes what follows it: the dry run sees it as the GPU does), the toy sizes last
  step "$name" "$limit" "$need" '(tok/s|tokens/s at TP|FAILED)' "$py" benchmarks/train_throughput.py --out "$out" "$@" \
    trainer.init_on_gpu=true trainer.fusions=on trainer.grad_accumulation_fusion=on "${toy[@]}"
}

gpu_tests() {  # name, limit, need, pytest arguments
  local name="$1" limit="$2" need="$3"
  shift 3
  # the GPU tier; in the dry run the same command collects them and skips each (no CUDA)
  step "$name" "$limit" "$need" '(passed|failed|skipped|error|FAILED)' "$py" -m pytest -q -p no:cacheprovider -m gpu \
    --timeout 150 -rfE "$@"
}

plan_first() {
  # the 830m measurements nobody has made, under trainer.compile (the faster way on 2026-11-27: DIFF/baseline 0.866
  # against 0.794 eagerly; regional compilation keeps sdpa's core attention in the layer's graph), each with the
  # profile. The dry run's TORCHDYNAMO_DISABLE=1 runs the compiled steps eagerly, labelled so. --compile takes one
  # value or more, so an option follows it: throughput() appends overrides after a step's arguments (the dry run too).
  # DIFF and the baseline with today's RoPE, cross-entropy and fused gradient accumulation
  throughput throughput_830m_compile 300 125 --model 830m --seq-length 2048 --micro-batch-size 4 --micro-batches 8 \
    --compile on --steps 8 model.attention_backend=sdpa
  # DIFF V2 against its mirrored baseline (the Transformer with V2's 2H query heads and Hkv KV heads, gpt.v2_baseline:
  # model.num_kv_heads=4 at 830m); never measured: its need is an estimate (two compiled 830m runs took 128 s)
  throughput throughput_830m_v2_compile 300 130 --model 830m --seq-length 2048 --micro-batch-size 4 \
    --micro-batches 8 --kinds diff_v2 v2_baseline --compile on --steps 8 model.attention_backend=sdpa
  # the same 32 sequences a step in 4 micro-batches of 8, beside the step above's 8 of 4 (the plan: 50.9 GiB for
  # DIFF, 46.4 for the baseline; --fit-gib auto recomputes only where the card lacks room); need an estimate
  throughput throughput_830m_mb8_compile 300 130 --model 830m --seq-length 2048 --micro-batch-size 8 \
    --micro-batches 4 --compile on --steps 8 --fit-gib auto model.attention_backend=sdpa
  # the compiled step again with its layers as CUDA graphs (first step: compiling and recording; the log says how many
  # graphs were recorded and why any was skipped)
  throughput throughput_830m_compile_graphs 300 125 --model 830m --seq-length 2048 --micro-batch-size 4 \
    --micro-batches 8 --compile on --steps 8 model.attention_backend=sdpa trainer.cuda_graphs=layers
}

plan_kernels() {
  # the kernel rows, after the targets: trainer.fusions' compiled RoPE and cross-entropy against what they replace
  # (830m shapes; the report into the log)
  local toy=()
  [ $dry_run -eq 1 ] && toy=(--seq 32 --batch 1 --heads 2 --head-dim 16 --vocab 512 --repeats 2)
  step fusions 150 60 '^headline' "$py" benchmarks/fusions.py --out "$cache/fusions" "${toy[@]}"
  # the host's time a core-attention call, by backend, a RoPE call and each Triton kernel's launch replayed alone
  # (the 830m heads at N=128: kernels take microseconds)
  toy=()
  [ $dry_run -eq 1 ] && toy=(--calls 2 --repeats 2)
  step host_overhead 120 45 '^headline' "$py" benchmarks/host_overhead.py --out "$out" "${toy[@]}"
  gpu_tests kernel_tests 250 175 tests/test_diff_attn_kernel.py tests/test_diff_epilogue.py tests/test_rope_kernel.py \
    tests/test_attention.py tests/test_context_parallel.py tests/test_profiling.py tests/test_weight_gradient.py
  core_attention core_attention_d128 150 70 --heads 8 --head-dim 128 --seq-len 4096 --batch 4
  core_attention core_attention_d96 120 65 --heads 8 --head-dim 96 --seq-len 2048 --batch 4
  # flash-attn-4 where the fa4 plan installed it: its gpu tests (the custom operators against eager in bf16, and
  # compiled), the baseline and DIFF V1 on it against sdpa at both head dims (830m eagerly on it: measured on
  # 2026-11-27, 0.641); their reports stay on the machine ($OUT brings back 8 files), their tables in the log
  local saved_path="$PYTHONPATH"
  if fa4_on_path; then
    gpu_tests fa4_tests 200 90 tests/test_attention.py -k flash_attn4
    core_attention core_attention_fa4_d128 240 60 --heads 8 --head-dim 128 --seq-len 4096 --batch 4 \
      --v1-backends flash_attn4 sdpa --epilogues triton --v2-epilogues --out "$cache/fa4"
    core_attention core_attention_fa4_d96 200 60 --heads 8 --head-dim 96 --seq-len 2048 --batch 4 \
      --v1-backends flash_attn4 sdpa --epilogues triton --v2-epilogues --out "$cache/fa4"
  else
    echo "| fa4 kernel rows | skipped: flash-attn-4 is not importable (the fa4 plan installs it) | | |" >> "$summary"
    echo "=== fa4 kernel rows: skipped, flash-attn-4 is not importable"
    status=1
  fi
  export PYTHONPATH="$saved_path"
  # 830m eagerly with auto's choice (measured on 2026-11-27 on code whose eager path is today's)
  throughput throughput_830m 300 125 --model 830m --seq-length 2048 --micro-batch-size 4 --micro-batches 8 --steps 8
}

plan_second() {
  # 3b under trainer.compile (auto: the backends the compiled graph keeps, timed where more than sdpa is installed)
  # with the least recomputation whose memory plan fits the card (--fit-gib auto; on an H100 block recomputation of
  # 10 of DIFF's 28 layers and 7 of the baseline's, on an H200 none); never measured yet: the need is an estimate (two
  # processes of a 3b model and its compile)
  throughput throughput_3b 330 200 --model 3b --seq-length 4096 --micro-batch-size 1 --micro-batches 8 \
    --compile on --steps 5 --fit-gib auto optim=adamw_3b
  if [ $dry_run -eq 1 ]; then
    step kernel_sweep 300 100 '(^done in|^error)' "$py" benchmarks/kernel_tuning.py --smoke --versions v1 --budget-s 10
  else
    # its JSON lines stay on the machine (the log has them too); the report comes back
    step kernel_sweep 300 100 '(^done in|^error)' bash -c "'$py' benchmarks/kernel_tuning.py --budget-s 240 \
      --out '$cache/kernel_tuning'; rc=\$?; cp '$cache'/kernel_tuning/*.md '$out/' 2> /dev/null; exit \$rc"
  fi
  # document masking: the gpu tests (the kernel with document ids in bf16, sdpa's variable-length flash), then the
  # core attention masked against unmasked, sdpa and the fused kernel
  gpu_tests document_mask_tests 150 100 tests/test_document_mask.py
  local toy=()
  [ $dry_run -eq 1 ] && toy=(--seq-lens 64 --heads 1 --head-dim 16 --mean-document 20 --repeats 1 --backends sdpa triton)
  # its report is printed into the log ($OUT keeps to few files)
  step document_mask 180 90 '(masked:|^error|Traceback)' "$py" benchmarks/document_mask.py --skip-training \
    --seq-lens 4096 32768 --out "$cache/document_mask" "${toy[@]}"
  # evaluate and analyze on a run trained with the attention diagnostics (bf16 on the GPU)
  local train="experiment=smoke trainer.max_steps=4 optim.warmup_steps=1 checkpoint.interval=4"
  [ $dry_run -eq 1 ] || train="experiment=quickstart trainer.max_steps=40 trainer.eval_interval=20 checkpoint.interval=20"
  step eval_analyze 240 120 '(NIAH accuracy|^error)' bash -c "'$py' train.py $train trainer.attention_diagnostics=on \
    logging.wandb.mode=disabled hydra.run.dir='$cache/eval_run' overwrite_run=true && \
    '$py' -m diff_transformer.evaluate '$cache/eval_run' --needles 2 --asked 1 --samples 2 --max-tokens 20000 \
      --out '$cache/evaluate' && '$py' -m diff_transformer.analyze '$cache/eval_run' --out '$cache/analyze'"
}

plan_long() {
  if [ $dry_run -eq 1 ]; then
    step kernel_long 200 70 '(^\| V1|^\| baseline|error)' "$py" benchmarks/attention.py --smoke
    step niah_long 300 150 '(accuracy|nll|error)' bash -c "'$py' train.py experiment=smoke trainer.max_steps=4 \
      optim.warmup_steps=1 checkpoint.interval=4 logging.wandb.mode=disabled hydra.run.dir='$cache/long_run' overwrite_run=true && \
      '$py' -m diff_transformer.evaluate '$cache/long_run' --tasks niah,ppl --seq-length 256 --lengths 256 \
      --needles 2 --asked 1 --depths 0,1 --samples 1 --batch-size 1 --max-tokens 2000 --out '$cache/long_eval'"
  else
    step kernel_long 240 80 '(^\| V1|^\| baseline|error)' "$py" benchmarks/attention.py --seq-lens 8192 16384 32768 \
      65536 --tokens 65536 --heads 12 --head-dim 128 --out "$out"
    step niah_long 300 150 '(accuracy|nll|error)' bash -c "'$py' train.py experiment=quickstart trainer.max_steps=100 \
      trainer.eval_interval=50 checkpoint.interval=100 logging.wandb.mode=disabled hydra.run.dir='$cache/long_run' \
      overwrite_run=true && '$py' -m diff_transformer.evaluate '$cache/long_run' --tasks niah,ppl --seq-length 32768 \
      --lengths 32768 --needles 6 --asked 2 --depths 0,0.25,0.5,0.75,1 --samples 2 --batch-size 1 \
      --max-tokens 140000 --backend triton --out '$cache/long_eval'"
  fi
}

fa4_site() {
  # where flash-attn-4 is: the GPU's install (benchmarks/fa4_install.sh), or the dry run's CPU stand-ins
  # (tests/stand_ins), put on sys.path by a .pth file as the CuTe DSL's packages are
  if [ $dry_run -eq 1 ]; then
    mkdir -p "$cache/fa4_site"
    echo "import sys; sys.path.insert(0, '$PWD/tests/stand_ins')" > "$cache/fa4_site/stand_ins.pth"
    echo "$cache/fa4_site"
  else
    echo /tmp/gpu_run_site
  fi
}

fa4_on_path() {  # flash-attn-4's site on PYTHONPATH (its .pth files' paths too); whether it imports
  export PYTHONPATH="$(site_path "$(fa4_site)"):$PYTHONPATH"
  "$py" -c "import flash_attn.cute" > /dev/null 2>&1
}

plan_fa4() {
  # flash-attn-4 (model.attention_backend=flash_attn4): its wheel set comes in two halves (benchmarks/gpu_wheels.sh
  # --fa4), .whl_fa4a with one command and .whl_fa4b with the next; where the second has not come yet (a window's
  # first command) the plan is skipped at once. Its kernel rows are the kernels plan's.
  local saved_path="$PYTHONPATH"
  if [ $dry_run -eq 0 ] && ! ls .whl_fa4b/* > /dev/null 2>&1 && ! fa4_on_path; then
    echo "| fa4 | skipped: .whl_fa4b is not here (flash-attn-4's second half comes with a window's second command)" \
      "| | |" >> "$summary"
    echo "=== fa4: skipped, .whl_fa4b is not here"
    status=1
    export PYTHONPATH="$saved_path"
    return 0
  fi
  local site
  site=$(fa4_site)
  if [ $dry_run -eq 1 ]; then
    step fa4_install 60 30 '(flash-attn-4|error)' "$py" -c "import site, sys; site.addsitedir('$site'); import flash_attn.cute
print('flash-attn-4: CPU stand-in')"
  else
    step fa4_install 120 30 '(flash-attn-4|error)' bash benchmarks/fa4_install.sh "$py" "$site"
  fi
  if ! fa4_on_path; then  # its steps would time sdpa alone
    echo "| fa4 (the rest) | skipped: flash-attn-4 is not importable (fa4_install above) | | |" >> "$summary"
    echo "=== fa4: skipped, flash-attn-4 is not importable"
    status=1
    export PYTHONPATH="$saved_path"
    return 0
  fi
  # 830m under trainer.compile with flash-attn-4 in the layers' graphs (its custom operators,
  # models/attention/flash_attn4_op.py): DIFF V1's one call over the 2d-wide V, 1.5x the baseline's attention FLOPs
  # against sdpa's 2x, with the host's work compiled away; the baseline on sdpa (the ratio's first) and on it
  throughput throughput_830m_fa4_compile 360 240 --model 830m --seq-length 2048 --micro-batch-size 4 \
    --micro-batches 8 --kinds diff:flash_attn4 vanilla:sdpa vanilla:flash_attn4 --compile on --steps 8
  export PYTHONPATH="$saved_path"
}

for plan in "${plans[@]}"; do
  "plan_$plan"
done
echo >> "$summary"
echo
cat "$summary"
echo "gpu_run.sh: $((SECONDS - started)) s; files in $out: $(ls "$out" | tr '\n' ' ')"
exit $status
