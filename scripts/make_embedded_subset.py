"""Build the class-balanced Fashion-MNIST subset shipped in ``src/gradsift/data``.

Usage (needs the real IDX files, e.g. Debian's ``dataset-fashion-mnist``)::

    python scripts/make_embedded_subset.py [--source /usr/share/datasets/fashion-mnist]
        [--train-per-class 300] [--test-per-class 100] [--out src/gradsift/data]

Picks the first ``N`` images of every class in a permutation seeded with 0, keeps
them in that order, and writes gzip IDX files with a zero timestamp, so running it
twice produces byte-identical files.
"""

from __future__ import annotations

import argparse
import gzip
import struct
from pathlib import Path

import torch

from gradsift.tools.train.data import NUM_CLASSES, SYSTEM_DIR, _split_paths, read_idx

_NAMES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


def balanced_selection(labels: torch.Tensor, per_class: int, seed: int = 0) -> torch.Tensor:
    """Indices of ``per_class`` examples of every class, in a seeded random order."""
    order = torch.randperm(labels.numel(), generator=torch.Generator().manual_seed(seed))
    shuffled = labels[order]
    chosen = [order[shuffled == c][:per_class] for c in range(NUM_CLASSES)]
    if any(c.numel() < per_class for c in chosen):
        raise SystemExit(f"a class has fewer than {per_class} examples")
    picked = torch.cat(chosen)
    return picked[torch.randperm(picked.numel(), generator=torch.Generator().manual_seed(seed + 1))]


def write_idx(path: Path, array: torch.Tensor) -> None:
    """Write a uint8 tensor as a gzip IDX file (magic 0x0000 08 <ndim>, big-endian dims)."""
    header = bytes([0, 0, 0x08, array.dim()]) + struct.pack(f">{array.dim()}I", *array.shape)
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as handle:
        handle.write(header + array.contiguous().numpy().tobytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=SYSTEM_DIR)
    parser.add_argument("--train-per-class", type=int, default=300)
    parser.add_argument("--test-per-class", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("src/gradsift/data"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for split, per_class in (("train", args.train_per_class), ("test", args.test_per_class)):
        paths = _split_paths(args.source, split)
        if paths is None:
            raise SystemExit(f"{args.source} lacks the {split} files")
        images, labels = read_idx(paths[0], 3), read_idx(paths[1], 1)
        keep = balanced_selection(labels, per_class)
        write_idx(args.out / _NAMES[split][0], images[keep])
        write_idx(args.out / _NAMES[split][1], labels[keep])
        print(f"{split}: {keep.numel()} images -> {args.out}")


if __name__ == "__main__":
    main()
