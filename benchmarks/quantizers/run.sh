#!/usr/bin/env bash
# Fashion-MNIST training comparison of the quantizers and PowerSGD against the dense
# baselines: 4 workers on one machine, links shaped to 100 Mbit/s, MLP, 300 steps.
# Usage (from the repository root): flock /tmp/gradsift-bench.lock benchmarks/quantizers/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/quantizers/results
mkdir -p "$out"
for name in none bf16 qsgd terngrad signsgd efsignsgd powersgd; do
  python benchmarks/quantizers/train_one.py --model mlp --compressor "$name" --workers 4 --steps 300 \
    --bandwidth 100mbit --target-accuracy 0.8 --out "/tmp/gradsift-quantizers/$name" \
    --json "$out/$name.json" --no-progress
done
