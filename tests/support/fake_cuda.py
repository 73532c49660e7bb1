"""Tensors that claim ``device="cuda"`` on a CPU-only build: PyTorch's ``FakeTensorMode``.

Under :func:`fake_cuda` every tensor made with ``device="cuda"`` is a fake tensor: shapes,
dtypes and devices are computed and checked (mixing in a CPU tensor raises a device
mismatch), values are not, and every host read (``.item()``, ``.tolist()``, ``bool()``, a
data-dependent output size) raises. What a CPU-only build lacks is stood in for:

* a few Python bindings of ``torch.Tensor`` take a CUDA device guard before dispatching
  (``[]``, ``[] =``, ``~``, ``copy_``, ``contiguous``, ``expand``): they are routed through
  ``torch.ops.aten``, which dispatches straight to the fake mode;
* ``torch.cuda.Event`` and ``torch.cuda.current_stream`` (telemetry's timers): inert ones
  whose events are always complete;
* ``torch.futures.Future(devices=[cuda])``: the devices are dropped.

It cannot check streams, NCCL, atomics or values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

aten = torch.ops.aten


def _basic(tensor: torch.Tensor, index: Any) -> torch.Tensor | None:
    """``tensor[index]`` for ints, slices, None and Ellipsis through aten views (None: other)."""
    items = index if isinstance(index, tuple) else (index,)
    if not all(isinstance(i, (int, slice)) or i is None or i is Ellipsis for i in items):
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        filled = tensor.dim() - sum(1 for i in items if i is not None and i is not Ellipsis)
        items = items[:at] + (slice(None),) * filled + items[at + 1 :]
    out, dim = tensor, 0
    for item in items:
        if item is None:
            out = aten.unsqueeze(out, dim)
            dim += 1
        elif isinstance(item, int):
            out = aten.select(out, dim, item)
        else:
            start, stop, step = item.indices(out.shape[dim])
            out = aten.slice(out, dim, start, max(start, stop), step)
            dim += 1
    return out


def _getitem(tensor: torch.Tensor, index: Any) -> torch.Tensor:
    found = _basic(tensor, index)
    if found is not None:
        return found
    if isinstance(index, torch.Tensor):
        if index.dtype == torch.bool:
            return aten.index(tensor, [index])  # data-dependent: raises on fake tensors
        return aten.index_select(tensor, 0, index.reshape(-1)).reshape(*index.shape, *tensor.shape[1:])
    raise NotImplementedError(f"fake_cuda: index {index!r}")


def _setitem(tensor: torch.Tensor, index: Any, value: Any) -> None:
    if isinstance(index, torch.Tensor) and index.dtype != torch.bool and isinstance(value, torch.Tensor):
        aten.index_put_(tensor, [index], value)
        return
    target = _basic(tensor, index)
    if target is None:
        raise NotImplementedError(f"fake_cuda: index {index!r} in an assignment")
    if isinstance(value, torch.Tensor):
        aten.copy_(target, value)
    else:
        aten.fill_(target, value)


class _Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: Any) -> float:
        return 0.0


_FUTURE = torch.futures.Future


class _Future(_FUTURE):  # type: ignore[misc]
    def __init__(self, devices: Any = None) -> None:
        super().__init__()


@contextlib.contextmanager
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeTensorMode]:
    """Enter a fake mode in which ``device="cuda"`` tensors exist (module docstring)."""
    monkeypatch.setattr(torch.Tensor, "__getitem__", _getitem)
    monkeypatch.setattr(torch.Tensor, "__setitem__", _setitem)
    monkeypatch.setattr(torch.Tensor, "__invert__", lambda self: aten.bitwise_not(self))
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, non_blocking=False: aten.copy_(self, src))
    monkeypatch.setattr(
        torch.Tensor,
        "contiguous",
        lambda self, memory_format=torch.contiguous_format: (
            self if self.is_contiguous() else aten.clone(self, memory_format=torch.contiguous_format)
        ),
    )
    monkeypatch.setattr(torch.Tensor, "expand", lambda self, *sizes: aten.expand(self, _sizes(sizes)))
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.futures, "Future", _Future)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        yield mode


def _sizes(sizes: tuple[Any, ...]) -> list[int]:
    return (
        list(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)) else list(sizes)
    )


def on_fake_cuda(tensor: Any) -> bool:
    """A fake tensor that claims a CUDA device."""
    return isinstance(tensor, FakeTensor) and tensor.device.type == "cuda"
