"""Parameters in ``channels_last`` (or any non-row-major layout): the hook reads and writes them
in the order DDP's bucket holds them (gradsift/core/bucket_order.py).

Oracles: DDP's own bucket (what its reducer hands a comm hook, against the parameter's
``.grad``), stock DDP in the same process, and the same run with the model row-major. The
model is float64, where the two layouts' convolutions agree far below anything the hook could
change: over five input seeds the row-major and ``channels_last`` runs of each method differ by
at most 1.2e-14 (thresholds 1e-12 and 1e-9 below). Before the bucket order, SGD's weight decay
under momentum correction went to other elements of a ``channels_last`` convolution weight
(9.0e-3 from stock DDP), a momentum buffer taken over and Adam's first moment entered the
velocity permuted (3.1e-3, 1.0e-1, 2.1e-1 from the row-major run), and VGC tested each value
against another element's variance (6.3e-4).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import gradsift
from gradsift.core.bucket_order import flat_like, memory_order, shaped_like
from gradsift.core.errors import InvalidOptionError
from support.distributed import run_workers

STEPS = 8


def parameters() -> dict[str, torch.nn.Parameter]:
    """Parameters of every layout DDP distinguishes: row-major, channels last (2-D and 3-D
    convolutions, one with a dimension of one element), transposed, and with gaps (not dense)."""
    torch.manual_seed(0)
    conv = torch.randn(4, 3, 2, 5)
    return {
        "row-major": torch.nn.Parameter(torch.randn(3, 4)),
        "channels last": torch.nn.Parameter(conv.to(memory_format=torch.channels_last)),
        "channels last 3d": torch.nn.Parameter(
            torch.randn(2, 3, 2, 2, 3).to(memory_format=torch.channels_last_3d)
        ),
        "one channel": torch.nn.Parameter(torch.randn(4, 1, 3, 3).to(memory_format=torch.channels_last)),
        "transposed": torch.nn.Parameter(torch.randn(5, 3).t()),
        "with gaps": torch.nn.Parameter(torch.randn(4, 6)[:, ::2]),
    }


class Holder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.params = torch.nn.ParameterDict(parameters())

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        # a different weight per element, so every gradient element differs
        return sum(
            ((p * scale) ** 2 * torch.arange(p.numel()).view(p.shape)).sum() for p in self.params.values()
        )


def test_memory_order_names_the_outermost_dimension_first() -> None:
    params = parameters()
    assert memory_order(params["row-major"]) is None and memory_order(params["with gaps"]) is None
    assert memory_order(params["channels last"]) == [0, 2, 3, 1]
    assert memory_order(params["channels last 3d"]) == [0, 2, 3, 4, 1]
    assert memory_order(params["transposed"]) == [1, 0]


def test_flat_like_and_shaped_like_are_ddps_bucket_layout(one_process_group: None) -> None:
    model = Holder()
    ddp = DistributedDataParallel(model, bucket_cap_mb=25)
    seen: dict[str, object] = {}

    def record(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads the annotations themselves
        seen["buffer"], seen["params"] = bucket.buffer().clone(), bucket.parameters()
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    ddp.register_comm_hook(None, record)
    ddp(torch.tensor(1.5)).backward()
    offset, checked = 0, set()
    names = {id(p): name for name, p in model.params.items()}
    for param in seen["params"]:  # type: ignore[attr-defined]
        segment = seen["buffer"][offset : offset + param.numel()]  # type: ignore[index]
        offset += param.numel()
        assert torch.equal(flat_like(param.grad, param), segment), names[id(param)]
        assert torch.equal(shaped_like(segment, param), param.grad), names[id(param)]
        # the inverse writes through to the flat tensor, in place
        target = torch.zeros_like(segment)
        shaped_like(target, param).copy_(param.grad)
        assert torch.equal(target, segment), names[id(param)]
        checked.add(names[id(param)])
    assert checked == set(names.values())


def cnn(channels_last: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 4),
    )  # fmt: skip
    model = model.double()  # float64: the two layouts' convolutions agree far below what the hook changes
    return model.to(memory_format=torch.channels_last) if channels_last else model


def trained(
    rank: int, channels_last: bool, optimizer: str, compressor: str | None, **options: object
) -> torch.Tensor:
    """The parameters after :data:`STEPS` steps; the hook (``compressor``) registered after the
    second step, so a momentum buffer that SGD has already filled is taken over."""
    model = cnn(channels_last)
    ddp = DistributedDataParallel(model)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    generator = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        if step == 2 and compressor is not None:
            gradsift.register_comm_hook(ddp, compressor, optimizer=opt, **options)
        inputs = torch.randn(8, 3, 8, 8, generator=generator, dtype=torch.float64)
        opt.zero_grad()
        ddp(
            inputs.to(memory_format=torch.channels_last) if channels_last else inputs
        ).square().mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


#: Methods whose state moves between parameter-shaped tensors and the bucket.
METHODS = {
    "sgd momentum correction": ("sgd", "topk", {"ratio": 0.3}),
    "adamw frozen variance": ("adamw", "topk", {"ratio": 0.3, "warmup_steps": 3}),
    "adamw 1-bit": ("adamw", "efsignsgd", {"warmup_steps": 3}),
    "vgc": ("sgd", "vgc", {}),
}


def layouts_worker(rank: int, world: int) -> dict[str, float]:
    gaps = {}
    # every element sent and the velocity kept: momentum correction is SGD's momentum exactly
    dense = {"ratio": 1.0, "momentum_masking": False}
    for channels_last in (False, True):
        stock = trained(rank, channels_last, "sgd", None)
        hooked = trained(rank, channels_last, "sgd", "topk", **dense)
        gaps[f"stock, channels_last={channels_last}"] = float((hooked - stock).abs().max())
    for label, (optimizer, compressor, options) in METHODS.items():
        row_major = trained(rank, False, optimizer, compressor, **options)
        gaps[label] = float((trained(rank, True, optimizer, compressor, **options) - row_major).abs().max())
    return gaps


@pytest.mark.distributed
@pytest.mark.slow
def test_a_channels_last_model_trains_as_the_row_major_one() -> None:
    for gaps in run_workers(__file__, "layouts_worker", 2, timeout=180):
        # SGD with weight decay under momentum correction: stock DDP's run, in either layout
        assert gaps["stock, channels_last=False"] < 1e-12 and gaps["stock, channels_last=True"] < 1e-12, gaps
        for label in METHODS:  # the memory format changes no value the hook computes
            assert gaps[label] < 1e-9, (label, gaps)


def test_a_state_loads_only_into_a_model_of_its_memory_orders(one_process_group: None) -> None:
    """The state's flat tensors are in each parameter's bucket order: loaded into the model in
    another memory format their values would meet other elements, so it is refused naming the
    parameter; into the same format it loads, and so does a state saved before the record."""

    def hooked(channels_last: bool) -> tuple[DistributedDataParallel, object]:
        ddp = DistributedDataParallel(cnn(channels_last))
        state = gradsift.register_comm_hook(ddp, "topk", ratio=0.3)
        inputs = torch.randn(4, 3, 8, 8, dtype=torch.float64)
        ddp(
            inputs.to(memory_format=torch.channels_last) if channels_last else inputs
        ).square().mean().backward()
        return ddp, state

    _, saved_state = hooked(True)
    saved = saved_state.state_dict()
    assert saved["orders"] == {0: [0, 2, 3, 1], 2: [0, 2, 3, 1]}  # the two convolution weights
    with pytest.raises(
        InvalidOptionError, match=r"parameter 0 was saved in memory order \[0, 2, 3, 1\] and is in row-major"
    ):
        hooked(False)[1].load_state_dict(saved)
    hooked(True)[1].load_state_dict(saved)
    older = {key: value for key, value in saved.items() if key != "orders"}
    hooked(True)[1].load_state_dict(older)
    row_major = hooked(False)[1].state_dict()
    assert row_major["orders"] == {}
    with pytest.raises(InvalidOptionError, match="parameter 0 was saved in memory order row-major and is in"):
        hooked(True)[1].load_state_dict(row_major)
