"""Bytes each collective delivers to this rank, tallied from the calls themselves (an
independent count of an exchange's ``bytes_received``, under the bandwidth-optimal algorithms)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class Tally:
    """Bytes each collective delivers to this rank, counted from the calls themselves."""

    def __init__(self) -> None:
        self.received = 0
        self._saved = {}

    def __enter__(self) -> Tally:
        rank, world = dist.get_rank(), dist.get_world_size()

        def size(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        def wrap(name, count):
            original = getattr(dist, name)
            self._saved[name] = original

            def call(*args, **kwargs):
                self.received += count(*args, **kwargs)
                return original(*args, **kwargs)

            setattr(dist, name, call)

        def all_to_all(out, inp, output_split_sizes=None, input_split_sizes=None, **_):
            splits = output_split_sizes or [out.numel() // world] * world
            return sum(s for r, s in enumerate(splits) if r != rank) * out.element_size()

        wrap("all_to_all_single", all_to_all)
        wrap("broadcast", lambda t, src, **_: 0 if src == rank else size(t))
        wrap("all_reduce", lambda t, **_: 2 * (world - 1) * size(t) // world)
        gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        wrap(gather, lambda out, inp, **_: (world - 1) * size(inp))
        import gradsift.core.collectives as collectives

        self._gather = collectives.all_gather_into
        collectives.all_gather_into = getattr(dist, gather)
        return self

    def __exit__(self, *exc) -> None:
        import gradsift.core.collectives as collectives

        for name, original in self._saved.items():
            setattr(dist, name, original)
        collectives.all_gather_into = self._gather
