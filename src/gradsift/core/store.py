"""One keyed store for every per-tensor state: residuals, velocities, VGC's accumulators.

State lives in *tables* (``"residual"``, ``"velocity"``, ``"vgc.variance"``, ...), each
mapping a tensor key to a tensor. A key names what a tensor holds in terms of the
model's parameters: a parameter number (``granularity="layer"``) or the sorted tuple
of the parameter numbers of a DDP bucket. Three things make the store more than a dict:

* **Transactions.** Between :meth:`begin` and :meth:`commit`/:meth:`rollback` every
  :meth:`put` and :meth:`discard` goes to an overlay; :meth:`get` sees the overlay
  first. The DDP hook opens one transaction per step and commits it only when every
  rank's gradient was finite, so a step that a ``GradScaler`` skips leaves no trace
  (rolling back drops the overlay: no copy is made either way, because writers put new
  tensors instead of modifying stored ones). A writer that changes a stored tensor in
  place hands the change to :meth:`on_commit` instead: it runs after the overlay is
  applied, and a rollback forgets it, so a stored tensor changes only at a commit -- or
  where the step's own flag already says whether it commits, every write conditioned on
  that flag (the DDP hook's close: ``gradsift.hook.feedback.ErrorFeedback.commit_in_result``),
  so a rolled-back step still finds it as it was.
* **Layouts.** :meth:`follow` records, per key, the order in which its parameters lie
  in the key's flat tensors. When DDP rebuilds its buckets after the first step (or a
  resumed run starts with the initial layout) a key's parameters may come in another
  order, or in other groups: every *per-element* tensor (one element per parameter
  element, ``numel == sum of the parameters' numels``) is then cut into per-parameter
  chunks and reassembled in the new order and grouping, so state follows parameters,
  not bucket positions. A parameter nobody held before starts from zeros. Tensors of
  any other length (per-key scalars) stay with their key; a new key starts without them.
  :meth:`canonical` gives a key's layout against parameter-number order, for methods
  whose arithmetic depends on where an element lies (:class:`Canonical`).
* **Checkpoints.** :meth:`state_dict` / :meth:`load_state_dict` round-trip tables and
  layouts exactly (tensors cloned).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from gradsift.core.errors import InvalidOptionError

Key = Hashable


class TensorStore:
    """Per-tensor state by table name and key, with one optional open transaction."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[Key, torch.Tensor]] = {}
        self.layouts: dict[Key, tuple[int, ...]] = {}
        self.numels: dict[int, int] = {}
        self._canonical: dict[tuple[int, ...], Canonical] = {}
        self._overlay: dict[str, dict[Key, torch.Tensor | None]] | None = None
        self._on_commit: list[Callable[[], None]] = []

    # -- reading and writing --------------------------------------------------------------
    def get(self, table: str, key: Key) -> torch.Tensor | None:
        """The tensor under ``(table, key)``, the open transaction's version first."""
        if self._overlay is not None and key in self._overlay.get(table, {}):
            return self._overlay[table][key]
        return self.tables.get(table, {}).get(key)

    def put(self, table: str, key: Key, tensor: torch.Tensor) -> None:
        """Store ``tensor`` (kept by reference: writers hand over a tensor they no longer change)."""
        target = self.tables if self._overlay is None else self._overlay
        target.setdefault(table, {})[key] = tensor

    def discard(self, key: Key, tables: Iterable[str] | None = None) -> None:
        """Forget the tensors under ``key`` in ``tables`` (None: every table); inside a
        transaction the removal takes effect at commit."""
        names = set(self.tables) | set(self._overlay or {}) if tables is None else set(tables)
        for name in names:
            if self._overlay is None:
                self.tables.get(name, {}).pop(key, None)
            else:
                self._overlay.setdefault(name, {})[key] = None

    def clear(self) -> None:
        """Forget everything (layouts too)."""
        self.tables.clear()
        self.layouts.clear()
        self._overlay = None if self._overlay is None else {}
        self._on_commit.clear()

    def table(self, name: str) -> dict[Key, torch.Tensor]:
        """A read-only snapshot of one table as a dict (committed and pending merged)."""
        merged = dict(self.tables.get(name, {}))
        for key, tensor in (self._overlay or {}).get(name, {}).items():
            if tensor is None:
                merged.pop(key, None)
            else:
                merged[key] = tensor
        return merged

    def keys(self) -> set[Key]:
        """Every key that holds state in some table."""
        return {key for name in set(self.tables) | set(self._overlay or {}) for key in self.table(name)}

    # -- transactions -----------------------------------------------------------------------
    @property
    def in_transaction(self) -> bool:
        return self._overlay is not None

    def begin(self) -> None:
        """Open a transaction (nested transactions are not supported)."""
        if self._overlay is not None:
            raise InvalidOptionError("a TensorStore transaction is already open")
        self._overlay = {}

    def on_commit(self, change: Callable[[], None]) -> None:
        """Run ``change`` -- an in-place change of stored tensors -- when the open transaction
        commits, after its writes and the changes handed over before it (at once outside a
        transaction); a rollback forgets it."""
        if self._overlay is None:
            change()
        else:
            self._on_commit.append(change)

    def commit(self) -> None:
        """Apply the open transaction's writes, then its :meth:`on_commit` changes in order."""
        overlay, self._overlay = self._overlay or {}, None
        for name, writes in overlay.items():
            table = self.tables.setdefault(name, {})
            for key, tensor in writes.items():
                if tensor is None:
                    table.pop(key, None)
                else:
                    table[key] = tensor
        changes, self._on_commit = self._on_commit, []
        for change in changes:
            change()

    def rollback(self) -> None:
        """Drop the open transaction's writes and changes: the store is as it was at :meth:`begin`."""
        self._overlay = None
        self._on_commit.clear()

    def retain(self, keys: Iterable[Key]) -> None:
        """Drop every key not in ``keys`` (state of tensors no bucket holds any more)."""
        alive = set(keys)
        for key in self.keys() - alive:
            self.discard(key)
        for key in set(self.layouts) - alive:
            del self.layouts[key]

    # -- layouts ------------------------------------------------------------------------------
    def follow(self, key: Key, order: Sequence[int], numels: Mapping[int, int]) -> None:
        """Declare that ``key``'s flat tensors hold parameters ``order`` (numbers) in that order.

        Re-lays every per-element tensor whose parameters moved (see the module
        docstring); ``numels[i]`` is parameter ``i``'s element count. Re-laying changes
        no value, so it applies to committed and pending state alike; the keys it takes
        chunks from are first cut per parameter (:meth:`_loosen`), and once a table's tensor
        of ``key`` is re-laid those per-parameter keys leave that table, before the next
        table is re-laid: the moved state is held twice for one table's tensor at most.
        """
        order = tuple(order)
        self.numels.update((i, numels[i]) for i in order)
        previous = self.layouts.get(key)
        if previous == order:
            return
        self.numels.update(numels)  # the other keys' chunks are cut by their own sizes
        if order != (key,):  # a per-parameter key (a seeded velocity) loosens nothing
            self._loosen(key, order)
        sources = self._chunk_sources(exclude=key)
        self.layouts[key] = order
        loose = [i for i in order if i != key and self.layouts.get(i) == (i,)]
        for tables in (self.tables, self._overlay or {}):
            found = sources.get(id(tables), {})
            for name, table in tables.items():
                relaid = self._relaid(table.get(key), previous, order, numels, name, found)
                if relaid is not None:
                    table[key] = relaid
                for i in loose:  # its state now lies in ``key``'s tensor
                    table.pop(i, None)
                    found.pop((name, i), None)

    @staticmethod
    def _relaid(
        own: torch.Tensor | None,
        previous: tuple[int, ...] | None,
        order: tuple[int, ...],
        numels: Mapping[int, int],
        name: str,
        found: dict[tuple[str, int], torch.Tensor],
    ) -> torch.Tensor | None:
        """Table ``name``'s tensor of a key laid out as ``order``: its own chunks (laid out as
        ``previous``), the other keys' (``found``), zeros for a parameter nobody held; None
        when it stays as it is (declared now, a per-key scalar) or has nothing to re-lay."""
        total = sum(numels[i] for i in order)
        chunks: dict[int, torch.Tensor] = {}
        if own is not None:
            if previous is None or own.numel() != total:
                return None
            chunks = dict(zip(previous, own.split([numels[i] for i in previous]), strict=True))
        for i in order:
            if i not in chunks and (name, i) in found:
                chunks[i] = found[(name, i)]
        if not chunks:
            return None
        like = next(iter(chunks.values()))
        return torch.cat([chunks[i] if i in chunks else like.new_zeros(numels[i]) for i in order])

    def _loosen(self, key: Key, order: Sequence[int]) -> None:
        """Cut every other multi-parameter key holding some of ``order``'s parameters into one
        key per parameter (its number, laid out alone; one that exists is kept): copies of
        the key's per-element chunks, its own tensors and layout dropped (a pending discard
        inside a transaction), its per-key scalars kept. Its state then goes parameter by
        parameter as they are re-laid (:meth:`follow`), not all at the step's commit: a
        rebuild holds the old layout's state once, not beside the new layout's."""
        wanted = set(order)
        for other, layout in list(self.layouts.items()):
            if other == key or len(layout) < 2 or wanted.isdisjoint(layout):
                continue
            for committed, tables in ((True, self.tables), (False, self._overlay or {})):
                for name, table in tables.items():
                    pieces = self._cut(other, table.get(other))
                    if not pieces:
                        continue
                    for i, piece in pieces:
                        if i not in table:
                            table[i] = piece.clone()
                        self.layouts.setdefault(i, (i,))
                    if committed:
                        del table[other]
                    else:
                        assert self._overlay is not None
                        self._overlay[name][other] = None
            del self.layouts[other]

    def canonical(self, key: Key) -> Canonical | None:
        """``key``'s flat layout against parameter-number order; None for a key with no
        declared layout (a single parameter, a tensor outside the DDP hook)."""
        order = self.layouts.get(key)
        if order is None:
            return None
        canonical = self._canonical.get(order)
        if canonical is None:
            canonical = self._canonical[order] = Canonical(order, self.numels)
        return canonical

    def per_parameter(self, name: str) -> dict[int, torch.Tensor]:
        """Table ``name``'s committed per-element tensors cut into each parameter's chunk (flat
        views): a key with a layout by its layout, a parameter number's key whole; per-key
        scalars are left out."""
        return {
            i: chunk
            for key, tensor in self.tables.get(name, {}).items()
            for i, chunk in self._cut(key, tensor)
        }

    def zero_parameters(self, numbers: Iterable[int], numels: Mapping[int, int]) -> None:
        """Zero the chunks of parameters ``numbers`` in every committed table of per-element
        tensors (:meth:`per_parameter`), in place; outside a transaction. ``numels[i]`` is
        parameter ``i``'s element count (a loaded store knows its layouts, not yet the sizes)."""
        assert self._overlay is None, "zero_parameters inside a transaction"
        self.numels.update(numels)
        wanted = set(numbers)
        for name in self.tables:
            for number, chunk in self.per_parameter(name).items():
                if number in wanted:
                    chunk.zero_()

    def _cut(self, key: Key, tensor: torch.Tensor | None) -> list[tuple[int, torch.Tensor]]:
        """``tensor`` of ``key`` as ``(parameter, chunk)`` pairs; none for a per-key scalar."""
        layout = self.layouts.get(key)
        if tensor is None:
            return []
        if layout is None:
            if isinstance(key, int) and tensor.numel() == self.numels.get(key, tensor.numel()):
                return [(key, tensor)]
            return []
        sizes = [self.numels[i] for i in layout]
        if tensor.numel() != sum(sizes):
            return []
        return list(zip(layout, tensor.split(sizes), strict=True))

    def _chunk_sources(self, exclude: Key) -> dict[int, dict[tuple[str, int], torch.Tensor]]:
        """Per tables-dict (committed, overlay): ``(table, parameter) -> that parameter's chunk``,
        cut from every other key with a known layout and a per-element tensor."""
        found: dict[int, dict[tuple[str, int], torch.Tensor]] = {}
        for tables in (self.tables, self._overlay or {}):
            chunks = found.setdefault(id(tables), {})
            for name, table in tables.items():
                for other, tensor in table.items():
                    if other == exclude or other not in self.layouts:
                        continue
                    chunks.update(((name, i), chunk) for i, chunk in self._cut(other, tensor))
        return found

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Committed tables and layouts (tensors cloned)."""
        return {
            "tables": {name: {k: t.clone() for k, t in table.items()} for name, table in self.tables.items()},
            "layouts": dict(self.layouts),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (drops any open transaction's writes)."""
        missing = {"tables", "layouts"} - set(state)
        if missing:
            raise InvalidOptionError(
                f"TensorStore state needs keys tables and layouts, missing {sorted(missing)}"
            )
        self.tables = {
            name: {k: t.clone() for k, t in table.items()} for name, table in state["tables"].items()
        }
        self.layouts = {k: tuple(v) for k, v in state["layouts"].items()}
        self._overlay = None if self._overlay is None else {}
        self._on_commit.clear()


class Canonical:
    """A flat tensor laid out in one parameter order <-> the same elements in number order.

    DDP lays a bucket's parameters out in registration order at first, in the order
    backward readies their gradients after its rebuild, and in registration order again
    when a resumed run starts. A method whose arithmetic depends on where an element lies
    (random positions, a stream of rounding draws, the rounding of a sum) runs on the
    *canonical* layout -- parameters in number order -- and so computes the same bits
    whichever layout DDP hands it. Built once per layout (the device tables once per device).
    """

    def __init__(self, order: Sequence[int], numels: Mapping[int, int]) -> None:
        self.sizes = [numels[i] for i in order]
        #: ``chunks[c]``: the flat chunk at canonical place ``c``; ``places[j]``: the inverse.
        self.chunks = sorted(range(len(order)), key=lambda j: order[j])
        self.places = sorted(range(len(order)), key=lambda c: self.chunks[c])
        self.identity = self.chunks == list(range(len(order)))
        self._tables: dict[str, _PositionTables] = {}

    def to_canonical(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat``'s elements in canonical order (``flat`` itself when the layouts agree)."""
        if self.identity:
            return flat
        pieces = flat.split(self.sizes)
        return torch.cat([pieces[j] for j in self.chunks])

    def to_flat(self, canonical: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The inverse of :meth:`to_canonical` (``canonical`` itself when the layouts agree);
        with ``out`` (same size and dtype) written there, in one pass, and returned."""
        if self.identity:
            return canonical if out is None else out.copy_(canonical)
        pieces = canonical.split([self.sizes[j] for j in self.chunks])
        ordered = [pieces[c] for c in self.places]
        return torch.cat(ordered) if out is None else torch.cat(ordered, out=out)

    def flat_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The flat positions of canonical ``positions`` (an integer tensor, on its device)."""
        return self._moved(positions, to_flat=True)

    def canonical_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`flat_positions`: the canonical positions of flat ``positions``."""
        return self._moved(positions, to_flat=False)

    def _moved(self, positions: torch.Tensor, to_flat: bool) -> torch.Tensor:
        """``positions`` plus the offset of the parameter chunk each lies in, one way or the other."""
        if self.identity:
            return positions
        tables = self._device_tables(positions.device)
        starts, offsets = (
            (tables.canonical_starts, tables.to_flat)
            if to_flat
            else (tables.flat_starts, tables.to_canonical)
        )
        chunk = torch.searchsorted(starts, positions, right=True) - 1
        return positions + offsets[chunk]

    def _device_tables(self, device: torch.device) -> _PositionTables:
        tables = self._tables.get(str(device))
        if tables is None:
            sizes = torch.tensor(self.sizes, dtype=torch.long)
            flat_starts = torch.cumsum(sizes, 0) - sizes
            chunks = torch.tensor(self.chunks, dtype=torch.long)
            canonical_starts = torch.cumsum(sizes[chunks], 0) - sizes[chunks]
            shifts = flat_starts[chunks] - canonical_starts  # per canonical chunk: flat - canonical
            places = torch.tensor(self.places, dtype=torch.long)
            tables = self._tables[str(device)] = _PositionTables(
                canonical_starts.to(device),
                shifts.to(device),
                flat_starts.to(device),
                (-shifts[places]).to(device),
            )
        return tables


class _PositionTables(NamedTuple):
    """A :class:`Canonical`'s position tables on one device."""

    canonical_starts: torch.Tensor  #: per canonical chunk, its canonical start
    to_flat: torch.Tensor  #: per canonical chunk, its flat start - its canonical start
    flat_starts: torch.Tensor  #: per flat chunk, its flat start
    to_canonical: torch.Tensor  #: per flat chunk, its canonical start - its flat start
