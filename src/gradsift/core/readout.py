"""What a step needs to know on the host, read in one transfer when the step closes.

On a GPU every host read of a tensor (``.item()``, ``bool()``, ``.tolist()`` ...) waits
for the device to catch up, and a read during backward serialises communication with
the computation still queued. So nothing on the hook's path reads a tensor: the facts
the host needs -- whether some rank's gradient was non-finite, whether a received
message was malformed, how many elements were really sent, SIDCo's choice of stage
count -- stay on the device as small tensors, each registered as a :class:`Slot` of the
step's :class:`Readout`. When the step closes, :meth:`Readout.read` concatenates them
and brings them to the host in one transfer (one per device), and every slot then holds
its values as Python floats (exact for integers below 2^53).

Updates that must only happen if the step is kept (a compressor's adaptation decided
from read values) are registered with :meth:`Readout.after_commit` and run by
:meth:`Readout.commit`; a dropped step never runs them.

A readout belongs to one :class:`~gradsift.core.transaction.Transaction`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class Slot:
    """The host values of one registered tensor, filled by :meth:`Readout.read`."""

    __slots__ = ("_values",)

    def __init__(self) -> None:
        self._values: list[float] | None = None

    @property
    def values(self) -> list[float]:
        if self._values is None:
            raise RuntimeError("gradsift: a readout slot was used before the step's readout was read")
        return self._values

    def __getitem__(self, index: int) -> float:
        return self.values[index]

    def __len__(self) -> int:
        return len(self.values)


class Readout:
    """Device tensors to bring to the host together, and what to do once they are there."""

    def __init__(self) -> None:
        self._pending: list[tuple[Slot, torch.Tensor]] = []
        self._after_commit: list[Callable[[], None]] = []

    def slot(self, tensor: torch.Tensor) -> Slot:
        """Register ``tensor`` (any shape, bool/int/float) to be read at :meth:`read`."""
        slot = Slot()
        self._pending.append((slot, tensor.detach().reshape(-1)))
        return slot

    def after_commit(self, update: Callable[[], None]) -> None:
        """Run ``update`` when the step is kept (after :meth:`read`)."""
        self._after_commit.append(update)

    def read(self) -> None:
        """Fill every registered slot: one device-to-host transfer per device."""
        pending, self._pending = self._pending, []
        by_device: dict[torch.device, list[tuple[Slot, torch.Tensor]]] = {}
        for slot, tensor in pending:
            by_device.setdefault(tensor.device, []).append((slot, tensor))
        for device, entries in by_device.items():
            joined = torch.cat([tensor.to(torch.float64) for _, tensor in entries])
            # the one host read (the meta device, shapes without data, reads as zeros)
            values = [0.0] * joined.numel() if device.type == "meta" else joined.tolist()
            start = 0
            for slot, tensor in entries:
                slot._values = values[start : start + tensor.numel()]
                start += tensor.numel()

    def commit(self) -> None:
        """Run the updates registered with :meth:`after_commit`, in order."""
        updates, self._after_commit = self._after_commit, []
        for update in updates:
            update()

    def discard(self) -> None:
        """Forget everything registered (a dropped step)."""
        self._pending, self._after_commit = [], []
