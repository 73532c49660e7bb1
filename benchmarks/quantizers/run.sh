#!/usr/bin/env bash
# Fashion-MNIST training comparison of the quantizers and PowerSGD against the dense
# baselines, sidco-exp and vgc: 4 workers on one machine, links shaped to 100 Mbit/s,
# MLP, 300 steps.
# Usage (from the repository root): flock /tmp/gradsift-cpu.lock benchmarks/quantizers/run.sh [NAME...]
# With no NAME, every method below runs. Each result is stamped by benchmarks/provenance.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=results/quantizers
mkdir -p "$out"
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(none bf16 qsgd terngrad signsgd efsignsgd powersgd sidco-exp vgc)
for name in "${names[@]}"; do
  extra=()
  [ "$name" = sidco-exp ] && extra=(--ratio 0.01)
  python benchmarks/provenance.py --json "$out/$name.json" --seed 0 -- \
    python -m gradsift train --model mlp --compressor "$name" "${extra[@]}" --workers 4 --steps 300 \
    --bandwidth 100mbit --target-accuracy 0.8 --out "/tmp/gradsift-quantizers/$name" \
    --json "$out/$name.json" --no-progress
done
