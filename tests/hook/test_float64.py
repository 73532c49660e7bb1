"""A float64 model under the hook's Adam methods and an SGD taken over after it stepped.

The velocity is float32 or the gradient's dtype where wider (``ErrorFeedback.compensate``);
what starts it -- Adam's first moment at the warm-up's end, SGD's momentum buffers -- and the
Adam methods' own arithmetic follow the same rule. Before, both starts were float32, so the
first compressed step of a float64 model stopped with "tensor ... changed from float32 to
float64" (every frozen-variance method; SGD's buffers taken over mid-run).
Oracle: stock DDP in the same process (SGD at full density without momentum masking).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import gradsift
from gradsift.hook.adam import METHODS
from support.distributed import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def trained(
    rank: int, optimizer: str, compressor: str | None, register_at: int = 0, **options: object
) -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).double()
    ddp = DistributedDataParallel(model)
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if optimizer == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=1e-3)
    )
    generator = torch.Generator().manual_seed(rank)
    for step in range(8):
        if step == register_at and compressor is not None:
            gradsift.register_comm_hook(ddp, compressor, optimizer=opt, **options)
        opt.zero_grad()
        ddp(torch.randn(8, 16, generator=generator, dtype=torch.float64)).square().mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def float64_worker(rank: int, world: int) -> dict[str, object]:
    stock = trained(rank, "sgd", None)
    taken = trained(rank, "sgd", "topk", register_at=2, ratio=1.0, momentum_masking=False)
    adam = {method: trained(rank, "adamw", "topk", adam=method, warmup_steps=3) for method in METHODS}
    return {
        "sgd gap": float((taken - stock).abs().max()),
        "adam finite": {method: bool(p.isfinite().all()) for method, p in adam.items()},
        "adam": adam,
    }


def test_a_float64_model_trains_under_every_adam_method_and_an_sgd_taken_over_mid_run() -> None:
    results = run_workers(__file__, "float64_worker", 2, timeout=120)
    for result in results:
        assert result["sgd gap"] < 1e-12, result["sgd gap"]  # float64 throughout: stock DDP's run
        assert all(result["adam finite"].values()), result["adam finite"]
    for method, params in results[0]["adam"].items():  # the replicas agree
        assert torch.equal(params, results[1]["adam"][method]), method
