"""Per-step communication telemetry of the DDP hook: bytes, density, phase times.

Each DDP bucket fills its own :class:`BucketRecord` (the hook, then the step's close,
both on the thread that runs backward); when backward ends the hook folds the step's
records into one :class:`Telemetry` step and adds it to the running totals.

Counts the host does not know without reading the device (the entries a threshold
sparsifier really sent, the bytes they take) are added as device scalars and read with
the step's other checks, once, when the step closes (:meth:`BucketRecord.register`).
Times are milliseconds summed over buckets, each moment counted in one phase:
``compress_ms`` (encoding), ``communicate_ms`` (waiting for the collectives alone: the
communication the rest of backward did not hide, :func:`gradsift.core.collectives.timing_waits`)
and ``decompress_ms`` (decoding). On CPU they are host wall-clock around each phase; on
CUDA the time between two ``torch.cuda.Event`` records on the current stream of the
bucket's device (host wall-clock there would time the launch of kernels, and absorb
whatever backward kernels were still queued). An event's time exists only once the
device has passed it, and asking earlier raises; nothing here waits for that: a phase
whose events completed by its step's close (the step's one host read waits for the
stream, so every phase of a step that reads is complete) is counted in that step; one
still running (a step with nothing to read on the host, e.g. ``none``'s) is counted --
in *its own* step's numbers and in the totals -- by the first later call that finds it
complete (``Event.query()``, no wait). :meth:`Telemetry.summary` (``state.stats()``) never
waits for a running step; ``summary(wait=True)`` does, for a final report.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from gradsift.core.readout import Readout, Slot

logger = logging.getLogger("gradsift.hook")


@dataclass
class BucketRecord:
    """What one bucket sent and how long each phase took.

    ``bytes_sent`` is the message the worker hands to the collectives (data plus
    headers, exactly ``sum(to_wire(p).nbytes)`` for allgathered payloads);
    ``bytes_padded`` adds the padding the allgather sends to match the longest
    worker; ``bytes_received`` is what arrives at this worker's network interface
    under the bandwidth-optimal algorithm of each collective (each exchange's
    docstring gives its formula); ``dense_bytes`` is the uncompressed gradient in its
    own dtype.
    """

    bytes_sent: int = 0
    bytes_padded: int = 0
    bytes_received: int = 0
    dense_bytes: int = 0
    elements_sent: int = 0
    elements: int = 0
    dense_tensors: int = 0
    compressed_tensors: int = 0
    compress_ms: float = 0.0
    communicate_ms: float = 0.0
    decompress_ms: float = 0.0
    _device: list[tuple[str, torch.Tensor]] = field(default_factory=list, repr=False)
    _events: list[tuple[str, Any, Any]] = field(default_factory=list, repr=False)
    _slot: Slot | None = field(default=None, repr=False)

    def add(self, name: str, value: int | float | torch.Tensor) -> None:
        """Add ``value`` to the field ``name``: now for a host number, at step close for a tensor."""
        if isinstance(value, torch.Tensor):
            self._device.append((name, value))
        else:
            setattr(self, name, getattr(self, name) + value)

    def add_bytes(self, *, sent: int | torch.Tensor, padded: int, received: int | torch.Tensor) -> None:
        """Count one message: its bytes, with padding, and the bytes received for it."""
        self.add("bytes_sent", sent)
        self.add("bytes_padded", padded)
        self.add("bytes_received", received)

    def add_tensor(self, elements: int | torch.Tensor, *, dense: bool) -> None:
        """Count one tensor sent, dense or compressed, and the ``elements`` it carries."""
        self.add("dense_tensors" if dense else "compressed_tensors", 1)
        self.add("elements_sent", elements)

    @contextlib.contextmanager
    def timed(self, name: str, device: torch.device) -> Iterator[None]:
        """Add the time the ``with`` block takes to the field ``name`` (milliseconds; see the
        module docstring for CPU and CUDA)."""
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            try:
                yield
            finally:
                end.record(stream)
                self._events.append((name, start, end))
            return
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, (time.perf_counter() - started) * 1e3)

    def register(self, readout: Readout) -> None:
        """Hand the device-valued counts to the step's readout (read when the step closes)."""
        if self._device:
            self._slot = readout.slot(torch.stack([value.double().reshape(()) for _, value in self._device]))

    def settle(self) -> list[tuple[str, Any, Any]]:
        """After the readout was read: fold its values and the completed CUDA event times
        into the fields; return the phases whose events are still running (no wait)."""
        if self._slot is not None:
            for (name, _), value in zip(self._device, self._slot.values, strict=True):
                setattr(self, name, getattr(self, name) + int(value))  # device-valued fields are counts
        running = fold_completed(self, self._events)
        self._device, self._events, self._slot = [], [], None
        return running


_SUMMED = [f.name for f in fields(BucketRecord) if not f.name.startswith("_")]


def fold_completed(target: Any, events: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]]:
    """Add the time of every ``(name, start, end)`` whose ``end`` completed to ``target.name``
    (an attribute, or a key of a dict); return the others. ``end.query()`` does not wait."""
    running = []
    for name, start, end in events:
        if not end.query():
            running.append((name, start, end))
        elif isinstance(target, dict):
            target[name] += start.elapsed_time(end)
        else:
            setattr(target, name, getattr(target, name) + start.elapsed_time(end))
    return running


def combine(records: Iterable[BucketRecord]) -> dict[str, Any]:
    """Sum bucket records into one step dict (``density = elements_sent / elements``)."""
    step: dict[str, Any] = dict.fromkeys(_SUMMED, 0)
    for record in records:
        for name in _SUMMED:
            step[name] += getattr(record, name)
    step["density"] = step["elements_sent"] / step["elements"] if step["elements"] else 0.0
    return step


class Telemetry:
    """The last step's numbers, running totals, and optional periodic logging.

    Args:
        log_every: every this many steps, log the step through the ``gradsift.hook``
            logger (INFO) and append it to ``jsonl_path``; 0 disables both.
        jsonl_path: file that receives one JSON object per logged step (appended).
    """

    def __init__(self, log_every: int = 0, jsonl_path: str | os.PathLike[str] | None = None) -> None:
        self.log_every = log_every
        self.jsonl_path = None if jsonl_path is None else os.fspath(jsonl_path)
        self.last: dict[str, Any] = {}
        self.total: dict[str, Any] = {**dict.fromkeys(_SUMMED, 0), "steps": 0, "skipped_steps": 0}
        #: CUDA phases not complete at their step's close: (their step's dict, name, start, end).
        self.running: list[tuple[dict[str, Any], str, Any, Any]] = []

    def end_step(
        self,
        step: int,
        records: Iterable[BucketRecord],
        skipped: bool,
        running: Iterable[tuple[str, Any, Any]] = (),
    ) -> None:
        """Record one finished step (``step`` counts from 0); ``running``: its CUDA phases
        still in progress, counted in this step's numbers by the first later call that
        finds them complete."""
        self._fold_completed()
        self.last = {"step": step, **combine(records), "skipped": skipped}
        self.running.extend((self.last, name, start, end) for name, start, end in running)
        for name in _SUMMED:
            self.total[name] += self.last[name]
        self.total["steps"] += 1
        self.total["skipped_steps"] += int(skipped)
        if self.log_every and (step + 1) % self.log_every == 0:
            self._log(self.last)

    def summary(self, wait: bool = False) -> dict[str, Any]:
        """``{"step": last step dict, "total": totals with cumulative density}``. Phases that
        completed since are counted first (in their own step and the totals); with ``wait``,
        the ones still running are waited for, otherwise they are left for a later call."""
        if wait:
            for _, _, _, end in self.running:
                end.synchronize()
        self._fold_completed()
        total = dict(self.total)
        total["density"] = total["elements_sent"] / total["elements"] if total["elements"] else 0.0
        return {"step": dict(self.last), "total": total}

    def _fold_completed(self) -> None:
        """Add every completed running phase to its own step's dict and to the totals (no wait)."""
        still = []
        for step, name, start, end in self.running:
            if end.query():
                elapsed = start.elapsed_time(end)
                step[name] += elapsed
                self.total[name] += elapsed
            else:
                still.append((step, name, start, end))
        self.running = still

    def state_dict(self) -> dict[str, Any]:
        return {"total": dict(self.total)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total = dict(state["total"])

    def _log(self, step: dict[str, Any]) -> None:
        line = json.dumps(step, sort_keys=True)
        logger.info("gradsift step %s", line)
        if self.jsonl_path is not None:
            with open(self.jsonl_path, "a", encoding="utf-8") as handle:
                handle.write(line + "\n")
