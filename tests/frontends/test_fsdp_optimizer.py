"""FSDP with an optimizer (issue 42, item 5), on 2 real gloo ranks.

FSDP1 ``NO_SHARD`` hands the hook each unit's flat gradient and the optimizer steps the
units' flat parameters, so the DDP hook's optimizer takeovers apply unit by unit:

* AdamW's frozen-variance method at ratio 1 without momentum masking (nothing dropped, so
  the result does not depend on how the parameters are grouped) equals the DDP hook's run
  of the same method (itself held to the method written out in tests/hook/test_adam.py),
  and after the dense warm-up the optimizer's second moment stays frozen;
* with a sparsifier (top-k at 0.1) AdamW trains: the held-out loss falls, ranks agree;
* discovery: the optimizer left out is found and the run equals the one passing it;
* FSDP2 and the sharded FSDP1 strategies refuse ``optimizer=`` naming where it works, and so
  does ``NO_SHARD`` built with ``use_orig_params=True`` (the optimizer holds no flat parameter).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift
from support.distributed import run_workers
from support.models import make_model
from support.steps import refusal_messages

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CPU = torch.device("cpu")
WIDTHS = (8, 32, 32, 2)
STEPS, WARMUP = 30, 10


def per_layer(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    return recurse or isinstance(module, nn.Linear)


def no_shard(**kwargs) -> FSDP:
    return FSDP(
        make_model(WIDTHS, seed=0),
        sharding_strategy=ShardingStrategy.NO_SHARD,
        device_id=CPU,
        auto_wrap_policy=per_layer,
        **kwargs,
    )


def data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    inputs = torch.randn(16, 8, generator=generator)
    return inputs, torch.tanh(inputs @ torch.ones(8, 2) / 3)


def train(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
    held_out = data(10_000, 0)
    losses = []
    for step in range(STEPS):
        inputs, targets = data(step, dist.get_rank())
        optimizer.zero_grad(set_to_none=True)
        ((model(inputs) - targets) ** 2).mean().backward()
        optimizer.step()
        with torch.no_grad():
            losses.append(float(((model(held_out[0]) - held_out[1]) ** 2).mean()))
    return losses


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by its original name (FSDP1's flat parameters unflattened)."""
    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model):
            return {
                k.replace("_fsdp_wrapped_module.", ""): v.detach().clone()
                for k, v in model.named_parameters()
            }
    return {k.removeprefix("module."): v.detach().clone() for k, v in model.named_parameters()}


def run(frontend: str, compressor: str, passed: bool = True, **options) -> dict:
    model = no_shard() if frontend == "fsdp" else DDP(make_model(WIDTHS, seed=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    given = {"optimizer": optimizer} if passed else {}
    state = gradsift.register_comm_hook(model, compressor, warmup_steps=WARMUP, **given, **options)
    squares: list[torch.Tensor] = []

    def frozen(opt, args, kwargs) -> None:
        squares.append(torch.cat([s["exp_avg_sq"].reshape(-1) for s in opt.state.values()]).clone())

    optimizer.register_step_post_hook(frozen)
    losses = train(model, optimizer)
    return {"losses": losses, "params": params(model), "squares": squares, "adam": state.adam is not None}


def errors(rank: int, world: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))

    def fsdp2() -> None:
        model = make_model(WIDTHS, seed=0)
        fully_shard(model, mesh=mesh["shard"])
        gradsift.register_comm_hook(
            model,
            "topk",
            process_group=mesh.get_group("replicate"),
            optimizer=torch.optim.AdamW(model.parameters()),
        )

    def full_shard() -> None:
        model = FSDP(make_model(WIDTHS, seed=0), sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=CPU)
        gradsift.register_comm_hook(model, "bf16", optimizer=torch.optim.AdamW(model.parameters()))

    def original_params() -> None:
        model = no_shard(use_orig_params=True)
        gradsift.register_comm_hook(model, "topk", optimizer=torch.optim.AdamW(model.parameters()))

    def zero_one() -> None:
        model = no_shard()
        optimizer = torch.optim.AdamW(model.parameters())
        gradsift.register_comm_hook(model, "efsignsgd", optimizer=optimizer, adam="zero-one", warmup_steps=2)

    return refusal_messages(
        {"fsdp2": fsdp2, "full_shard": full_shard, "original_params": original_params, "zero_one": zero_one}
    )


def worker(rank: int, world: int) -> dict:
    exact = {"ratio": 1.0, "momentum_masking": False}
    return {
        "fsdp_exact": run("fsdp", "topk", **exact),
        "ddp_exact": run("ddp", "topk", **exact),
        "fsdp_sparse": run("fsdp", "topk", ratio=0.1),
        "fsdp_found": run("fsdp", "topk", passed=False, ratio=0.1),
        "errors": errors(rank, world),
    }


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_workers(__file__, "worker", 2, timeout=180)


def test_no_shard_runs_the_adam_method_as_ddp_does(runs):
    for out in runs:
        fsdp, ddp = out["fsdp_exact"], out["ddp_exact"]
        assert fsdp["adam"] and ddp["adam"]
        assert fsdp["params"].keys() == ddp["params"].keys()
        for name, value in fsdp["params"].items():
            torch.testing.assert_close(value, ddp["params"][name], rtol=1e-5, atol=1e-6)
        squares = fsdp["squares"]
        assert not torch.equal(squares[WARMUP - 2], squares[WARMUP - 1])  # dense steps update v
        assert all(torch.equal(squares[WARMUP - 1], later) for later in squares[WARMUP:])  # then frozen


def test_no_shard_trains_with_adamw_and_a_sparsifier(runs):
    losses = runs[0]["fsdp_sparse"]["losses"]
    assert losses[-1] < 0.5 * losses[0]
    assert losses[-1] < 1.2 * losses[WARMUP - 1]  # the compressed steps keep it
    for name, value in runs[0]["fsdp_sparse"]["params"].items():
        assert torch.equal(value, runs[1]["fsdp_sparse"]["params"][name])  # ranks agree


def test_no_shard_finds_the_optimizer_left_out(runs):
    for out in runs:
        assert out["fsdp_found"]["adam"]
        for name, value in out["fsdp_found"]["params"].items():
            assert torch.equal(value, out["fsdp_sparse"]["params"][name])


def test_where_the_optimizer_cannot_apply_it_is_refused_naming_where_it_can(runs):
    messages = runs[0]["errors"]
    expected = {
        "fsdp2": "optimizer= is not supported on fully_shard (FSDP2)",
        "full_shard": "optimizer= is not supported on FULL_SHARD",
        "original_params": "steps none of this FSDP model's flat parameters",
    }
    for name, fragment in expected.items():
        assert fragment in messages[name], (name, messages[name])
        assert "FSDP1 NO_SHARD with use_orig_params=False" in messages[name], name
    assert "on FSDP models use adam='frozen-variance' or 'onebit'" in messages["zero_one"]
