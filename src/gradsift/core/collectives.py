"""torch.distributed calls shared by the exchanges: failure wrapping, pending results, volumes.

Every collective an exchange starts goes through :func:`guarded` (a backend error that
says a peer is gone or stalled becomes :class:`~gradsift.core.errors.PeerFailureError`
naming the rank and the backend's message; any other error -- CUDA out of memory, a
CPU tensor handed to NCCL -- passes through as it is) and runs in the background, so
that the DDP hook overlaps communication with the rest of backward. What reads its result is a :class:`Pending`, never a
``Future.then`` callback: no Python runs on the backend's threads (the class says why).
Nothing here knows a compressor.

Byte volumes (what arrives at one worker's NIC, ``W`` workers, ``S`` bytes per worker
message) are those of the bandwidth-optimal algorithms: ring allreduce
``2 (W-1)/W S``, allgather ``(W-1) S``, broadcast ``S`` (to every non-root).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from contextvars import ContextVar
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from gradsift.core.errors import PeerFailureError
from gradsift.core.threads import wait_until_idle

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


#: What gloo's and NCCL's errors say when a peer is gone or stalled (gloo raises plain
#: ``RuntimeError`` with its transport's message; NCCL raises ``DistBackendError``).
_PEER_MESSAGES = (
    "connection closed by peer",
    "connection reset by peer",
    "timed out",
    "socket closed",
    "broken pipe",
    "communicator was aborted",
    "watchdog",
)


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` (raised by a collective) says a peer is gone, stalled or disagrees.

    ``torch.distributed``'s own error classes (``DistError``: backend, network, store,
    timeout) and gloo's transport errors are; an out-of-memory error, a device mismatch
    or a wrong argument is not, whatever the backend."""
    if isinstance(error, torch.OutOfMemoryError) or not isinstance(error, RuntimeError):
        return False
    if isinstance(error, dist.DistError):
        return True
    text = str(error).lower()
    return "gloo/transport" in text or any(message in text for message in _PEER_MESSAGES)


def guarded(what: str, group: Any, call: Callable[[], T]) -> T:
    """Run ``call()``; turn a peer failure (:func:`is_peer_failure`) into a :class:`PeerFailureError`."""
    try:
        return call()
    except RuntimeError as error:
        if is_peer_failure(error):
            raise peer_failure(error, group, what) from error
        raise


class Pending(Generic[T]):
    """A result that collectives in flight will produce, read by :meth:`wait` on the calling thread.

    ``read`` waits for the collectives and computes the result, and :meth:`then`
    composes further Python onto it, all of it run by :meth:`wait` on the thread that
    calls it. No callback is attached to a backend future: a gloo thread
    that has to take the GIL (to run or destroy a Python callback, or to release the
    last reference to a tensor's Python object) while the interpreter finalizes is
    ended by ``pthread_exit`` inside a C++ destructor, and the process dies with
    SIGABRT, "terminate called without an active exception" (docs/decisions.md, "Clean
    exit"). The collectives' ``Work`` handles are held by :data:`KEPT_WORKS`, so a
    backend thread never drops the last reference to one either.
    """

    def __init__(self, read: Callable[[], T]) -> None:
        self._read: Callable[[], T] | None = read
        self._value: T | None = None

    def wait(self) -> T:
        """Block until the collectives are done (a failure raises :class:`PeerFailureError`); the result."""
        if self._read is not None:
            self._value, self._read = self._read(), None
        return self._value  # type: ignore[return-value]

    def then(self, follow: Callable[[T], U]) -> Pending[U]:
        """The result of ``follow(self.wait())``, computed when the new object is waited for."""
        return Pending(lambda: follow(self.wait()))

    @staticmethod
    def gather(pendings: Sequence[Pending[Any]]) -> Pending[list[Any]]:
        """Every result of ``pendings``, in order."""
        return Pending(lambda: [p.wait() for p in pendings])


class WorkKeeper:
    """Holds every collective's ``Work`` handle from its start until the next step opens.

    A gloo worker thread keeps its own reference to a ``Work`` for a moment after it
    completes the work's future. If ours goes first, the thread's release is the last
    one and runs the work's destructor, which drops the tensors the collective read and
    wrote; releasing a Python-visible tensor takes the GIL, and a thread that takes the
    GIL while the interpreter finalizes dies inside that destructor (``std::terminate``,
    SIGABRT: docs/decisions.md, "Clean exit"). During training that release is harmless
    (the thread just waits for the GIL); at exit it is not, and a user's script returns
    right after its last step, when the thread may not have run yet. So:

    * :meth:`keep` records each ``Work`` when its collective starts (also the blocking
      ones, e.g. a header round trip, whose handle would otherwise go at once);
    * :meth:`next_step` (a step opens: the last one was waited for when it closed)
      releases them, on the training thread;
    * at interpreter exit the works still held are never released (their list's
      reference count is raised once more, on purpose): the backend's release is then
      not the last one and runs no destructor. What stays unreleased is the last step's
      send/receive buffers, which the operating system takes back with the process.

    One keeper serves the process (the hook state may be gone before exit); with
    several hooked models, a step of one releases the other's works early, which is
    harmless while the interpreter runs.
    """

    def __init__(self) -> None:
        self.works: list[Any] = []

    def keep(self, work: Any) -> None:
        self.works.append(work)

    def next_step(self) -> None:
        self.works = []

    def hold_past_exit(self) -> None:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(self.works))


#: The process's keeper: collectives of every hook and exchange go through it.
KEPT_WORKS = WorkKeeper()


@atexit.register
def _leave_cleanly() -> None:
    """At interpreter exit: pin gradsift's works, then let the backend's threads finish
    releasing the works a script started itself (:mod:`gradsift.core.threads`)."""
    KEPT_WORKS.hold_past_exit()
    wait_until_idle()


#: What times the waits for collectives in the current context (None: nothing does).
_WAIT_TIMER: ContextVar[Callable[[], AbstractContextManager[Any]] | None] = ContextVar(
    "gradsift_wait_timer", default=None
)


@contextlib.contextmanager
def timing_waits(timer: Callable[[], AbstractContextManager[Any]]) -> Iterator[None]:
    """Inside the block, every wait for a collective (a :class:`Pending` of :func:`started`)
    runs inside ``timer()``: the time spent waiting for the network alone, not the Python
    a :meth:`Pending.then` runs after it (decoding, which is timed as its own phase)."""
    token = _WAIT_TIMER.set(timer)
    try:
        yield
    finally:
        _WAIT_TIMER.reset(token)


def ready(value: T) -> Pending[T]:
    """A result that is already there."""
    return Pending(lambda: value)


def started(work: Any, result: T, group: Any, what: str) -> Pending[T]:
    """``result`` once ``work`` (collective ``what``) is done; its failure as :class:`PeerFailureError`.

    On gloo, ``work`` is kept by :data:`KEPT_WORKS` until the next step opens (the clean
    exit needs it there: gloo's threads release works with the GIL); other backends' works
    are not kept, so their buffers go as soon as the step is done with them."""
    if _needs_keeping(group):
        KEPT_WORKS.keep(work)

    def read() -> T:
        timed_wait(what, group, work.wait)
        return result

    return Pending(read)


def timed_wait(what: str, group: Any, wait: Callable[[], Any]) -> Any:
    """``wait()`` for collective ``what`` (its failure as :class:`PeerFailureError`), inside the
    current context's wait timer (:func:`timing_waits`) if any; what ``wait`` returns."""
    timer = _WAIT_TIMER.get()
    with contextlib.nullcontext() if timer is None else timer():
        return guarded(what, group, wait)


def _needs_keeping(group: Any) -> bool:
    """Whether a collective of ``group`` runs on gloo (whose threads must not drop the last
    reference to a work); a group without a known backend is kept, to be safe."""
    try:
        return str(dist.get_backend(group)) == "gloo"
    except (RuntimeError, ValueError):
        return True


def blocking(what: str, group: Any, start: Callable[[], Any]) -> None:
    """Run a collective to its end: ``start()`` launches it (``async_op=True``) and returns
    its ``Work``, which is waited for here and kept by :data:`KEPT_WORKS` like any other."""
    started(guarded(what, group, start), None, group, what).wait()


def collective_device(group: Any = None) -> torch.device:
    """The device this rank's collectives of ``group`` run on: its current CUDA device when
    the group's backend is NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agreed_max(values: Sequence[float], group: Any, what: str) -> list[float]:
    """Every rank's ``values``, reduced element-wise by ``max`` over the group: one blocking
    allreduce on the group's device (:func:`collective_device`), a peer's failure raised as
    :class:`PeerFailureError`; the numbers every rank then decides from alike."""
    agreed = torch.tensor(list(values), dtype=torch.float64, device=collective_device(group))
    blocking(what, group, lambda: dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group, async_op=True))
    return agreed.tolist()


def broadcast_from_first(tensors: Sequence[torch.Tensor], group: Any, what: str = "start broadcast") -> None:
    """Set every tensor of ``tensors``, in place, to the group's first rank's (one broadcast
    each, in order): what a frontend that does not wrap the model in DDP does to start its
    workers from the same parameters."""
    source = dist.get_global_rank(group, 0) if group is not None else 0

    def start(tensor: torch.Tensor) -> Callable[[], Any]:
        return lambda: dist.broadcast(tensor, source, group=group, async_op=True)

    with torch.no_grad():
        for tensor in tensors:
            blocking(what, group, start(tensor))


def allreduce_sum(tensor: torch.Tensor, group: Any, what: str = "allreduce") -> Pending[torch.Tensor]:
    """Start an in-place sum of ``tensor`` over the group; the result is ``tensor`` once it is done."""
    work = guarded(what, group, lambda: dist.all_reduce(tensor, group=group, async_op=True))
    return started(work, tensor, group, what)


def allgather(out: torch.Tensor, local: torch.Tensor, group: Any, what: str) -> Pending[torch.Tensor]:
    """Start ``all_gather_into_tensor(out, local)``; the result is ``out`` (``W`` copies' worth of ``local``)."""
    work = guarded(what, group, lambda: all_gather_into(out, local, group=group, async_op=True))
    return started(work, out, group, what)


def all_to_all(out: torch.Tensor, local: torch.Tensor, group: Any, what: str) -> Pending[torch.Tensor]:
    """Start ``all_to_all_single(out, local)`` in equal splits: worker ``j`` receives row ``j`` of
    every worker's ``local`` (``W`` rows), in rank order; the result is ``out``."""
    work = guarded(what, group, lambda: dist.all_to_all_single(out, local, group=group, async_op=True))
    return started(work, out, group, what)


def ring_allreduce_received(nbytes: int, world: int) -> int:
    """Bytes one worker receives in a ring allreduce of an ``nbytes`` message: ``2 (W-1)/W nbytes``."""
    return 2 * (world - 1) * nbytes // world
