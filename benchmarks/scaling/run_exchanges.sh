#!/usr/bin/env bash
# The exchanges of the scaling benchmark, worker count by worker count: SIDCo (sidco-exp,
# ratio 0.01) through the allgather, balanced and shared-mask exchanges, and dense fp32
# (the reference), each over 100 Mbit/s emulated links and on localhost (the CPU-bound
# floor). The runs of one worker count go back to back under one hold of
# /tmp/gradsift-cpu.lock (so the ratios at one worker count are measured side by side;
# other jobs run between worker counts). A run whose results file exists is skipped
# (delete it to re-measure). WORKERS picks the worker counts (default: the cheap ones
# first, then the headline 16, then 8), SERIES the series; LOCK= (empty) takes no lock
# per worker count, for a caller that holds it around several.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=.venv/bin/python
results=results/scaling/results
point() {  # label workers mode [run.py flags...]
  local label=$1 p=$2 mode=$3; shift 3
  local suffix=""; [ -n "$mode" ] && suffix=-localhost
  [ -e "$results/$label-w$p$suffix.json" ] && return 0
  $py benchmarks/scaling/run.py --lock= --label "$label" --workers "$p" $mode "$@"
}
export -f point
export py results
for p in ${WORKERS:-2 4 16 8}; do
  ${LOCK-flock /tmp/gradsift-cpu.lock} bash -c "
    set -euo pipefail
    for mode in '' --localhost; do
      for series in ${SERIES:-allgather balanced shared-mask fp32}; do
        if [ \$series = fp32 ]; then point fp32 $p \"\$mode\" --compressor none
        else point \$series $p \"\$mode\" --compressor sidco-exp --ratio 0.01 --exchange \$series; fi
      done
    done"
done
$py benchmarks/scaling/analyze.py
