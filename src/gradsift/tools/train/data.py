"""Fashion-MNIST from IDX files, and the per-worker shard each rank trains on.

IDX layout (big-endian): a 4-byte magic ``0x00 0x00 <type> <ndim>`` (type ``0x08`` =
unsigned byte), then ``ndim`` 4-byte dimension sizes, then the data. Images are
``(n, 28, 28)`` (magic 0x00000803), labels ``(n,)`` (magic 0x00000801). Files may be
gzip-compressed (``.gz``) or not.

Where the data comes from, first match wins (:func:`find_dataset_dir`):
``--data-dir``, ``/usr/share/datasets/fashion-mnist`` (Debian's
``dataset-fashion-mnist``), ``~/.cache/gradsift/fashion-mnist``, and the
class-balanced subset embedded in the package (``gradsift/data``). Nothing is ever
downloaded.
"""

from __future__ import annotations

import gzip
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from gradsift.core.errors import InvalidOptionError
from gradsift.core.validation import check_choice

#: The dataset's per-pixel mean and standard deviation over the 60 000 training images.
PIXEL_MEAN = 0.2860
PIXEL_STD = 0.3530
NUM_CLASSES = 10
IMAGE_SIDE = 28
SYNTHETIC_TRAIN_SIZE = 1024
SYNTHETIC_TEST_SIZE = 256

SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
CACHE_DIR = Path.home() / ".cache" / "gradsift" / "fashion-mnist"
EMBEDDED_DIR = Path(__file__).resolve().parents[2] / "data"  # gradsift/data, the package data

_SPLIT_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_UBYTE = 0x08


class DatasetError(InvalidOptionError):
    """A dataset file is missing or malformed; the message names the file and the fault."""


def read_idx(path: str | Path, expected_ndim: int) -> torch.Tensor:
    """Read one unsigned-byte IDX file (gzip or plain) into a uint8 tensor.

    Raises :class:`DatasetError` naming the file when the magic number, the number of
    dimensions or the data length does not match the header.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            raw = handle.read()
    except (OSError, EOFError) as error:
        raise DatasetError(f"cannot read IDX file {path}: {error}") from error
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DatasetError(f"{path} is not an IDX file: bad magic number {raw[:4].hex() or '(empty)'}")
    dtype_code, ndim = raw[2], raw[3]
    if dtype_code != _UBYTE:
        raise DatasetError(f"{path}: IDX data type 0x{dtype_code:02x} unsupported, expected 0x08 (ubyte)")
    if ndim != expected_ndim:
        raise DatasetError(f"{path}: IDX file has {ndim} dimensions, expected {expected_ndim}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetError(f"{path}: truncated IDX header ({len(raw)} bytes, need {header})")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    expected = math.prod(dims)
    if len(raw) - header != expected:
        raise DatasetError(
            f"{path}: IDX data holds {len(raw) - header} bytes, header dims {dims} need {expected}"
        )
    return torch.frombuffer(bytearray(raw[header:]), dtype=torch.uint8).reshape(dims)


def _split_paths(directory: Path, split: str) -> tuple[Path, Path] | None:
    """The (images, labels) files of ``split`` in ``directory``, gzip preferred; None if absent."""
    found = []
    for stem in _SPLIT_FILES[split]:
        candidates = [directory / f"{stem}.gz", directory / stem]
        match = next((p for p in candidates if p.is_file()), None)
        if match is None:
            return None
        found.append(match)
    return found[0], found[1]


def _required_split_paths(directory: str | Path, split: str) -> tuple[Path, Path]:
    """:func:`_split_paths`, raising :class:`DatasetError` when a file is absent."""
    paths = _split_paths(Path(directory), split)
    if paths is None:
        raise DatasetError(f"{directory} does not hold the {split} split files {_SPLIT_FILES[split]}")
    return paths


def has_dataset(directory: Path) -> bool:
    """True when ``directory`` holds both splits' image and label files."""
    return all(_split_paths(directory, split) is not None for split in _SPLIT_FILES)


def search_path(data_dir: str | Path | None = None) -> list[Path]:
    """The directories searched for the dataset, in order."""
    explicit = [Path(data_dir).expanduser()] if data_dir is not None else []
    return [*explicit, SYSTEM_DIR, CACHE_DIR, EMBEDDED_DIR]


def find_dataset_dir(data_dir: str | Path | None = None) -> Path:
    """First directory of :func:`search_path` holding the dataset.

    An explicit ``data_dir`` that lacks the files is an error (never silently skipped).
    """
    if data_dir is not None and not has_dataset(Path(data_dir).expanduser()):
        names = ", ".join(f"{stem}[.gz]" for pair in _SPLIT_FILES.values() for stem in pair)
        raise DatasetError(f"data_dir {data_dir} does not hold the Fashion-MNIST files ({names})")
    for directory in search_path(data_dir):
        if has_dataset(directory):
            return directory
    raise DatasetError(
        "no Fashion-MNIST found in "
        + ", ".join(map(str, search_path(data_dir)))
        + " (the embedded subset is missing from this installation)"
    )


@dataclass
class Split:
    """One split as tensors: ``images`` float32 ``(n, 1, 28, 28)`` normalised, ``labels`` int64."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.numel())

    def __getitem__(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


def load_split(directory: str | Path, split: str) -> Split:
    """Read and normalise one split (``"train"`` or ``"test"``) from ``directory``."""
    check_choice(split, "split", tuple(_SPLIT_FILES))
    paths = _required_split_paths(directory, split)
    images, labels = read_idx(paths[0], 3), read_idx(paths[1], 1)
    if images.shape[1:] != (IMAGE_SIDE, IMAGE_SIDE):
        raise DatasetError(f"{paths[0]}: images are {tuple(images.shape[1:])}, expected (28, 28)")
    if images.shape[0] != labels.shape[0]:
        raise DatasetError(
            f"{paths[0]} holds {images.shape[0]} images but {paths[1]} {labels.shape[0]} labels"
        )
    if labels.numel() and int(labels.max()) >= NUM_CLASSES:
        raise DatasetError(f"{paths[1]}: label {int(labels.max())} outside [0, {NUM_CLASSES - 1}]")
    normalised = (images.to(torch.float32).div_(255.0) - PIXEL_MEAN).div_(PIXEL_STD)
    return Split(normalised.unsqueeze(1), labels.to(torch.int64))


def synthetic_split(size: int, seed: int) -> Split:
    """A small learnable stand-in for tests: class ``c`` lights up row band ``c`` plus noise."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, NUM_CLASSES, (size,), generator=generator)
    images = torch.randn(size, 1, IMAGE_SIDE, IMAGE_SIDE, generator=generator) * 0.5
    rows = torch.arange(IMAGE_SIDE)
    band = (rows.unsqueeze(0) // 3 == labels.unsqueeze(1)).to(torch.float32)  # (size, 28)
    images += 2.0 * band[:, None, :, None]
    return Split(images, labels)


def load_dataset(
    data_dir: str | Path | None = None, *, synthetic: bool = False, seed: int = 0
) -> tuple[Split, Split, str]:
    """Return ``(train, test, source)``; ``source`` names where the data came from."""
    if synthetic:
        return (
            synthetic_split(SYNTHETIC_TRAIN_SIZE, seed),
            synthetic_split(SYNTHETIC_TEST_SIZE, seed + 1),
            "synthetic",
        )
    directory = find_dataset_dir(data_dir)
    return load_split(directory, "train"), load_split(directory, "test"), str(directory)


def shard_indices(
    length: int, rank: int, world_size: int, *, epoch: int, seed: int, shuffle: bool = True
) -> torch.Tensor:
    """Indices of ``rank``'s shard for ``epoch``, with ``DistributedSampler`` semantics.

    Every rank draws the same permutation (seeded by ``seed + epoch``), pads it by
    wrapping around to a multiple of ``world_size`` and keeps every
    ``world_size``-th element starting at ``rank``: the shards are disjoint up to the
    padding and have equal length ``ceil(length / world_size)``.
    """
    if not 0 <= rank < world_size:
        raise InvalidOptionError(f"rank must lie in [0, {world_size - 1}], got {rank}")
    if shuffle:
        order = torch.randperm(length, generator=torch.Generator().manual_seed(seed + epoch))
    else:
        order = torch.arange(length)
    per_rank = math.ceil(length / world_size)
    padding = per_rank * world_size - length
    if padding:
        order = torch.cat([order, order[:padding]])
    return order[rank::world_size]


def batches(split, indices: torch.Tensor, batch_size: int):
    """Yield ``split[chosen]`` -- ``(inputs, targets)`` -- mini-batches over ``indices``
    (the last one may be short); ``split`` is a :class:`Split` or any dataset indexed the
    same way (:class:`gradsift.tools.train.text.TokenWindows`)."""
    for start in range(0, indices.numel(), batch_size):
        yield split[indices[start : start + batch_size]]


def train_size(data_dir: str | Path | None = None, *, synthetic: bool = False) -> int:
    """Number of training examples :func:`load_dataset` would return (reads only the labels)."""
    if synthetic:
        return SYNTHETIC_TRAIN_SIZE
    paths = _required_split_paths(find_dataset_dir(data_dir), "train")
    return int(read_idx(paths[1], 1).numel())
