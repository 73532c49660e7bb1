#!/usr/bin/env bash
# GPU measurements in one go (see README.md): compress cost against torch.topk at 1M-100M
# elements in fp32 and bf16, then a 2-process DDP hook run on CUDA tensors. Writes JSON into
# OUT (default $OUT when set, else results/gpu), each stamped by benchmarks/provenance.py. Budget: under
# 8 minutes on one recent GPU.
#   benchmarks/gpu/run.sh [OUT]             on a machine with a CUDA GPU
#   benchmarks/gpu/run.sh --dry-run [OUT]   the same steps on CPU at toy sizes (the tests run this)
set -euo pipefail
cd "$(dirname "$0")/../.."
py=.venv/bin/python
[ -x "$py" ] || py=python3

device=cuda sizes="1000000 4000000 16000000 64000000 100000000" repeats=10 warmup=3
hook=(--width 4096 --depth 4 --batch 64 --steps 20 --warmup 5)
if [ "${1:-}" = "--dry-run" ]; then
  shift
  device=cpu sizes="70000" repeats=1 warmup=0
  hook=(--width 16 --depth 1 --batch 4 --steps 1 --warmup 0)
fi
out=${1:-${OUT:-results/gpu}}
mkdir -p "$out"
if [ "$device" = cuda ] && ! "$py" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "run.sh: no CUDA GPU visible to $py (torch $("$py" -c 'import torch; print(torch.__version__)'))" >&2
  exit 2
fi
started=$(date +%s)
for dtype in fp32 bf16; do
  echo "== compress cost, $dtype, $device"
  "$py" benchmarks/provenance.py --json "$out/compress-$dtype.json" --seed 0 -- \
    timeout 180 "$py" -m gradsift bench compress --device "$device" --dtype "$dtype" --sizes $sizes \
    --ratios 0.01 0.001 --compressors topk sidco-exp sidco-gpareto sidco-gamma dgc randomk \
    --repeats "$repeats" --warmup "$warmup" --no-progress --json "$out/compress-$dtype.json"
done
echo "== DDP hook, 2 processes, $device"
timeout 240 "$py" benchmarks/gpu/hook.py --device "$device" "${hook[@]}" --json "$out/hook.json"
echo "run.sh: done in $(( $(date +%s) - started )) s; results in $out"
