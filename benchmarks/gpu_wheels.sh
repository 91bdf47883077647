#!/usr/bin/env bash
# Prepare, on any machine that reaches PyPI, the wheels a bare GPU image lacks (it brings torch, Triton,
# sentencepiece, numpy, scipy, matplotlib, pyarrow, psutil, tqdm): megatron-core, hydra-core, omegaconf,
# antlr4-python3-runtime (an sdist on PyPI: built into a wheel here), and pytest-xdist with execnet (the test suite's
# addopts run it on two workers), for CPython 3.12 on x86-64 (2.9 MiB). Not zstandard (5.3 MiB): only the corpus
# readers import it, for .zst files, and no GPU plan reads one.
#
#   bash benchmarks/gpu_wheels.sh [DIR]        # default DIR: .whl (git-ignored)
#   bash benchmarks/gpu_wheels.sh --fa4        # flash-attn-4 and its CuTe DSL for CUDA 13 (about 106 MiB): .whl_fa4a
#                                              # (51 MiB, carried with .whl) and .whl_fa4b (55 MiB), each with the
#                                              # tracked files under the 64 MiB one command carries
#
# On the GPU machine, benchmarks/gpu_run.sh installs them with --no-index from DIR (benchmarks/README.md); the fa4
# plan joins the two halves of flash-attn-4's set, carried by two commands, and installs it.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
if [ "${1:-}" = "--fa4" ]; then
  # the versions the project's backend was written against (diff_transformer/models/attention/base.py); the CuTe DSL's
  # CUDA 13 libraries match the GPU image's torch (cu130)
  for half in .whl_fa4a .whl_fa4b; do  # never replace files this command may not have written
    if [ -n "$(ls -A "$half" 2> /dev/null)" ]; then
      echo "error: gpu_wheels.sh: $half already holds files; move it away (or delete it) to prepare flash-attn-4's" \
           "halves again" >&2
      exit 2
    fi
  done
  tmp=$(mktemp -d)
  "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$tmp" flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
    nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 \
    apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops==0.8.2 cuda-bindings==13.5.0 \
    cuda-pathfinder==1.9.1 protobuf==7.36.2
  mkdir -p .whl_fa4a .whl_fa4b
  # the CUDA 13 libraries' wheel (88 MiB) in two pieces: 51 MiB go with .whl (3 MiB) in the first command, the rest
  # with every other wheel in the second (55 MiB): each command then carries about 61 MiB with the tracked files
  big=$(cd "$tmp" && ls -S | head -n 1)
  (cd "$tmp" && sha256sum "$big" > "$big.sha256" && split -b 51M -d "$big" "$big.part-" && rm "$big")
  mv "$tmp/$big.part-00" .whl_fa4a/
  mv "$tmp"/* .whl_fa4b/  # the other piece, the whole wheel's checksum, every other wheel
  du -sh .whl_fa4a .whl_fa4b
  ls -1 .whl_fa4a .whl_fa4b
  rm -rf "$tmp"
  exit 0
fi
dir="${1:-.whl}"
mkdir -p "$dir"
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$dir" megatron-core==0.16.1
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 -d "$dir" \
  hydra-core==1.3.8 omegaconf==2.3.1 pytest-xdist==3.8.0 execnet==2.1.2
"$py" -m pip wheel --quiet --no-deps -w "$dir" antlr4-python3-runtime==4.9.3
ls -1 "$dir"
