"""W data-parallel workers in one process: the real DDP hook on an in-memory process group.

Measuring an exchange's accuracy at 64 or 256 workers should not need 64 processes:
on a few cores their interpreters, gloo's busy threads and the scheduler cost more than
the training. :func:`simulate` runs every rank as a thread of this process, each with
its own model copy, ``DistributedDataParallel`` and :func:`gradsift.register_comm_hook`
-- the same compressors, error feedback, exchanges, wire formats and checks as a real
run, not a re-implementation of them -- on a process group whose collectives move the
ranks' tensors in memory:

1. every thread joins the group (``torch.distributed``'s thread-local world, from
   PyTorch's in-process test backend), builds its DDP model from the model that
   ``model_fn()`` returned under ``torch.manual_seed(seed)`` (DDP broadcasts rank 0's
   parameters, as on gloo) and registers the hook;
2. each step, rank ``r`` trains on ``data_fn(r, step)``: forward, loss, backward (the
   hook compresses, exchanges and decompresses each bucket; a collective returns when
   every rank has reached it), optimizer step;
3. the allgather, all-to-all and broadcast are copies, exact whatever the order; the
   sum of an allreduce is computed in the order of gloo's ring allreduce
   (:func:`ring_allreduce_sum`), so a simulated run is bit-identical to the same run
   on W gloo processes (tests/tools/test_simulate.py: 2, 4 and 8 workers).

The ranks compute with one intra-op thread each (set for the duration), as gloo
workers started with ``OMP_NUM_THREADS=1`` do. What a simulation cannot reproduce is a
draw from torch's global generator during training (dropout, ``torch.randn`` in
``data_fn``): the threads share it, so the order of the draws is the scheduler's; draw
from a ``torch.Generator`` seeded by ``(rank, step)`` instead. :func:`simulate` warns
when the global generator moved. Memory is W copies of the model, its gradients,
DDP's buckets and the hook's state (residuals); time is W ranks' compute on one
process's cores, plus the in-memory copies (``W (W-1)`` messages per collective).
CPU tensors only, and one simulation at a time in a process (it swaps in
``torch.distributed``'s thread-local world for its duration).
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsift.core.errors import InvalidOptionError, PeerFailureError
from gradsift.core.validation import check_int

#: torch's C++ bindings of torch.distributed (its thread isolation mode has no stub).
_C10D: Any = torch._C._distributed_c10d

#: The backend name the in-memory group registers under.
BACKEND = "gradsift_sim"

#: Gloo's largest segment of a ring allreduce, in bytes (measured on torch 2.13: the
#: segment boundaries of every allreduce checked in tests/tools/test_simulate.py follow it).
GLOO_MAX_SEGMENT_BYTES = 1 << 20


def ring_allreduce_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``sum_w tensors[w]`` as gloo's ring allreduce computes it, bit for bit.

    The flat input of ``n`` elements of ``e`` bytes is cut into ``S`` segments, ``S`` the
    multiple of ``W`` at least ``max(ceil(n e / 2^20), 2 W)``, of ``L = ceil(n / S)``
    elements each (the last ones shorter or empty); rank ``c`` owns the chunk of segments
    ``[c S/W, (c+1) S/W)``. In the ring's reduce-scatter the chunk starts at rank ``c-1``
    and travels down the ring, each rank adding its own input to what it received, so its
    sum is the left fold ``((x_{c-1} + x_{c-2}) + ...) + x_c`` (ranks modulo ``W``); the
    allgather then copies it to every rank. Float addition is commutative, so only this
    association matters. ``W`` vectorised additions: at fold step ``j`` element ``i``
    adds rank ``(c(i) - j) mod W``.
    """
    world = len(tensors)
    first = tensors[0]
    stacked = torch.stack([t.reshape(-1) for t in tensors])
    numel = first.numel()
    if world == 1 or numel == 0:
        return first.clone()
    segments = max(-(-numel * first.element_size() // GLOO_MAX_SEGMENT_BYTES), 2 * world)
    segments = -(-segments // world) * world
    chunk = -(-numel // segments) * (segments // world)
    owner = torch.arange(numel) // chunk
    columns = torch.arange(numel)
    total = stacked[(owner - 1) % world, columns]
    for j in range(2, world + 1):
        total = stacked[(owner - j) % world, columns] + total
    return total.reshape(first.shape)


class _RingAllreduce:
    """The in-memory allreduce: every rank's tensors replaced by the ring's sum."""

    @torch.no_grad()
    def work(self, data: list[list[torch.Tensor]]) -> None:
        for i in range(len(data[0])):
            total = ring_allreduce_sum([ranks[i] for ranks in data])
            for ranks in data:
                ranks[i].copy_(total)


def _register_backend() -> None:
    """Register :data:`BACKEND`, once (on first use: it imports PyTorch's in-process test backend)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from torch.testing._internal.distributed import multi_threaded_pg as threaded

    class InMemoryGroup(threaded.ProcessLocalGroup):
        """PyTorch's in-process group, with the sum of an allreduce in gloo's ring order."""

        def allreduce(self, tensor_list: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
            opts = opts or dist.AllreduceOptions()
            if opts.reduceOp != dist.ReduceOp.SUM:
                return super().allreduce(tensor_list, opts)
            # the base class's registry of collectives in flight, which its other collectives use
            collective = threaded.ProcessLocalGroup._start_coll(_RingAllreduce(), self)
            result = collective.join(self._rank, tensor_list)
            threaded.ProcessLocalGroup._end_coll(collective, self)
            return result

        def getBackendName(self) -> str:
            return BACKEND

    def create(store: Any, rank: int, world_size: int, timeout: timedelta) -> InMemoryGroup:
        group = InMemoryGroup(rank, world_size)
        dist.distributed_c10d._store_based_barrier(
            rank, store, dist.distributed_c10d.GroupName(""), world_size, timeout
        )
        return group

    dist.Backend.register_backend(BACKEND, create, devices=["cpu"])
    _REGISTERED = True


_REGISTERED = False


@dataclasses.dataclass
class Simulation:
    """What :func:`simulate` measured.

    Attributes:
        workers: ``W``.
        losses: per step, each rank's training loss (``[step][rank]``).
        evaluations: per evaluated step count, what ``evaluate(model)`` returned.
        bytes_sent / bytes_received: per step, each rank's bytes as the hook counts them.
        parameters: rank 0's parameters and buffers after the last step (``state_dict``).
        ranks_agree: whether every rank ended with bit-identical parameters (DDP's invariant).
        totals: each rank's ``state.stats()["total"]``.
    """

    workers: int
    losses: list[list[float]]
    evaluations: dict[int, Any]
    bytes_sent: list[list[int]]
    bytes_received: list[list[int]]
    parameters: dict[str, torch.Tensor]
    ranks_agree: bool
    totals: list[dict[str, Any]]


def simulate(
    model_fn: Callable[[], torch.nn.Module],
    data_fn: Callable[[int, int], tuple[Any, Any]],
    *,
    workers: int,
    steps: int,
    compressor: str = "sidco-exp",
    optimizer_fn: Callable[[Any], torch.optim.Optimizer] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] = torch.nn.functional.cross_entropy,
    evaluate: Callable[[torch.nn.Module], Any] | None = None,
    eval_every: int = 0,
    seed: int = 0,
    ddp_options: dict[str, Any] | None = None,
    **options: Any,
) -> Simulation:
    """Train ``steps`` steps on ``workers`` simulated ranks through gradsift's hook (module docstring).

    Args:
        model_fn: builds the model (called once per rank, under ``torch.manual_seed(seed)``).
        data_fn: ``(rank, step) -> (inputs, targets)``, rank ``rank``'s batch of step ``step``.
        workers: ``W``, the simulated ranks.
        steps: the number of optimizer steps.
        compressor: a registry name (each rank builds its own compressor; not ``"auto"``,
            which measures a link that simulated ranks do not have).
        optimizer_fn: ``parameters -> optimizer`` (default: SGD, lr 0.1); it is passed to the
            hook as ``optimizer=`` (DGC's momentum correction).
        loss_fn: ``(outputs, targets) -> loss`` (default: cross entropy).
        evaluate: ``model -> result``, called on rank 0's module under ``torch.no_grad()``
            after every ``eval_every`` steps (and after the last one) while the other
            ranks wait at their next collective.
        ddp_options: keywords for ``DistributedDataParallel`` (e.g. ``bucket_cap_mb``).
        options: the hook's and the compressor's options (``ratio``, ``exchange``, ...). Without
            ``scaler=``, each rank's hook gets a disabled ``GradScaler``: the hook then does
            not look for one among the live objects -- a walk that, with the ranks threads of one
            process, can hold a tuple another rank is building (CPython then raises
            ``SystemError`` from the tuple's resize).
    """
    if compressor == "auto":
        raise InvalidOptionError(
            "simulate runs a named method: compressor='auto' measures the link, and simulated ranks "
            "share memory, not a link (pass a registry name, e.g. compressor='sidco-exp')"
        )
    options.setdefault("scaler", torch.amp.GradScaler("cpu", enabled=False))
    check_int(workers, "workers", low=1)
    check_int(steps, "steps", low=0)
    check_int(eval_every, "eval_every", low=0)
    _register_backend()
    from torch.testing._internal.distributed import multi_threaded_pg as threaded

    from gradsift.frontends.ddp import register_comm_hook

    models = []
    for _ in range(workers):
        torch.manual_seed(seed)
        models.append(model_fn())
    before = torch.random.get_rng_state()
    store = dist.HashStore()
    losses = [[0.0] * workers for _ in range(steps)]
    sent = [[0] * workers for _ in range(steps)]
    received = [[0] * workers for _ in range(steps)]
    totals: list[dict[str, Any]] = [{} for _ in range(workers)]
    evaluations: dict[int, Any] = {}
    errors: list[tuple[int, BaseException]] = []

    def rank_main(rank: int) -> None:
        try:
            dist.init_process_group(BACKEND, rank=rank, world_size=workers, store=store)
            try:
                model = models[rank]
                ddp = DDP(model, **(ddp_options or {}))
                optimizer = (optimizer_fn or _sgd)(ddp.parameters())
                state = register_comm_hook(ddp, compressor, optimizer=optimizer, **options)
                for step in range(steps):
                    inputs, targets = data_fn(rank, step)
                    optimizer.zero_grad()
                    loss = loss_fn(ddp(inputs), targets)
                    loss.backward()
                    optimizer.step()
                    last = state.stats()["step"]
                    losses[step][rank] = float(loss.detach())
                    sent[step][rank] = int(last.get("bytes_sent", 0))
                    received[step][rank] = int(last.get("bytes_received", 0))
                    done = step + 1
                    due = done == steps or (eval_every > 0 and done % eval_every == 0)
                    if rank == 0 and evaluate is not None and due:
                        with torch.no_grad():
                            evaluations[done] = evaluate(model)
                totals[rank] = state.stats()["total"]
            finally:
                dist.destroy_process_group()
        except BaseException as error:  # every rank's failure is reported; the others are woken
            errors.append((rank, error))
            threaded.ProcessLocalGroup.exception_handle(error)

    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    _C10D._set_thread_isolation_mode(True)
    threaded._install_threaded_pg()
    try:
        ranks = [
            threading.Thread(target=rank_main, args=(r,), name=f"gradsift-sim-{r}") for r in range(workers)
        ]
        for thread in ranks:
            thread.start()
        for thread in ranks:
            thread.join()
    finally:
        threaded.ProcessLocalGroup.reset()
        threaded._uninstall_threaded_pg()
        _C10D._set_thread_isolation_mode(False)
        torch.set_num_threads(threads_before)
    if errors:  # the first real failure, not a rank ended because another failed
        rank, error = min(errors, key=lambda e: isinstance(e[1], SystemExit))
        raise PeerFailureError(f"simulated rank {rank} of {workers} failed: {error!r}") from error
    if not torch.equal(torch.random.get_rng_state(), before):
        warnings.warn(
            "the ranks drew from torch's global generator during training (dropout, torch.randn, ...): "
            "the threads share it, so this run is not the one W processes would make",
            stacklevel=2,
        )
    reference = models[0].state_dict()
    agree = all(
        all(torch.equal(value, other.state_dict()[name]) for name, value in reference.items())
        for other in models[1:]
    )
    return Simulation(
        workers=workers,
        losses=losses,
        evaluations=evaluations,
        bytes_sent=sent,
        bytes_received=received,
        parameters={name: value.detach().clone() for name, value in reference.items()},
        ranks_agree=agree,
        totals=totals,
    )


def _sgd(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.1)
