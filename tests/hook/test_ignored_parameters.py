"""Parameters DDP was told to ignore (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``,
as libraries do for parameters they synchronise themselves): DDP never exchanges them, so the
hook numbers, watches and takes over nothing of theirs.

Oracle: stock DDP in the same process. Before, the hook numbered them with the others, so
momentum correction took SGD's momentum and weight decay from their group too: the ignored
weight trained without either, 2.6e-2 from stock DDP in 10 steps.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import gradsift
from gradsift.core.errors import InvalidOptionError
from support.distributed import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

IGNORED = "0.weight"


def trained(rank: int, own_group: bool, compressor: str | None) -> torch.Tensor:
    """Every parameter after 10 SGD steps (momentum, weight decay) with ``0.weight`` ignored by
    DDP; ``own_group``: that weight in a parameter group of its own."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [IGNORED])
    ddp = DistributedDataParallel(model)
    ignored = model.get_parameter(IGNORED)
    others = [p for p in model.parameters() if p is not ignored]
    groups = (
        [{"params": others}, {"params": [ignored]}] if own_group else [{"params": list(model.parameters())}]
    )
    optimizer = torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=0.01)
    if compressor is not None:  # every element sent, the velocity kept: SGD's momentum exactly
        gradsift.register_comm_hook(ddp, compressor, optimizer=optimizer, ratio=1.0, momentum_masking=False)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(10):
        optimizer.zero_grad()
        ddp(torch.randn(8, 16, generator=generator)).square().mean().backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def ignored_worker(rank: int, world: int) -> dict[str, object]:
    gap = float((trained(rank, True, "topk") - trained(rank, True, None)).abs().max())
    try:
        trained(rank, False, "topk")
        refusal = None
    except InvalidOptionError as error:
        refusal = str(error)
    return {"gap": gap, "refusal": refusal}


def test_the_hook_leaves_what_ddp_ignores_to_the_optimizer() -> None:
    for result in run_workers(__file__, "ignored_worker", 2, timeout=90):
        # in a group of its own the ignored weight keeps SGD's momentum and decay: stock DDP's run
        assert result["gap"] < 1e-6, result
        # in the exchanged parameters' group, taking that group's momentum would take its too
        assert "besides those DDP exchanges" in result["refusal"], result
        assert "those DDP was told to ignore" in result["refusal"], result
