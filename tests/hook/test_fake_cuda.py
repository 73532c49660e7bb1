"""Every route of the hook on (fake) CUDA tensors: devices checked, no host read, one readout.

Under ``FakeTensorMode`` (``support/fake_cuda.py``) tensors claim ``device="cuda"`` on this
CPU-only build: a CPU tensor mixed into the route raises a device mismatch, and a host
read (``.item()``, ``.tolist()``, ``bool()``, a data-dependent size) raises. Every
registered compressor runs through every exchange it supports, in fp32, bf16 and fp16,
through :func:`gradsift.hook.route.route_bucket` -- the DDP hook's bucket route -- with the
collectives stood in (``torch.distributed``'s functions, as :mod:`gradsift.core.collectives`
and the exchanges call them: ``W`` workers that sent what this one sent). Per step:

* no host read and no host-to-device copy while the buckets are routed and the step
  closes (``support/host_reads.HostReads``, and the fake mode itself, which raises on any);
* exactly one readout when the step settles, of device tensors only (it is stood in: its
  one transfer is the step's permitted host read);
* afterwards every tensor of the hook's state (store, compressor state) is on the device.

The matrix must fail when a CPU tensor or an ``.item()`` is planted in the route: the last
tests plant each and check that a case fails. Values are not computed (fake tensors have
none); streams, NCCL and atomics are out of reach.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException

import gradsift
from gradsift.compressors import topk
from gradsift.compressors.quantization import StochasticQuantizer
from gradsift.core import collectives
from gradsift.core.readout import Readout
from gradsift.exchanges import reduce_scatter
from gradsift.hook.feedback import ErrorFeedback
from gradsift.hook.layout import FlatBucket
from gradsift.hook.route import route_bucket
from gradsift.hook.state import GradsiftHookState
from support.fake_cuda import fake_cuda, on_fake_cuda
from support.host_reads import HostReads
from support.lazy_device import tensors

#: The allreduce exchange compares data pointers (an identity check, not a read).
pytestmark = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")

WORLD = 4
STEPS = 3
WIDTH = 48

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: Options that make a compressor take its hook path at once.
OPTIONS = {
    "threshold": {"threshold": 0.01},
    "sidco-exp": {"exact_below": 0},
    "sidco-gpareto": {"exact_below": 0},
    "sidco-gamma": {"exact_below": 0},
}
#: Registered compressors the matrix leaves out, with the reason.
EXCEPTIONS = {
    "powersgd": "runs PyTorch's own PowerSGD hook (torch.distributed.algorithms), which takes its "
    "group from the dist.group.WORLD property and chains torch futures on the collectives' "
    "works; its host reads are counted on gloo by tests/hook/test_host_reads.py",
}


def cases() -> list[tuple[str, str, str]]:
    found = []
    for name in gradsift.available_compressors():
        if name in EXCEPTIONS:
            continue
        for exchange in gradsift.get_compressor(name, **OPTIONS.get(name, {})).exchanges:
            found.extend((name, exchange, dtype) for dtype in DTYPES)
    return found


def test_every_compressor_is_in_the_matrix_or_excepted_with_a_reason():
    covered = {name for name, _, _ in cases()}
    assert covered | set(EXCEPTIONS) == set(gradsift.available_compressors())
    assert len(covered) >= len(gradsift.available_compressors()) - 1


class _Work:
    def wait(self) -> bool:
        return True


def _stand_in_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    """``WORLD`` workers that all sent what this one (rank 0) sent."""

    def all_reduce(tensor, op=None, group=None, async_op=False):
        tensor.mul_(WORLD)
        return _Work()

    def all_gather_into(out, local, group=None, async_op=False):
        out.copy_(local.reshape(-1).repeat(WORLD).view(out.shape))
        return _Work()

    def reduce_scatter_into(out, message, group=None, async_op=False, op=None):
        out.copy_(message.reshape(WORLD, -1)[0].view(out.shape) * WORLD)
        return _Work()

    def all_to_all_single(out, blocks, group=None, async_op=False):
        out.copy_(blocks.reshape(WORLD, -1)[0].repeat(WORLD).view(out.shape))
        return _Work()

    def all_gather(outs, local, group=None, async_op=False):
        for out in outs:
            out.copy_(local)
        return _Work()

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "broadcast", lambda tensor, src, group=None, async_op=False: _Work())
    monkeypatch.setattr(dist, "all_to_all_single", all_to_all_single)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(collectives, "all_gather_into", all_gather_into)
    monkeypatch.setattr(reduce_scatter, "_reduce_scatter", reduce_scatter_into)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: WORLD)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)


class Readouts:
    """Stands in for :meth:`Readout.read` (the step's one transfer): counts the reads and
    what they carry, checks it is on the device, and reads zeros."""

    def __init__(self) -> None:
        self.reads = 0
        self.off_device: list[str] = []

    def read(self, readout: Readout) -> None:
        started = [entry for entries, _ in readout._copies for entry in entries]  # by Readout.start
        pending, readout._pending, readout._copies = started + readout._pending, [], []
        if pending:
            self.reads += 1
        for slot, tensor in pending:
            if not on_fake_cuda(tensor):
                self.off_device.append(f"{tensor.device} {tuple(tensor.shape)}")
            slot._values = [0.0] * tensor.numel()


class _Bucket(FlatBucket):
    """DDP's ``GradBucket`` reading interface, its index included (PowerSGD's state is by index)."""

    def __init__(self, flat: torch.Tensor, params: list[torch.Tensor], last: bool, index: int) -> None:
        super().__init__(flat, params, last)
        self.number = index

    def index(self) -> int:
        return self.number


class _Module:
    """What the hook reads of DDP: the module, the group, the reducer's kind."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.process_group, self._use_python_reducer = module, None, False


def _linear(fan_in: int, fan_out: int, dtype: torch.dtype) -> torch.nn.Linear:
    layer = torch.nn.Linear(fan_in, fan_out, device="meta")
    layer.weight = torch.nn.Parameter(torch.empty(fan_out, fan_in, device="cuda", dtype=dtype))
    layer.bias = torch.nn.Parameter(torch.empty(fan_out, device="cuda", dtype=dtype))
    return layer


def run_case(
    monkeypatch, name: str, exchange: str, dtype: str, granularity: str = "bucket", momentum: float = 0.0
) -> Readouts:
    """Three steps of two buckets through the route; raises on any device mix or host read.
    ``momentum``: SGD's, which the hook takes over (its momentum correction)."""
    _stand_in_collectives(monkeypatch)
    readouts = Readouts()
    monkeypatch.setattr(Readout, "read", lambda readout: readouts.read(readout))
    # per-worker stochastic rounding draws from a generator on the tensor's device, which a
    # CPU-only build cannot make: a CPU one stands in (a fake random op reads none)
    monkeypatch.setattr(StochasticQuantizer, "_generator", lambda self, device: torch.Generator())
    with fake_cuda(monkeypatch):
        kind = DTYPES[dtype]
        model = torch.nn.Sequential(_linear(WIDTH, WIDTH, kind), torch.nn.Tanh(), _linear(WIDTH, 8, kind))
        state = GradsiftHookState.build(
            name, exchange=exchange, granularity=granularity, **OPTIONS.get(name, {})
        )
        state.attach(_Module(model), torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum))
        layers = [list(model[2].parameters()), list(model[0].parameters())]  # DDP's order: last first
        for step in range(STEPS):
            reads = HostReads()
            with reads:  # the buckets' routes and the step's close
                for index, params in enumerate(layers):
                    flat = torch.empty(sum(p.numel() for p in params), device="cuda", dtype=kind)
                    route_bucket(state, _Bucket(flat, params, index == len(layers) - 1, index))
            assert reads.count == 0, f"step {step}: host reads during the route: {dict(reads.sites)}"
            state.settle()  # after backward: the step's one readout, counted apart
            # one readout per step (the identity's stock step has nothing to read)
            expected = step + 1 if not state.compressor.identity else 0
            assert readouts.reads == expected, f"step {step}: {readouts.reads} readouts"
        assert not readouts.off_device, f"read from off the device: {readouts.off_device}"
        held = tensors(state.store.tables) + tensors(state.compressor.state_dict())
        off = [f"{t.device} {tuple(t.shape)}" for t in held if not on_fake_cuda(t)]
        assert not off, f"state off the device: {off}"
    return readouts


@pytest.mark.parametrize(("name", "exchange", "dtype"), cases())
def test_every_route_stays_on_the_device_without_host_reads(monkeypatch, name, exchange, dtype):
    run_case(monkeypatch, name, exchange, dtype)


@pytest.mark.parametrize("name", ["topk", "vgc", "sidco-exp"])
def test_the_layer_granularity_too(monkeypatch, name):
    run_case(monkeypatch, name, gradsift.get_compressor(name).exchanges[0], "bf16", granularity="layer")


@pytest.mark.parametrize("name", ["topk", "sidco-exp", "efsignsgd"])
def test_momentum_corrected_state_kept_in_the_result_stays_on_the_device(monkeypatch, name):
    """Under SGD momentum the sparsifiers' velocity waits in the bucket and the close commits
    it gated on the device flag (hook.feedback, step 3): from the second step on, with no host read."""
    commits = []
    commit = ErrorFeedback.commit_in_result

    def counted(self, *args, **kwargs):
        commits.append(args[0])
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(ErrorFeedback, "commit_in_result", counted)
    run_case(monkeypatch, name, "allgather", "fp32", momentum=0.9)
    assert len(commits) == 2 * (STEPS - 1)  # two buckets, every step after the first


def test_the_matrix_fails_on_a_planted_item(monkeypatch):
    selection = topk.top_k_selection

    def planted(flat, k):
        found = selection(flat, k)
        found[0].sum().item()
        return found

    monkeypatch.setattr(topk, "top_k_selection", planted)
    with pytest.raises(DataDependentOutputException):
        run_case(monkeypatch, "topk", "allgather", "fp32")


def test_the_matrix_fails_on_a_planted_cpu_tensor(monkeypatch):
    selection = topk.top_k_selection

    def planted(flat, k):
        indices, magnitudes, smallest, nonfinite = selection(flat, k)
        return indices, magnitudes + torch.zeros(magnitudes.shape, device="cpu"), smallest, nonfinite

    monkeypatch.setattr(topk, "top_k_selection", planted)
    with pytest.raises(Exception, match="(?i)device"):
        run_case(monkeypatch, "topk", "allgather", "fp32")


def test_the_matrix_fails_on_a_planted_host_to_device_copy(monkeypatch):
    selection = topk.top_k_selection

    def planted(flat, k):
        indices, magnitudes, smallest, nonfinite = selection(flat, k)
        return indices + torch.tensor([0], device=flat.device), magnitudes, smallest, nonfinite

    monkeypatch.setattr(topk, "top_k_selection", planted)
    with pytest.raises(AssertionError, match="host reads during the route"):
        run_case(monkeypatch, "topk", "allgather", "fp32")
