"""A run's per-step records on disk, read back as a sequence: memory does not grow with the run.

The trainer appends one JSON line per step (``steps.jsonl``) and keeps none in memory;
:class:`JsonlRecords` is a read-only :class:`~collections.abc.Sequence` over that file that
reads it line by line on every pass, so :func:`gradsift.tools.train.summary.summarize`
computes the same summary from it as from the records in a list (JSON writes floats
exactly). Only the last record and the count stay in memory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any, overload


class JsonlRecords(Sequence[dict[str, Any]]):
    """Append-only JSON-lines records at ``path`` (the file is created empty)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._handle: IO[str] = open(self.path, "w", encoding="utf-8")  # noqa: SIM115
        self._count = 0
        self._last: dict[str, Any] | None = None

    def append(self, record: dict[str, Any]) -> None:
        """Write ``record`` as one line (flushed, so the file is complete after every step)."""
        self._handle.write(json.dumps(record) + "\n")
        self._handle.flush()
        self._count += 1
        self._last = record

    def close(self) -> None:
        self._handle.close()

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[dict[str, Any]]:
        with open(self.path, encoding="utf-8") as lines:
            for _, line in zip(range(self._count), lines, strict=False):
                yield json.loads(line)

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        """A record by position: the last one from memory, any other read from the file."""
        if isinstance(index, int) and index in (-1, self._count - 1) and self._last is not None:
            return self._last
        return list(self)[index]
