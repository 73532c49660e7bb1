#!/usr/bin/env bash
# Accuracy at equal steps (not a timing: localhost, nice 10, no CPU lock): SIDCo
# (sidco-exp, ratio 0.01) through allgather, balanced and shared-mask on mlp-wide with
# the scaling benchmark's configuration (8 samples per worker, lr 0.05), STEPS steps,
# test accuracy every 100 steps, for each seed in SEEDS and worker count in WORKERS.
# Writes accuracy/<exchange>-w<P>-s<seed>/ (a run whose summary.json exists is skipped), its
# summary.json stamped by benchmarks/provenance.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=results/scaling/accuracy
for p in ${WORKERS:-16}; do
  for seed in ${SEEDS:-0 1 2}; do
    for exchange in allgather balanced shared-mask; do
      run=$out/$exchange-w$p-s$seed
      [ -e "$run/summary.json" ] && continue
      nice -n 10 .venv/bin/python benchmarks/provenance.py --json "$run/summary.json" --seed "$seed" -- \
        .venv/bin/python -m gradsift train --model mlp-wide --lr 0.05 --seed "$seed" \
        --data-dir /usr/share/datasets/fashion-mnist --no-progress --workers "$p" --batch-size 8 \
        --compressor sidco-exp --ratio 0.01 --exchange "$exchange" --steps "${STEPS:-300}" \
        --eval-every 100 --out "$run" > /dev/null
    done
  done
done
