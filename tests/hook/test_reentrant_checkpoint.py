"""Activation checkpointing under the hook: the step is one backward pass, nested or not.

``torch.utils.checkpoint(..., use_reentrant=True)`` (and transformers 4.x's
``gradient_checkpointing_enable()`` without kwargs) recomputes a block in a backward pass
*nested* in the outer one, so the gradients of the block's parameters -- DDP's first buckets
-- arrive in another autograd graph task than the rest. On one gloo rank, with DDP's buckets
small enough that the block and the layer before it fall in different ones:

* DDP: every method trains the reentrant model exactly as the same model recomputed without
  reentrance (the oracle: the same gradients, the same exchanges), and the hook counts one
  step per backward pass. Before, the end of the nested pass closed the step at the first
  bucket: a method with SGD's momentum taken over was refused at the second step ("2 exchanges
  of the hook's gradients before one step"), and the others counted two steps per pass.
* FSDP (units without a last one): a reentrant model is refused at its first backward, before
  any optimizer step, naming ``use_reentrant=False``; without reentrance it trains one step per
  pass. Before, every pass counted two steps.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from gradsift.core.errors import InvalidOptionError

STEPS = 5


class Blocks(torch.nn.Module):
    """A first layer, then two layers recomputed under ``torch.utils.checkpoint`` (``recompute``
    None: not checkpointed) on its output, which requires a gradient as a block's input does."""

    def __init__(self, recompute: str | None) -> None:
        super().__init__()
        self.recompute = recompute
        self.first = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh())
        self.block = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.first(inputs)
        if self.recompute is None:
            return self.block(hidden)
        reentrant = self.recompute == "reentrant"
        return torch.utils.checkpoint.checkpoint(self.block, hidden, use_reentrant=reentrant)


def trained(wrap, recompute: str | None, method: str, make_optimizer, **options):
    """``STEPS`` steps of the wrapped model on fixed data; its parameters and the hook's step count."""
    torch.manual_seed(0)
    model = wrap(Blocks(recompute))
    optimizer = make_optimizer(model.parameters())
    state = gradsift.register_comm_hook(model, method, **options)
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        optimizer.zero_grad()
        model(torch.randn(8, 16, generator=generator)).square().mean().backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), state.step


def small_buckets(model: torch.nn.Module) -> DDP:
    return DDP(model, bucket_cap_mb=0.002)  # about 500 floats: the layers in different buckets


def sgd_momentum(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


METHODS = [
    pytest.param("topk", sgd_momentum, {"ratio": 0.1}, id="topk-sgd-momentum"),
    pytest.param("sidco-exp", sgd_momentum, {"ratio": 0.05}, id="sidco-exp-sgd-momentum"),
    pytest.param("efsignsgd", adamw, {"warmup_steps": 2}, id="efsignsgd-adamw"),
    pytest.param("auto", sgd_momentum, {}, id="auto-sgd-momentum"),
]


@pytest.mark.parametrize(("method", "make_optimizer", "options"), METHODS)
def test_ddp_trains_a_reentrant_model_as_the_same_model_recomputed_without_reentrance(
    one_process_group, method, make_optimizer, options
):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.utils.checkpoint's and auto's notes are not judged here
        plain, plain_steps = trained(small_buckets, "non-reentrant", method, make_optimizer, **options)
        nested, nested_steps = trained(small_buckets, "reentrant", method, make_optimizer, **options)
    assert plain_steps == nested_steps == STEPS
    assert torch.equal(nested, plain)


def no_shard(model: torch.nn.Module) -> FSDP:
    def per_layer(module: torch.nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or isinstance(module, torch.nn.Linear)

    return FSDP(
        model,
        sharding_strategy=ShardingStrategy.NO_SHARD,
        device_id=torch.device("cpu"),
        auto_wrap_policy=per_layer,
    )


def test_fsdp_refuses_a_reentrant_model_at_its_first_backward_and_trains_one_without(one_process_group):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, steps = trained(no_shard, "non-reentrant", "topk", sgd_momentum, ratio=0.1)
        assert steps == STEPS
        torch.manual_seed(0)
        model = no_shard(Blocks("reentrant"))
        initial = [p.detach().clone() for p in model.parameters()]
        optimizer = sgd_momentum(model.parameters())
        gradsift.register_comm_hook(model, "topk", ratio=0.1)
        with pytest.raises(InvalidOptionError, match=r"use_reentrant=False"):
            model(torch.randn(8, 16)).square().mean().backward()
            optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), initial, strict=True))
