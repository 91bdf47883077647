#!/usr/bin/env bash
# Prepare, on any machine that reaches PyPI, the wheels a bare GPU image lacks (it brings torch, Triton,
# sentencepiece, numpy, scipy, matplotlib, pyarrow, psutil, tqdm): megatron-core, hydra-core, omegaconf,
# antlr4-python3-runtime (an sdist on PyPI: built into a wheel here), zstandard, and pytest-xdist with execnet (the
# test suite's addopts run it on two workers), for CPython 3.12 on x86-64.
#
#   bash benchmarks/gpu_wheels.sh [DIR]        # default DIR: .whl (add /.whl/ to .git/info/exclude)
#
# On the GPU machine, benchmarks/gpu_run.sh installs them with --no-index from DIR (benchmarks/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.whl}"
py="${PYTHON:-python3}"
mkdir -p "$dir"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$dir" megatron-core==0.16.1 zstandard==0.25.0
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 -d "$dir" \
  hydra-core==1.3.8 omegaconf==2.3.1 pytest-xdist==3.8.0 execnet==2.1.2
"$py" -m pip wheel --quiet --no-deps -w "$dir" antlr4-python3-runtime==4.9.3
ls -1 "$dir"
