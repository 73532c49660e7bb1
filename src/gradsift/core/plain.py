"""Plain data: the only thing gradsift reads from a checkpoint file or from a peer.

Bytes from outside are never unpickled. They are read by :func:`read_plain`, i.e.
``torch.load(..., weights_only=True)``, whose unpickler rebuilds tensors, numbers, strings,
``None``, dtypes, devices, sizes and containers of them (dict, list, tuple) and refuses any
other object -- a ``__reduce__`` that would run code included -- before building it. What
gradsift writes or sends is checked to be such plain data first (:func:`check_plain`), so an
honest rank never sends what its peer refuses, and a mistake names the entry that is not plain.
"""

from __future__ import annotations

import io
import os
import pickle
from collections import OrderedDict
from typing import IO, Any

import torch

from gradsift.core.errors import UntrustedDataError

#: Leaf types ``torch.load(weights_only=True)`` rebuilds (besides containers of them).
PLAIN_LEAVES: tuple[type, ...] = (
    type(None), bool, int, float, complex, str, bytes,
    torch.Tensor, torch.nn.Parameter, torch.dtype, torch.device, torch.Size,
)  # fmt: skip
#: Container types it rebuilds.
PLAIN_CONTAINERS: tuple[type, ...] = (dict, OrderedDict, list, tuple)
#: What a refusal says the reader accepts.
PLAIN = "tensors, numbers, strings, None and lists, tuples and dicts of them"


def check_plain(value: Any, where: str) -> None:
    """Raise :class:`UntrustedDataError` naming the first entry of ``value`` (e.g.
    ``where["store"]["tables"]``) that is not plain data: a leaf of :data:`PLAIN_LEAVES`
    (exactly that type, not a subclass) or a container of :data:`PLAIN_CONTAINERS`."""
    kind = type(value)
    if kind in PLAIN_LEAVES:
        return
    if kind in (dict, OrderedDict):
        for key, item in value.items():
            check_plain(key, f"{where} key {key!r}")
            check_plain(item, f"{where}[{key!r}]")
        return
    if kind in (list, tuple):
        for index, item in enumerate(value):
            check_plain(item, f"{where}[{index}]")
        return
    raise UntrustedDataError(f"{where} is a {kind.__module__}.{kind.__qualname__}, not plain data ({PLAIN})")


def plain_bytes(value: Any, where: str) -> torch.Tensor:
    """``value`` (plain data, :func:`check_plain`) as the bytes ``torch.save`` writes, in a
    1-D ``uint8`` CPU tensor: what a collective can carry and :func:`read_plain` reads back."""
    check_plain(value, where)
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def read_plain(source: str | os.PathLike[str] | IO[bytes] | torch.Tensor, where: str) -> Any:
    """What ``source`` (a path, a binary file, or the ``uint8`` tensor of :func:`plain_bytes`)
    holds, loaded on the CPU with ``torch.load(weights_only=True)``; anything that is not
    plain data, or not a torch file at all, raises :class:`UntrustedDataError` naming ``where``
    without having built any of it. A missing file raises ``FileNotFoundError``."""
    if isinstance(source, torch.Tensor):
        source = io.BytesIO(source.to("cpu", torch.uint8).numpy().tobytes())
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError, ValueError) as error:
        raise UntrustedDataError(
            f"{where} refused: not a torch file of plain data ({PLAIN}); gradsift reads it with "
            f"torch.load(weights_only=True), which builds nothing else and runs no code from it: "
            f"{_reason(error)}"
        ) from error


def _reason(error: BaseException) -> str:
    """The line of ``torch.load``'s error that names what was refused (the global it would
    have imported, the operation it does not know), else its first line; its advice to load
    with ``weights_only=False`` is left out."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if line.lower().startswith(("trying to load", "unsupported"))]
    kept = [
        line
        for line in lines
        if not line.startswith(("Weights only load failed", "Please file", "Check the"))
    ]
    return (named or kept or [f"{type(error).__name__} (empty or truncated)"])[0]
