#!/usr/bin/env bash
# The GPU check on one GPU, under 8 minutes, without installing gradsift (python3 or $PYTHON,
# PYTHONPATH=src); exits non-zero when a check fails. --dry-run: on CPU at toy sizes (tests).
#   benchmarks/gpu/check.sh [--dry-run] [OUT]     OUT: default $OUT, else results/gpu
# Writes to OUT check.json, train.txt, train-summary.json, cuda-tests.txt (with pytest), check.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" NCCL_SOCKET_IFNAME=lo
py=${PYTHON:-python3}
device=cuda steps=50
if [ "${1:-}" = "--dry-run" ]; then
  shift
  device=cpu steps=3
fi
out=${1:-${OUT:-results/gpu}}
mkdir -p "$out"
exec > >(tee "$out/check.log") 2>&1
started=$(date +%s)
status=0
echo "== check.py ($device)"
timeout 270 "$py" benchmarks/gpu/check.py --device "$device" --json "$out/check.json" || status=1
echo "== gradsift train --device $device --workers 1, $steps steps (synthetic data)"
train=$(mktemp -d)
timeout 100 "$py" -m gradsift train --device "$device" --workers 1 --steps "$steps" --synthetic --no-progress \
  --out "$train/run" > "$out/train.txt" 2>&1 || status=1
cp "$train/run/summary.json" "$out/train-summary.json" 2>/dev/null || { echo "no summary.json"; status=1; }
rm -rf "$train"
tail -n 4 "$out/train.txt"
if [ "$device" = cuda ]; then
  if "$py" -c "import pytest" 2>/dev/null; then
    echo "== CUDA tests"
    timeout 90 "$py" -m pytest -q -p no:cacheprovider tests/compressors/test_devices.py tests/compressors/test_kernels.py \
      > "$out/cuda-tests.txt" 2>&1 || status=1
    tail -n 3 "$out/cuda-tests.txt"
  else
    echo "== CUDA tests skipped: pytest is not installed for $py"
  fi
fi
echo "== done in $(( $(date +%s) - started )) s (status $status)"
exit $status
