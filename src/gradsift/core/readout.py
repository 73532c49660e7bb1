"""What a step needs to know on the host, brought there in one transfer per step.

On a GPU every host read of a tensor (``.item()``, ``bool()``, ``.tolist()`` ...) waits
for the device to catch up, and a read during backward serialises communication with
the computation still queued. So nothing on the hook's path reads a tensor: the facts
the host needs -- whether some rank's gradient was non-finite, whether a received
message was malformed, how many elements were really sent, SIDCo's choice of stage
count -- stay on the device as small tensors, each registered as a :class:`Slot` of the
step's :class:`Readout`. When the step closes, :meth:`Readout.start` concatenates them
and starts their transfer to the host (one per device; on a GPU a non-blocking copy into
pinned host memory, so nothing waits); :meth:`Readout.read`, later and off the backward
pass, waits for that copy and every slot then holds its values as Python floats (exact
for integers below 2^53).

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
        self._copies: list[tuple[list[tuple[Slot, torch.Tensor]], _HostCopy]] = []
        self._after_commit: list[Callable[[], None]] = []

    def slot(self, tensor: torch.Tensor) -> Slot:
        """Register ``tensor`` (any shape, bool/int/float) to be read at :meth:`read`."""
        slot = Slot()
        self._pending.append((slot, tensor.detach().reshape(-1)))
        return slot

    def after_commit(self, update: Callable[[], None]) -> None:
        """Run ``update`` when the step is kept (after :meth:`read`)."""
        self._after_commit.append(update)

    def start(self) -> None:
        """Start bringing every slot registered so far to the host, one copy per device,
        without waiting for it (no host read)."""
        pending, self._pending = self._pending, []
        by_device: dict[torch.device, list[tuple[Slot, torch.Tensor]]] = {}
        for slot, tensor in pending:
            by_device.setdefault(tensor.device, []).append((slot, tensor))
        for entries in by_device.values():
            joined = torch.cat([tensor.to(torch.float64) for _, tensor in entries])
            self._copies.append((entries, _HostCopy(joined)))

    def read(self) -> None:
        """Fill every registered slot: :meth:`start` for what is not on its way yet, then
        wait for the copies -- the host read."""
        self.start()
        copies, self._copies = self._copies, []
        for entries, copy in copies:
            values = copy.values()
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
        self._pending, self._copies, self._after_commit = [], [], []


class _HostCopy:
    """One device's joined values on their way to the host: on a GPU a non-blocking copy
    into pinned memory and an event after it; on the CPU the tensor itself; on the meta
    device (shapes without data) zeros."""

    def __init__(self, joined: torch.Tensor) -> None:
        self.numel = joined.numel()
        self.event: torch.cuda.Event | None = None
        self.host: torch.Tensor | None = joined
        if joined.device.type == "meta":
            self.host = None
        elif joined.device.type == "cuda":
            self.host = torch.empty(joined.shape, dtype=joined.dtype, pin_memory=True)
            self.host.copy_(joined, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def values(self) -> list[float]:
        """The values, once the copy has landed (waits for it)."""
        if self.host is None:
            return [0.0] * self.numel
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
