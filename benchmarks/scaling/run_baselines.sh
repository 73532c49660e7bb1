#!/usr/bin/env bash
# The baselines of the scaling benchmark, point by point (all series at one worker count
# back to back, so their ratios are measured side by side): dense fp32 and bf16
# allreduce, SIDCo through the variable-size allgather, each over 100 Mbit/s emulated
# links and on localhost (the CPU-bound floor). Every run takes /tmp/gradsift-cpu.lock.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=.venv/bin/python
run="$py benchmarks/scaling/run.py"
for p in ${WORKERS:-2 4 8 16}; do
  for mode in "" --localhost; do
    $run --label fp32 --compressor none --workers "$p" $mode
    $run --label bf16 --compressor bf16 --workers "$p" $mode
    $run --label allgather-sidco --compressor sidco-exp --ratio 0.01 --workers "$p" $mode
  done
done
$py benchmarks/scaling/analyze.py
