#!/usr/bin/env bash
# Install flash-attn-4 on the GPU machine from the two halves benchmarks/gpu_wheels.sh --fa4 prepared (.whl_fa4a,
# carried by one command, and .whl_fa4b, by the next: together over the 64 MiB one command carries): join the CUDA 13
# libraries' wheel, check it against its checksum, install the set without an index into SITE.
#
#   bash benchmarks/fa4_install.sh PYTHON SITE        # gpu_run.sh's fa4 plan runs it
set -euo pipefail
cd "$(dirname "$0")/.."
py="$1" site="$2"
for half in .whl_fa4a .whl_fa4b; do
  if ! ls "$half"/* > /dev/null 2>&1; then
    echo "error: fa4_install.sh: $half is missing or empty; carry .whl_fa4a with one command and .whl_fa4b with the" \
         "next (benchmarks/gpu_wheels.sh --fa4)" >&2
    exit 2
  fi
done
dest=$(mktemp -d)  # the joined set, a directory of this command's own
cp .whl_fa4b/*.whl "$dest"/
for sum in .whl_fa4b/*.sha256; do
  wheel=$(basename "$sum" .sha256)
  cat .whl_fa4a/"$wheel".part-* .whl_fa4b/"$wheel".part-* > "$dest/$wheel"
  (cd "$dest" && sha256sum --check --quiet "$OLDPWD/$sum")
done
"$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$dest"/*.whl
# as a site directory: its .pth files put the CuTe DSL's packages on sys.path (gpu_run.sh's site_path exports them)
"$py" -c "
import site, sys; site.addsitedir(sys.argv[1])
import importlib.metadata as m, flash_attn.cute
print('flash-attn-4', m.version('flash-attn-4'), 'with nvidia-cutlass-dsl', m.version('nvidia-cutlass-dsl'), 'installed')" "$site"
