#!/usr/bin/env bash
# The GPU check of the CUDA + NCCL path, in one go, without installing gradsift
# (PYTHONPATH=src). On one NVIDIA GPU it takes under 8 minutes; each step has its own timeout.
#   benchmarks/gpu/check.sh [OUT]             on a machine with a CUDA GPU (default OUT: benchmarks/gpu/results)
#   benchmarks/gpu/check.sh --dry-run [OUT]   every step on CPU at toy sizes (the tests run this)
# Writes OUT/check.json (check.py's results), OUT/cuda-tests.txt and OUT/demo-quick.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-.venv/bin/python}
[ -x "$py" ] || command -v "$py" >/dev/null || py=python3
device=cuda
if [ "${1:-}" = "--dry-run" ]; then
  shift
  device=cpu
fi
out=${1:-benchmarks/gpu/results}
mkdir -p "$out"
started=$(date +%s)
status=0
echo "== check.py ($device)"
timeout 300 "$py" benchmarks/gpu/check.py --device "$device" --json "$out/check.json" || status=1
if [ "$device" = cuda ]; then
  echo "== CUDA tests"
  timeout 120 "$py" -m pytest -q -p no:cacheprovider tests/test_devices.py tests/test_kernels.py \
    > "$out/cuda-tests.txt" 2>&1 || status=1
  tail -n 3 "$out/cuda-tests.txt"
  echo "== gradsift demo --quick (the demo on CUDA: NCCL with enough GPUs, else gloo on CPU)"
  timeout 150 "$py" -m gradsift demo --quick --localhost --out "$out/demo" > "$out/demo-quick.txt" 2>&1 || status=1
  tail -n 5 "$out/demo-quick.txt"
fi
echo "== done in $(( $(date +%s) - started )) s (status $status)"
exit $status
