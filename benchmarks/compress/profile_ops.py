"""Operators and host synchronisations per ``compress`` call, by size (see README.md).

Counts every ATen operator a call dispatches (``TorchDispatchMode``) and, among them,
the ones that make the host wait for the device on a GPU: ``_local_scalar_dense``
(``float()``, ``int()``, ``.tolist()`` of a scalar, ``bool()``) and the operators whose
output size depends on the data (``nonzero``, ``masked_select``, boolean indexing),
which must read a count back. Deterministic: the numbers describe the code path, not
this machine. Each compressor is called ``--warmup`` times first (adaptive state
settles), then the next call is counted. On CPU the comparison kernels run through
NumPy (:mod:`gradsift.compressors.kernels`) and dispatch no operator; ``--torch-kernels`` routes
them through their PyTorch branch instead -- the path a GPU runs -- so its counts
(syncs included) are what a CUDA call does.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gradsift
from gradsift.tools.benchmarking import synthetic_gradient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared provenance stamp
import provenance

#: Operators after which the host waits for the device (value or output size read back).
SYNCING = {"_local_scalar_dense", "tolist", "nonzero", "masked_select"}


class OperatorCounter(TorchDispatchMode):
    """Counts the ATen operators dispatched while active, by name (overload dropped).

    ``Tensor.tolist`` copies to the host without dispatching an operator, so it is
    counted separately (as ``tolist``, a sync).
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func._schema.name.removeprefix("aten::")] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._tolist = torch.Tensor.tolist

        def counted_tolist(tensor):
            self.counts["tolist"] += 1
            return self._tolist(tensor)

        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def profile_call(name: str, x: torch.Tensor, ratio: float, warmup: int) -> dict:
    """Operator counts of the call after ``warmup`` calls of a fresh compressor."""
    compressor = gradsift.get_compressor(name, ratio=ratio)
    for _ in range(warmup):
        compressor.compress(x)
    with OperatorCounter() as counter:
        compressor.compress(x)
    counts = dict(sorted(counter.counts.items(), key=lambda item: -item[1]))
    return {
        "operators": sum(counts.values()),
        "host_syncs": sum(n for op, n in counts.items() if op in SYNCING),
        "by_operator": counts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << e for e in range(12, 26, 2)])
    parser.add_argument(
        "--compressors", nargs="+", default=["topk", "sidco-exp", "sidco-gpareto", "sidco-gamma"]
    )
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--torch-kernels", action="store_true", help="count the PyTorch (GPU) kernel path")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.torch_kernels:
        import gradsift.compressors.kernels

        gradsift.compressors.kernels.uses_numpy = lambda tensor: False
    stamp = provenance.start(seeds=[0])  # synthetic_gradient's seed
    rows = []
    for numel in args.sizes:
        x = synthetic_gradient(numel)
        for name in args.compressors:
            row = {"compressor": name, "numel": numel, **profile_call(name, x, args.ratio, args.warmup)}
            rows.append(row)
            print(f"{name:14s} n={numel:>10,}  ops {row['operators']:5d}  host syncs {row['host_syncs']:4d}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": vars(args) | {"json": str(args.json)}, "rows": rows, "provenance": stamp.finish()},
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
