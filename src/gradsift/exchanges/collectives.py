"""torch.distributed calls shared by the exchanges: failure wrapping, pending results, volumes.

Every collective an exchange starts goes through :func:`guarded` (a backend error
becomes :class:`~gradsift.errors.PeerFailureError` naming the rank and the backend's
message) and runs in the background, so that the DDP hook overlaps communication with
the rest of backward. What reads its result is a :class:`Pending`, never a
``Future.then`` callback: no Python runs on the backend's threads (the class says why).
Nothing here knows a compressor.

Byte volumes (what arrives at one worker's NIC, ``W`` workers, ``S`` bytes per worker
message) are those of the bandwidth-optimal algorithms: ring allreduce
``2 (W-1)/W S``, allgather ``(W-1) S``, broadcast ``S`` (to every non-root).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from gradsift.errors import PeerFailureError

T = TypeVar("T")
U = TypeVar("U")

# torch >= 2.13 renames all_gather_into_tensor (same signature) and deprecates the old name.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def peer_failure(error: BaseException, group: Any, what: str) -> PeerFailureError:
    """Wrap a backend error of collective ``what`` into a :class:`PeerFailureError`."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return PeerFailureError(
        f"{what} failed on rank {rank} of {world}: a peer process is gone, stalled past the "
        f"process group's timeout, or sent something else ({type(error).__name__}: {error})"
    )


def guarded(what: str, group: Any, call: Callable[[], T]) -> T:
    """Run ``call()``; turn a backend error into a :class:`PeerFailureError`."""
    try:
        return call()
    except RuntimeError as error:  # gloo/NCCL raise RuntimeError subclasses (DistBackendError, ...)
        raise peer_failure(error, group, what) from error


class Pending(Generic[T]):
    """A result that collectives in flight will produce, read by :meth:`wait` on the calling thread.

    ``works`` are the backend's ``Work`` handles (and, through them, every tensor the
    collectives read or write); ``read`` computes the result once they are done, and
    :meth:`then` composes further Python onto it, all of it run by :meth:`wait` on the
    thread that calls it. No callback is attached to a backend future: a gloo thread
    that has to take the GIL (to run or destroy a Python callback, or to release the
    last reference to a tensor's Python object) while the interpreter finalizes is
    ended by ``pthread_exit`` inside a C++ destructor, and the process dies with
    SIGABRT, "terminate called without an active exception" (docs/decisions.md, "Clean
    exit"). Keeping the object alive until the next step keeps the tensors referenced
    from Python, so a backend thread never drops the last reference either.
    """

    def __init__(self, read: Callable[[], T], works: Sequence[Any] = ()) -> None:
        self.works = list(works)
        self._read: Callable[[], T] | None = read
        self._value: T | None = None

    def wait(self) -> T:
        """Block until the collectives are done (a failure raises :class:`PeerFailureError`); the result."""
        if self._read is not None:
            self._value, self._read = self._read(), None
        return self._value  # type: ignore[return-value]

    def then(self, follow: Callable[[T], U]) -> Pending[U]:
        """The result of ``follow(self.wait())``, computed when the new object is waited for."""
        return Pending(lambda: follow(self.wait()), self.works)

    @staticmethod
    def gather(pendings: Sequence[Pending[Any]]) -> Pending[list[Any]]:
        """Every result of ``pendings``, in order."""
        return Pending(lambda: [p.wait() for p in pendings], [w for p in pendings for w in p.works])


def ready(value: T) -> Pending[T]:
    """A result that is already there."""
    return Pending(lambda: value)


def started(work: Any, result: T, group: Any, what: str) -> Pending[T]:
    """``result`` once ``work`` (collective ``what``) is done; its failure as :class:`PeerFailureError`."""

    def read() -> T:
        guarded(what, group, work.wait)
        return result

    return Pending(read, [work])


def allreduce_sum(tensor: torch.Tensor, group: Any, what: str = "allreduce") -> Pending[torch.Tensor]:
    """Start an in-place sum of ``tensor`` over the group; the result is ``tensor`` once it is done."""
    work = guarded(what, group, lambda: dist.all_reduce(tensor, group=group, async_op=True))
    return started(work, tensor, group, what)


def allgather(out: torch.Tensor, local: torch.Tensor, group: Any, what: str) -> Pending[torch.Tensor]:
    """Start ``all_gather_into_tensor(out, local)``; the result is ``out`` (``W`` copies' worth of ``local``)."""
    work = guarded(what, group, lambda: all_gather_into(out, local, group=group, async_op=True))
    return started(work, out, group, what)


def ring_allreduce_received(nbytes: int, world: int) -> int:
    """Bytes one worker receives in a ring allreduce of an ``nbytes`` message: ``2 (W-1)/W nbytes``."""
    return 2 * (world - 1) * nbytes // world
