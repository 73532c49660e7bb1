#!/usr/bin/env bash
# The exchanges of the scaling benchmark, worker count by worker count: SIDCo (sidco-exp,
# ratio 0.01) through the allgather, balanced and shared-mask exchanges, and dense fp32
# (the reference), each over 100 Mbit/s emulated links and on localhost (the CPU-bound
# floor). Every run takes /tmp/gradsift-cpu.lock for itself (run.py's --lock), so other
# jobs may run between two runs but never inside one; the runs of one worker count
# follow each other directly. WORKERS picks the worker counts (default: the cheap ones
# first, then the headline 16, then 8).
set -euo pipefail
cd "$(dirname "$0")/../.."
py=.venv/bin/python
run="$py benchmarks/scaling/run.py"
for p in ${WORKERS:-2 4 16 8}; do
  for mode in '' --localhost; do
    for exchange in allgather balanced shared-mask; do
      $run --label "$exchange" --compressor sidco-exp --ratio 0.01 --exchange "$exchange" --workers "$p" $mode
    done
    $run --label fp32 --compressor none --workers "$p" $mode
  done
done
$py benchmarks/scaling/analyze.py
