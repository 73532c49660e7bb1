#!/usr/bin/env bash
# The GPU check on one GPU in under 5 minutes, without installing gradsift (python3 or $PYTHON,
# PYTHONPATH=src). Each part is its own process under its own timeout, and every check appends
# a JSON line to OUT/check.jsonl when it ends. Exits non-zero when anything fails.
#   benchmarks/gpu/check.sh [--dry-run] [OUT]   OUT: default $OUT, else results/gpu
#   --dry-run: the same parts on CPU with gloo at toy sizes (the test suite runs it)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo
py=${PYTHON:-python3} device=cuda steps=20
[ "${1:-}" = --dry-run ] && { shift; device=cpu steps=3; }
out=${1:-${OUT:-results/gpu}}
mkdir -p "$out"
log="$out/check.jsonl"
started=$(date +%s) status=0
part() {  # part SECONDS CHECK...: one process; a timeout or crash is written down too
  local limit=$1; shift
  echo "== $* ($device, ${limit} s)"
  timeout "$limit" "$py" benchmarks/gpu/check.py --device "$device" --jsonl "$log" --only "$@" $stamp
  local rc=$?
  stamp=""
  [ $rc -eq 0 ] && return
  status=1
  echo "{\"check\": \"part $*\", \"ok\": false, \"error\": \"exit $rc\"}" >> "$log"  # 124: timed out
}
stamp=--stamp
part 45 sync_counter determinism selection
part 80 exchanges
part 50 bf16_layer memory static_graph amp evaluate
part 50 encode step_time
part 40 two_ranks
echo "== gradsift train --device $device --workers 1, $steps steps (synthetic data)"
train=$(mktemp -d)
if timeout 35 "$py" -m gradsift train --device "$device" --workers 1 --steps "$steps" --synthetic \
  --no-progress --out "$train/run" > "$out/train.txt" 2>&1; then
  cp "$train/run/summary.json" "$out/train-summary.json"
  echo '{"check": "train", "ok": true}' >> "$log"
else
  status=1
  echo '{"check": "train", "ok": false}' >> "$log"
fi
rm -rf "$train"
tail -n 3 "$out/train.txt"
echo "== done in $(( $(date +%s) - started )) s (status $status)"
exit $status
