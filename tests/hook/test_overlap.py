"""The hook overlaps communication with backward: a bucket's collective starts while
backward is still computing the gradients of earlier layers.

On 2 gloo ranks each rank records, in one list and in the order they happen on the thread
that runs backward (CPU autograd runs there), two kinds of events of one training step:

* ``grad``: a parameter's gradient was computed (a tensor hook on the parameter, which
  autograd runs before the gradient is accumulated and handed to DDP's reducer);
* ``launch``: a collective was started (``torch.distributed.all_reduce`` and the
  allgather that gradsift's collectives call, wrapped for the test), and ``wait``: someone
  waited for it (its ``Work.wait()``; a blocking call waits before it returns).

Overlap means some collective is launched before the last ``grad`` of the step and not
waited for before it: the first bucket's collective was in flight while backward still
computed the first layers' gradients. Wall-clock times play no part, only the order.

Positive control: stock DDP's allreduce as a Python hook (``default_hooks.allreduce_hook``).
Negative controls, which the order test must say do not overlap: a hook that keeps every
bucket until DDP hands it the last one and only then starts the allreduces, and one that
starts each bucket's allreduce at once but waits for it before returning.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from support.distributed import run_workers
from support.models import make_model

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WIDTH, LAYERS, STEPS = 256, 4, 3
#: LAYERS Linear(WIDTH, WIDTH) + Tanh, then Linear(WIDTH, 1)
WIDTHS = (WIDTH,) * (LAYERS + 1) + (1,)
#: Bucket cap below one layer's weight (256 KiB in float32): DDP's rebuilt buckets (from
#: the second step on; the first step has one bucket) hold about one layer each.
BUCKET_CAP_MB = 0.2
HOOKS = ("gradsift-topk", "stock-allreduce", "deferred-allreduce", "blocking-allreduce")
OVERLAPPING = ("gradsift-topk", "stock-allreduce")


class Deferred:
    """A comm hook that starts no collective until DDP hands it the step's last bucket."""

    def __init__(self) -> None:
        self.held: list[tuple[torch.Tensor, torch.futures.Future[torch.Tensor]]] = []

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self.held.append((bucket.buffer(), future))
        if bucket.is_last():
            for buffer, held in self.held:
                dist.all_reduce(buffer.div_(dist.get_world_size()))
                held.set_result(buffer)
            self.held = []
        return future


def hooked(name: str) -> DistributedDataParallel:
    import gradsift

    model = DistributedDataParallel(make_model(WIDTHS, seed=0), bucket_cap_mb=BUCKET_CAP_MB)
    # this module's hooks go in as lambdas: DDP rejects their (string) annotations
    if name == "gradsift-topk":
        gradsift.register_comm_hook(model, "topk", ratio=0.01)
    elif name == "stock-allreduce":
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    elif name == "deferred-allreduce":
        deferred = Deferred()
        model.register_comm_hook(None, lambda state, bucket: deferred(state, bucket))
    else:
        model.register_comm_hook(None, lambda state, bucket: blocking_allreduce(state, bucket))
    return model


def blocking_allreduce(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Stock DDP's ``allreduce(g / W)``, waited for inside the hook (serialised with backward)."""
    buffer = bucket.buffer().div_(dist.get_world_size())
    dist.all_reduce(buffer, async_op=True).wait()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def recorded_worker(rank: int, world: int, name: str) -> dict[str, Any]:
    """The events of the last of ``STEPS`` steps, and the buckets DDP made."""
    from gradsift.core import collectives

    events: list[tuple[str, Any]] = []
    all_reduce, all_gather = dist.all_reduce, collectives.all_gather_into

    def launching(collective: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            number = sum(kind == "launch" for kind, _ in events)
            events.append(("launch", number))
            work = collective(*args, **kwargs)
            if work is None:  # a blocking call: done when it returns
                events.append(("wait", number))
                return None
            return RecordedWork(work, number, events)

        return launch

    dist.all_reduce = launching(all_reduce)
    collectives.all_gather_into = launching(all_gather)
    model = hooked(name)
    for number, param in enumerate(model.parameters()):
        param.register_hook(lambda grad, number=number: events.append(("grad", number)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        events.clear()
        inputs = torch.randn(16, WIDTH, generator=generator)
        optimizer.zero_grad()
        model(inputs).square().mean().backward()
        events.append(("backward returned", None))
        optimizer.step()
    buckets = len(model._get_ddp_logging_data().get("rebuilt_bucket_sizes", "").split(", "))
    return {"events": list(events), "buckets": buckets, "params": len(list(model.parameters()))}


class RecordedWork:
    """A collective's ``Work`` that records ``("wait", number)`` when it is waited for."""

    def __init__(self, work: Any, number: int, events: list[tuple[str, Any]]) -> None:
        self.work, self.number, self.events = work, number, events

    def wait(self, *args: Any) -> Any:
        self.events.append(("wait", self.number))
        return self.work.wait(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def overlaps(events: list[tuple[str, Any]]) -> bool:
    """Whether some collective was launched, and not waited for, before backward computed
    its last gradient."""
    last_grad = max(i for i, (kind, _) in enumerate(events) if kind == "grad")
    before = events[:last_grad]
    waited = {n for kind, n in before if kind == "wait"}
    return any(kind == "launch" and n not in waited for kind, n in before)


@pytest.fixture(scope="module", params=HOOKS)
def recorded(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, run_workers(__file__, "recorded_worker", 2, timeout=180, name=request.param)


def test_the_step_is_recorded_whole(recorded: tuple[str, list[dict[str, Any]]]) -> None:
    _, ranks = recorded
    for rank in ranks:
        events = rank["events"]
        assert rank["buckets"] >= LAYERS  # several buckets: there is something to overlap
        assert sorted(n for kind, n in events if kind == "grad") == list(range(rank["params"]))
        assert sum(kind == "launch" for kind, _ in events) >= rank["buckets"]
        assert events[-1] == ("backward returned", None)


def test_communication_overlaps_backward(recorded: tuple[str, list[dict[str, Any]]]) -> None:
    name, ranks = recorded
    for rank in ranks:
        assert overlaps(rank["events"]) is (name in OVERLAPPING), rank["events"]
