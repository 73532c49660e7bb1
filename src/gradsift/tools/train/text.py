"""Byte-level language-model data: the CPython standard library's top-level modules.

The corpus exists offline on every machine that runs gradsift: the ``*.py`` files
directly inside ``sysconfig.get_paths()["stdlib"]`` (no sub-packages, no tests), in
sorted file-name order. File ``i`` of that list is validation when ``i % 10 ==
VALIDATION_OFFSET`` and training otherwise, so the split is by file and fixed. Each
split is the concatenation of its files' bytes (tokens = bytes, vocabulary 256), cut
into non-overlapping windows of ``CONTEXT + 1`` bytes taken every ``CONTEXT`` bytes:
window ``w`` predicts bytes ``w[1:]`` from ``w[:-1]``, and consecutive windows share
one byte, so every byte but the first is a target exactly once.

Evaluation uses ``EVAL_WINDOWS`` windows spaced evenly over the validation split (all
of them when there are fewer), so an evaluation costs a fixed amount of compute.

Python versions ship different sources: :class:`TextCorpus` records the file count,
the byte counts and a SHA-256 of the file names and contents, and the trainer writes
them into ``summary.json``, so two runs are comparable exactly when those match.
Measured for CPython 3.11.7: 168 files, 4 698 388 bytes; see docs/training.md.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from gradsift.tools.train.data import DatasetError

VOCAB_SIZE = 256
CONTEXT = 128
VALIDATION_OFFSET = 9
EVAL_WINDOWS = 512
SYNTHETIC_TRAIN_BYTES = 64 * 1024
SYNTHETIC_VALIDATION_BYTES = 8 * 1024


def stdlib_dir() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass
class TokenWindows:
    """One split as ``(n, CONTEXT + 1)`` uint8 windows; item ``i`` is ``(inputs, targets)``."""

    windows: torch.Tensor

    def __len__(self) -> int:
        return int(self.windows.shape[0])

    def __getitem__(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = self.windows[index].to(torch.int64)
        return chosen[:, :-1], chosen[:, 1:]


@dataclass
class TextCorpus:
    """Where the text came from: directory, files per split, bytes per split, digest."""

    directory: str
    train_files: int
    validation_files: int
    train_bytes: int
    validation_bytes: int
    sha256: str

    def describe(self) -> str:
        """One line for ``summary.json``'s ``data`` field."""
        return (
            f"{self.directory}/*.py ({self.train_files} + {self.validation_files} files, "
            f"{self.train_bytes} + {self.validation_bytes} bytes, sha256 {self.sha256})"
        )


def corpus_files(directory: str | Path) -> list[Path]:
    """The ``*.py`` files directly inside ``directory``, sorted by name."""
    return sorted(p for p in Path(directory).glob("*.py") if p.is_file())


def split_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """``(train, validation)``: every tenth file (index ``% 10 == VALIDATION_OFFSET``) validates."""
    validation = [f for i, f in enumerate(files) if i % 10 == VALIDATION_OFFSET]
    train = [f for i, f in enumerate(files) if i % 10 != VALIDATION_OFFSET]
    return train, validation


def windows_of(data: bytes, context: int = CONTEXT) -> torch.Tensor:
    """Non-overlapping ``context + 1``-byte windows every ``context`` bytes (the tail dropped)."""
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    count = (tokens.numel() - 1) // context
    if count < 1:
        raise DatasetError(f"text of {tokens.numel()} bytes is shorter than one window of {context + 1}")
    return tokens.unfold(0, context + 1, context)[:count].clone()


def eval_subset(windows: torch.Tensor, count: int = EVAL_WINDOWS) -> torch.Tensor:
    """``count`` windows spaced evenly over ``windows`` (all of them if there are fewer)."""
    if windows.shape[0] <= count:
        return windows
    return windows[torch.linspace(0, windows.shape[0] - 1, count).round().to(torch.int64)]


def load_text(directory: str | Path | None = None) -> tuple[TokenWindows, TokenWindows, TextCorpus]:
    """Read the corpus under ``directory`` (default: :func:`stdlib_dir`).

    Returns ``(train, evaluation, corpus)``; raises :class:`DatasetError` naming the
    directory when it holds fewer than 10 ``*.py`` files (no validation file).
    """
    root = Path(directory).expanduser() if directory is not None else stdlib_dir()
    files = corpus_files(root)
    if len(files) < 10:
        raise DatasetError(f"{root} holds {len(files)} *.py files; the text corpus needs at least 10")
    train_files, validation_files = split_files(files)
    digest = hashlib.sha256()
    parts: dict[str, list[bytes]] = {"train": [], "validation": []}
    for name, group in (("train", train_files), ("validation", validation_files)):
        for path in group:
            content = path.read_bytes()
            digest.update(path.name.encode() + b"\0" + content)
            parts[name].append(content)
    train, validation = b"".join(parts["train"]), b"".join(parts["validation"])
    corpus = TextCorpus(
        str(root), len(train_files), len(validation_files), len(train), len(validation), digest.hexdigest()
    )
    return TokenWindows(windows_of(train)), TokenWindows(eval_subset(windows_of(validation))), corpus


def synthetic_text(size: int, seed: int) -> bytes:
    """A small learnable stand-in for tests: words from a fixed 16-word vocabulary drawn
    by a seeded first-order Markov chain (each word has 2 likely successors)."""
    generator = torch.Generator().manual_seed(seed)
    words = [f"w{i:x}{'ab'[i % 2] * (1 + i % 3)} ".encode() for i in range(16)]
    out, word = bytearray(), 0
    while len(out) < size:
        out += words[word]
        word = (2 * word + int(torch.randint(1, 3, (1,), generator=generator))) % 16
    return bytes(out[:size])


def load_synthetic_text(seed: int) -> tuple[TokenWindows, TokenWindows, str]:
    """``(train, evaluation, "synthetic-text")`` from :func:`synthetic_text`."""
    train = windows_of(synthetic_text(SYNTHETIC_TRAIN_BYTES, seed))
    validation = windows_of(synthetic_text(SYNTHETIC_VALIDATION_BYTES, seed + 1))
    return TokenWindows(train), TokenWindows(eval_subset(validation)), "synthetic-text"
