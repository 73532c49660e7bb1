#!/usr/bin/env bash
# The baselines of the scaling benchmark, point by point: at each worker count, dense
# fp32 and bf16 allreduce and SIDCo through the variable-size allgather, each over
# 100 Mbit/s emulated links and on localhost (the CPU-bound floor), back to back under
# one hold of /tmp/gradsift-cpu.lock (so the ratios at one worker count are measured
# side by side; other jobs run between worker counts).
set -euo pipefail
cd "$(dirname "$0")/../.."
py=.venv/bin/python
run="$py benchmarks/scaling/run.py --lock="
for p in ${WORKERS:-2 4 8 16}; do
  flock /tmp/gradsift-cpu.lock bash -c "
    for mode in '' --localhost; do
      $run --label fp32 --compressor none --workers $p \$mode
      $run --label bf16 --compressor bf16 --workers $p \$mode
      $run --label allgather-sidco --compressor sidco-exp --ratio 0.01 --workers $p \$mode
    done"
done
$py benchmarks/scaling/analyze.py
