"""Count host reads of tensors: every place a CUDA program would wait for the device.

On a GPU, reading a tensor's value on the host (``.item()``, ``.tolist()``, ``bool()``,
``int()``, ``float()``, ``.cpu()``) stalls the host until the device has caught up, and
so does every operation whose *output size* depends on the data (``nonzero``,
``masked_select``, boolean-mask indexing, ``unique``, ``bincount``,
``repeat_interleave`` without ``output_size``). So does every copy of host data onto
the device, which PyTorch makes through a pinned staging buffer the host waits on: a
``torch.tensor(data, device=...)`` / ``torch.as_tensor(data, device=...)`` /
``t.new_tensor(data)``, and a host number or list written into a tensor
(``t[i] = 3``; ``t[i:i+1].fill_(3)`` passes the number as a kernel argument instead).
Stock DDP makes none of them during a training step.

:class:`HostReads` counts those calls process-wide while it is active, on any device,
so that the CPU test suite can hold the DDP hook to a budget of host reads per step
(tests/hook/test_host_reads.py). The CPU-only kernels of :mod:`gradsift.compressors.kernels` read CPU
memory through NumPy views, which never happens on a GPU; they are not counted, and
the GPU check script (benchmarks/gpu/) covers their CUDA branches with
``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import collections
import functools
import traceback
from typing import Any

import torch

#: Tensor methods that read a value or a data-dependent size on the host.
_METHODS = (
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "cpu",
    "nonzero",
    "masked_select",
    "unique",
    "bincount",
)
#: torch functions of the same kinds.
_FUNCTIONS = ("nonzero", "masked_select", "unique", "bincount", "unique_consecutive")


def _is_mask(index: Any) -> bool:
    if isinstance(index, torch.Tensor):
        return index.dtype == torch.bool
    if isinstance(index, tuple):
        return any(_is_mask(i) for i in index)
    return False


def _copied_to_a_device(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> bool:
    """``torch.tensor(host data, device=d)`` with ``d`` taken from a tensor (a ``torch.device``)
    or naming an accelerator: a host-to-device copy on a GPU. CPU-only code that names
    ``device="cpu"`` is not one."""
    if isinstance(data, torch.Tensor) or device is None:
        return False
    return isinstance(device, torch.device) or device != "cpu"


def _writes_host_data(tensor: Any, index: Any, value: Any) -> bool:
    """``tensor[index] = value`` with a host number or sequence: a host-to-device copy on a GPU."""
    return not isinstance(value, torch.Tensor)


class HostReads:
    """``with HostReads() as reads: ...`` counts host reads in the block (``reads.count``).

    ``reads.sites`` maps ``"what file:line"`` of the caller outside torch to a count,
    for the failure message of a budget test.
    """

    def __init__(self) -> None:
        self.count = 0
        self.sites: collections.Counter[str] = collections.Counter()
        self._saved: list[tuple[Any, str, Any]] = []
        self._inside = False

    def _note(self, what: str) -> None:
        if self._inside:  # a counted call made by another counted call (bool() of .item()...)
            return
        self.count += 1
        for frame in reversed(traceback.extract_stack()[:-2]):
            if "/torch/" not in frame.filename and not frame.filename.endswith("host_reads.py"):
                self.sites[f"{what} {frame.filename.rsplit('/', 2)[-1]}:{frame.lineno}"] += 1
                break

    def _wrap(self, owner: Any, name: str, condition: Any = None) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if condition is None or condition(*args, **kwargs):
                self._note(name)
            was, self._inside = self._inside, True
            try:
                return original(*args, **kwargs)
            finally:
                self._inside = was

        self._saved.append((owner, name, original))
        setattr(owner, name, counted)

    def __enter__(self) -> HostReads:
        for name in _METHODS:
            self._wrap(torch.Tensor, name)
        for name in _FUNCTIONS:
            self._wrap(torch, name)
        self._wrap(torch.Tensor, "__getitem__", lambda tensor, index: _is_mask(index))
        self._wrap(
            torch.Tensor,
            "repeat_interleave",
            lambda *args, **kwargs: kwargs.get("output_size") is None,
        )
        self._wrap(torch, "repeat_interleave", lambda *args, **kwargs: kwargs.get("output_size") is None)
        self._wrap(torch, "tensor", _copied_to_a_device)
        self._wrap(torch, "as_tensor", _copied_to_a_device)
        self._wrap(torch.Tensor, "new_tensor", lambda tensor, data, *args, **kwargs: True)
        self._wrap(torch.Tensor, "__setitem__", _writes_host_data)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
