"""What a published number is: a result file, a field path in it, a format, the command.

A :class:`Claim` reads fields of committed JSON results (a :class:`Result` also names the
command that produced it), optionally combines them with a small function (:func:`ratio`,
:func:`spanned`, a lambda), and formats the value. A :class:`Table` is a Markdown table
whose cells are literal text, claims, or a tuple of both joined in one cell. The registry
(``registry.py``) holds every claim and table; ``claims.py`` writes them into the docs
between markers and checks that what the docs say is what the files say.

Field paths are ``/``-separated keys (``\\/`` is a slash inside a key). On a list, a
segment is an index, ``[key=value]`` (the one element whose ``key`` is ``value``; several
conditions joined by ``,``) or ``{key=value}`` (every such element; ``^=`` matches a
prefix), and the segments after a ``{...}`` or ``*`` (every value) apply to each element.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from paths import ROOT

_SELECTOR = re.compile(r"^(?P<open>[\[{])(?P<conditions>.+)[\]}]$")


@dataclass(frozen=True)
class Result:
    """A committed result file (path relative to the repository root) and its command."""

    path: str
    command: str

    def load(self, root: Path = ROOT) -> Any:
        return _load(root / self.path)


@cache
def _load(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _matches(element: Any, conditions: str) -> bool:
    for condition in conditions.split(","):
        key, op, wanted = re.split(r"(\^=|=)", condition, maxsplit=1)
        value = str(element.get(key)) if isinstance(element, dict) else None
        if value is None or not (value.startswith(wanted) if op == "^=" else value == wanted):
            return False
    return True


def lookup(data: Any, path: str) -> Any:
    """The value at ``path`` in ``data`` (see the module docstring); KeyError names the segment."""
    segments = re.split(r"(?<!\\)/", path)
    for index, raw in enumerate(segments):
        rest, segment = "/".join(segments[index + 1 :]), raw.replace("\\/", "/")
        selector = _SELECTOR.match(segment)
        if segment == "*" or (selector and selector["open"] == "{"):
            values = data.values() if isinstance(data, dict) else data
            chosen = (
                list(values) if segment == "*" else [v for v in values if _matches(v, selector["conditions"])]
            )
            if not chosen:
                raise KeyError(f"{path!r}: nothing matches {segment!r}")
            return [lookup(v, rest) if rest else v for v in chosen]
        if selector:
            chosen = [v for v in data if _matches(v, selector["conditions"])]
            if len(chosen) != 1:
                raise KeyError(f"{path!r}: {segment!r} matches {len(chosen)} elements, not 1")
            data = chosen[0]
        elif isinstance(data, list):
            data = data[int(segment)]
        elif segment in data:
            data = data[segment]
        else:
            raise KeyError(f"{path!r}: no {segment!r} (keys: {sorted(data)[:12]})")
    return data


def ratio(a: float, b: float) -> float:
    return a / b


def spanned(spec: str, scale: float = 1.0) -> Callable[..., str]:
    """A computation: ``"lo-hi"`` over the values (lists flattened, each times ``scale``),
    each end formatted with ``spec``; one number when both ends read the same."""

    def span(*values: float | list[float]) -> str:
        flat = [scale * x for v in values for x in (v if isinstance(v, list) else [v])]
        low, high = format(min(flat), spec), format(max(flat), spec)
        return low if low == high else f"{low}-{high}"

    return span


@dataclass(frozen=True)
class Claim:
    """One published number (or a range or a phrase made of numbers) and where it comes from.

    ``fields`` are paths in ``result``, or ``(other result, path)`` pairs; the value is
    ``compute(*values)`` (the single value without ``compute``), formatted with ``fmt`` (a
    tuple value fills its fields in order). ``missing`` is the text for a value of None
    (e.g. ``"not reached"``).
    """

    id: str
    result: Result
    fields: tuple[str | tuple[Result, str], ...]
    fmt: str = "{}"
    compute: Callable[..., Any] | None = None
    missing: str | None = None

    @property
    def results(self) -> tuple[Result, ...]:
        """Every result the claim reads, its own first."""
        others = [f[0] for f in self.fields if isinstance(f, tuple)]
        return tuple(dict.fromkeys([self.result, *others]))

    def value(self, root: Path = ROOT) -> Any:
        def read(source: str | tuple[Result, str]) -> Any:
            result, path = source if isinstance(source, tuple) else (self.result, source)
            return lookup(result.load(root), path)

        values = [read(f) for f in self.fields]
        if self.compute is None:
            (value,) = values
            return value
        return self.compute(*values)

    def text(self, root: Path = ROOT) -> str:
        value = self.value(root)
        if value is None:
            if self.missing is None:
                raise ValueError(f"claim {self.id}: {self.result.path} {self.fields} is null")
            return self.missing
        return self.fmt.format(*value) if isinstance(value, tuple) else self.fmt.format(value)


Piece = str | Claim
Cell = Piece | tuple[Piece, ...]  # a tuple: its pieces joined, text and numbers in one cell


def _pieces(cell: Cell) -> tuple[Piece, ...]:
    return cell if isinstance(cell, tuple) else (cell,)


@dataclass(frozen=True)
class Table:
    """A Markdown table generated whole between ``<!-- claims-table:<name> -->`` markers."""

    name: str
    header: tuple[Cell, ...]
    align: tuple[str, ...]  # "---" or "---:" per column
    rows: tuple[tuple[Cell, ...], ...]
    claims: tuple[Claim, ...] = field(init=False)

    def __post_init__(self) -> None:
        pieces = [p for row in (self.header, *self.rows) for cell in row for p in _pieces(cell)]
        object.__setattr__(self, "claims", tuple(p for p in pieces if isinstance(p, Claim)))

    def render(self, root: Path = ROOT) -> str:
        def text(cell: Cell) -> str:
            return "".join(p if isinstance(p, str) else p.text(root) for p in _pieces(cell))

        def line(cells: tuple[Cell, ...]) -> str:
            return "| " + " | ".join(map(text, cells)) + " |"

        return "\n".join([line(self.header), line(self.align), *map(line, self.rows)])
