"""gradsift on FSDP models (src/gradsift/frontends/fsdp.py), on 2 real gloo ranks.

* FSDP1 ``NO_SHARD`` and FSDP2 hybrid sharding (``fully_shard`` on the intra-node mesh,
  gradsift on the replicate group) with ``sidco-exp``: ranks identical, bytes below
  dense, the loss of FSDP's own exchange within noise;
* FSDP1 ``FULL_SHARD``/``SHARD_GRAD_OP`` with ``fp16``/``bf16``: every shard equal to a
  reference computed in the same run from the ranks' local gradients;
* the error-feedback state checkpoints: a resumed run is bit-identical to the
  uninterrupted one (and one that forgets the state is not);
* FSDP2 hybrid with a frozen weight (as in LoRA) trains as FSDP's native HSDP does, and a
  layer no step uses is refused on every rank, naming FSDP2's ``set_reduce_scatter_unused_params``,
  which makes it train;
* every combination FSDP does not let a hook take over gives InvalidOptionError.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, fully_shard

import gradsift
from support.distributed import run_workers
from support.doc_commands import EXAMPLES_GROUP
from support.models import make_model
from support.steps import refusal_messages

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CPU = torch.device("cpu")


#: The model: Linear(8, 32), Tanh, Linear(32, 32), Tanh, Linear(32, 2)
WIDTHS = (8, 32, 32, 2)


def per_layer(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    """FSDP1 auto-wrap policy: one FSDP unit per Linear."""
    return recurse or isinstance(module, nn.Linear)


def no_shard(seed: int = 0) -> FSDP:
    return FSDP(
        make_model(WIDTHS, seed=seed),
        sharding_strategy=ShardingStrategy.NO_SHARD,
        device_id=CPU,
        auto_wrap_policy=per_layer,
    )


def fully_sharded(seed: int, mesh, frozen_first_weight: bool = False) -> nn.Module:
    """FSDP2: one ``fully_shard`` per Linear, then the root (``frozen_first_weight``: the first
    layer's weight frozen before, as LoRA's base weights)."""
    model = make_model(WIDTHS, seed=seed)
    if frozen_first_weight:
        model[0].weight.requires_grad_(False)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def teacher_task(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fixed random teacher ``y = tanh(x T)`` and a held-out evaluation set (same on every rank)."""
    generator = torch.Generator().manual_seed(1000 + seed)
    teacher = torch.randn(8, 2, generator=generator)
    inputs = torch.randn(256, 8, generator=generator)
    return teacher, inputs, torch.tanh(inputs @ teacher)


def batch(teacher: torch.Tensor, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = torch.randn(16, 8, generator=torch.Generator().manual_seed(7919 * step + rank + 1))
    return inputs, torch.tanh(inputs @ teacher)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, teacher: torch.Tensor, steps: range) -> None:
    for step in steps:
        inputs, targets = batch(teacher, step, dist.get_rank())
        loss = ((model(inputs) - targets) ** 2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def eval_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    with torch.no_grad():
        return float(((model(inputs) - targets) ** 2).mean())


def full_parameters(model: nn.Module) -> torch.Tensor:
    """Every parameter in full (FSDP2's DTensors gathered), flattened."""
    return torch.cat([getattr(p, "full_tensor", p.detach)().detach().reshape(-1) for p in model.parameters()])


# -- training against FSDP's own exchange ---------------------------------------------------
STEPS = 60


def training_worker(rank: int, world: int) -> dict:
    teacher, eval_inputs, eval_targets = teacher_task(0)
    out: dict = {"initial": eval_loss(make_model(WIDTHS, seed=0), eval_inputs, eval_targets)}
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    runs = {
        "no_shard_stock": lambda: (no_shard(), None),
        "no_shard_sidco": lambda: (m := no_shard(), gradsift.register_comm_hook(m, "sidco-exp", ratio=0.05)),
        # FSDP's native hybrid sharding (a 2-D mesh) against gradsift on the replicate group.
        "hybrid_stock": lambda: (fully_sharded(0, mesh), None),
        "hybrid_sidco": lambda: (
            m := fully_sharded(0, mesh["shard"]),
            gradsift.register_comm_hook(
                m, "sidco-exp", ratio=0.05, process_group=mesh.get_group("replicate")
            ),
        ),
    }
    for name, build in runs.items():
        model, hook = build()
        train(model, torch.optim.SGD(model.parameters(), lr=0.2), teacher, range(STEPS))
        out[name] = {"loss": eval_loss(model, eval_inputs, eval_targets), "params": full_parameters(model)}
        if hook is not None:
            out[name]["total"] = hook.stats()["total"]
            out[name]["residual_keys"] = sorted(hook.store.table("residual"))
    return out


def every_worker(rank: int, world: int) -> dict:
    """Everything below in one launch of 2 ranks (starting the processes costs more than the runs)."""
    return {
        "training": training_worker(rank, world),
        "sharded": sharded_worker(rank, world),
        "checkpoint": {
            flavour: checkpoint_worker(rank, world, flavour) for flavour in ("no_shard", "hybrid")
        },
        "nonfinite": nonfinite_worker(rank, world),
        "errors": errors_worker(rank, world),
        "frozen": frozen_worker(rank, world),
    }


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_workers(__file__, "every_worker", 2, timeout=240)


@pytest.fixture(scope="module")
def training_runs(runs) -> list[dict]:
    return [out["training"] for out in runs]


@pytest.mark.parametrize("flavour", ["no_shard", "hybrid"])
def test_sidco_exp_trains_like_fsdps_own_exchange(training_runs, flavour):
    """Margin measured over 5 seeds (60 steps, ratio 0.05, held-out loss): stock losses
    0.071-0.102 across seeds; sidco-exp's paired gap to stock +0.5% to +5.1% (mean +2.9%),
    identical for NO_SHARD and hybrid. The bound is 3x the largest gap."""
    out = training_runs[0]
    stock, sidco = out[f"{flavour}_stock"], out[f"{flavour}_sidco"]
    assert stock["loss"] < 0.5 * out["initial"]  # the task is learnt at all
    assert sidco["loss"] <= 1.15 * stock["loss"]
    total = sidco["total"]
    assert 0 < total["bytes_sent"] < 0.25 * total["dense_bytes"]  # 5% of the values plus their indices
    assert total["steps"] == STEPS and total["skipped_steps"] == 0
    assert sidco["residual_keys"] == ([(0,), (1,), (2,)] if flavour == "no_shard" else [(1,), (2,), (3,)])


@pytest.mark.parametrize("name", ["no_shard_stock", "no_shard_sidco", "hybrid_stock", "hybrid_sidco"])
def test_ranks_hold_identical_parameters_after_training(training_runs, name):
    assert torch.equal(training_runs[0][name]["params"], training_runs[1][name]["params"])


# -- 16-bit reduce-scatter of the sharded strategies ----------------------------------------
def sharded_worker(rank: int, world: int) -> dict:
    teacher, _, _ = teacher_task(0)
    inputs, targets = batch(teacher, 0, rank)
    local = make_model(WIDTHS, seed=0)
    ((local(inputs) - targets) ** 2).mean().backward()
    grad = torch.cat([p.grad.reshape(-1) for p in local.parameters()])
    padded = torch.nn.functional.pad(grad, (0, -grad.numel() % world))
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    out: dict = {}
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16), ("none", torch.float32)):
            model = FSDP(make_model(WIDTHS, seed=0), sharding_strategy=strategy, device_id=CPU)
            hook = gradsift.register_comm_hook(model, name)
            ((model(inputs) - targets) ** 2).mean().backward()
            # The reference: each rank's gradient cast, divided by W in the cast dtype, summed.
            reference = sum(g.to(dtype) / world for g in gathered).float().chunk(world)[rank]
            shard = next(model.parameters()).grad
            train(model, torch.optim.SGD(model.parameters(), lr=0.2), teacher, range(1, 6))
            with FSDP.summon_full_params(model):
                params = full_parameters(model)
            out[strategy.name, name] = {
                "equal": torch.equal(shard, reference),
                "fp32_gap": float((shard - sum(gathered).chunk(world)[rank] / world).abs().max()),
                "params": params,
                "total": hook.stats()["total"],
            }
    return out


@pytest.fixture(scope="module")
def sharded_runs(runs) -> list[dict]:
    return [out["sharded"] for out in runs]


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
@pytest.mark.parametrize("name", ["fp16", "bf16", "none"])
def test_sharded_strategies_reduce_scatter_the_cast_gradient(sharded_runs, strategy, name):
    for out in sharded_runs:
        run = out[strategy, name]
        assert run["equal"]
        if name != "none":
            assert run["fp32_gap"] > 0  # the cast really happened
        total = run["total"]
        assert total["bytes_sent"] == total["dense_bytes"] * (1 if name == "none" else 0.5)
        assert total["steps"] == 6
    assert torch.equal(sharded_runs[0][strategy, name]["params"], sharded_runs[1][strategy, name]["params"])


# -- checkpoints of the error-feedback state ------------------------------------------------
def checkpoint_worker(rank: int, world: int, flavour: str) -> dict:
    teacher, _, _ = teacher_task(0)
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))

    def build() -> tuple[nn.Module, gradsift.hook.state.GradsiftHookState, torch.optim.Optimizer]:
        if flavour == "no_shard":
            model = no_shard()
            hook = gradsift.register_comm_hook(model, "sidco-exp", ratio=0.05)
        else:
            model = fully_sharded(0, mesh["shard"])
            hook = gradsift.register_comm_hook(
                model, "sidco-exp", ratio=0.05, process_group=mesh.get_group("replicate")
            )
        return model, hook, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)

    model, hook, optimizer = build()
    train(model, optimizer, teacher, range(6))
    file = io.BytesIO()  # a real checkpoint: state_dict()s hold live tensors, a file does not
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "hook": hook.state_dict()}, file
    )
    file.seek(0)
    saved = torch.load(file, weights_only=False)
    train(model, optimizer, teacher, range(6, 10))
    out = {"full": full_parameters(model), "full_residuals": hook.store.table("residual")}
    for restore_hook in (True, False):
        model, hook, optimizer = build()
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        if restore_hook:
            hook.load_state_dict(saved["hook"])
        train(model, optimizer, teacher, range(6, 10))
        out[restore_hook] = {"params": full_parameters(model), "residuals": hook.store.table("residual")}
        out[restore_hook]["step"] = hook.step
    return out


@pytest.mark.parametrize("flavour", ["no_shard", "hybrid"])
def test_error_feedback_state_resumes_bit_exactly(runs, flavour):
    for out in (rank["checkpoint"][flavour] for rank in runs):
        resumed, forgotten = out[True], out[False]
        assert resumed["step"] == 10 and forgotten["step"] == 4
        assert torch.equal(resumed["params"], out["full"])
        assert resumed["residuals"].keys() == out["full_residuals"].keys()
        for key, residual in out["full_residuals"].items():
            assert torch.equal(resumed["residuals"][key], residual)
        assert not torch.equal(forgotten["params"], out["full"])  # the saved state is what made it exact


# -- a NaN on one rank ----------------------------------------------------------------------
def nonfinite_worker(rank: int, world: int) -> dict:
    """Step 0 is finite; in step 1 rank 1's input holds a NaN."""
    teacher, _, _ = teacher_task(0)
    out = {}
    builds = {
        "no_shard_skip": lambda: (
            m := no_shard(),
            gradsift.register_comm_hook(m, "topk", ratio=0.1, nonfinite="skip"),
        ),
        "full_shard_fp16": lambda: (
            m := FSDP(
                make_model(WIDTHS, seed=0), sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=CPU
            ),
            gradsift.register_comm_hook(m, "fp16"),
        ),
    }
    for name, build in builds.items():
        model, hook = build()
        train(model, torch.optim.SGD(model.parameters(), lr=0.2), teacher, range(1))
        before = hook.store.table("residual")
        inputs, targets = batch(teacher, 1, rank)
        if rank == 1:
            inputs[0, 0] = float("nan")
        ((model(inputs) - targets) ** 2).mean().backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        step = hook.step  # a read of the state settles the step (as the optimizer's step would)
        after = hook.store.table("residual")
        out[name] = {
            "zero": bool((grads == 0).all()),
            "nan": bool(grads.isnan().all()),
            "step": step,
            "residuals_kept": before.keys() == after.keys()
            and all(torch.equal(before[k], after[k]) for k in before),
        }
    return out


def test_a_nan_on_one_rank_follows_the_nonfinite_policy_on_every_rank(runs):
    for rank in runs:
        skipped, propagated = rank["nonfinite"]["no_shard_skip"], rank["nonfinite"]["full_shard_fp16"]
        assert skipped == {"zero": True, "nan": False, "step": 1, "residuals_kept": True}
        assert propagated["nan"] and propagated["step"] == 1


# -- frozen and unused parameters under FSDP2 hybrid sharding -------------------------------
class WithUnusedLayer(nn.Module):
    """:func:`make_model`'s layers and a layer no forward pass uses, in the root's own FSDP2 group."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_model(WIDTHS, seed=0)
        self.unused = nn.Linear(2, 2)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.body(inputs)


def frozen_worker(rank: int, world: int) -> dict:
    teacher, _, _ = teacher_task(0)
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    replicas = mesh.get_group("replicate")
    out: dict = {}
    for name, hooked in (("stock", False), ("none", True)):
        model = fully_sharded(0, mesh["shard"] if hooked else mesh, frozen_first_weight=True)
        if hooked:
            gradsift.register_comm_hook(model, "none", process_group=replicas)
        train(model, torch.optim.SGD(model.parameters(), lr=0.2), teacher, range(6))
        out[name] = {"params": full_parameters(model), "frozen": model[0].weight.full_tensor()}
    out["initial_frozen"] = make_model(WIDTHS, seed=0)[0].weight.detach()
    for flag in (False, True):
        model = WithUnusedLayer()
        fully_shard(model, mesh=mesh["shard"])
        if flag:
            model.set_reduce_scatter_unused_params(True)
        gradsift.register_comm_hook(model, "topk", ratio=0.5, process_group=replicas)
        try:
            train(model, torch.optim.SGD(model.parameters(), lr=0.2), teacher, range(3))
            out["unused", flag] = full_parameters(model)
        except gradsift.GradsiftError as error:
            out["unused", flag] = str(error)
    return out


def test_a_frozen_weight_trains_as_fsdps_native_hsdp(runs):
    for rank in runs:
        out = rank["frozen"]
        assert torch.equal(out["none"]["frozen"], out["initial_frozen"])
        assert torch.allclose(out["none"]["params"], out["stock"]["params"], rtol=0, atol=1e-6)
    assert torch.equal(runs[0]["frozen"]["none"]["params"], runs[1]["frozen"]["none"]["params"])


def test_an_unused_layer_is_refused_on_every_rank_naming_fsdps_flag_which_trains(runs):
    for rank in runs:
        assert "set_reduce_scatter_unused_params(True)" in rank["frozen"]["unused", False]
    assert torch.equal(runs[0]["frozen"]["unused", True], runs[1]["frozen"]["unused", True])


# -- what FSDP does not let a hook take over ------------------------------------------------
def errors_worker(rank: int, world: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    one_node = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    cases = {
        "sparse_on_full_shard": lambda: gradsift.register_comm_hook(
            FSDP(make_model(WIDTHS, seed=0), sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=CPU),
            "topk",
            ratio=0.1,
        ),
        "option_on_full_shard": lambda: gradsift.register_comm_hook(
            FSDP(make_model(WIDTHS, seed=0), sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, device_id=CPU),
            "fp16",
            warmup_steps=2,
        ),
        "hybrid_fsdp1": lambda: gradsift.register_comm_hook(
            FSDP(
                make_model(WIDTHS, seed=0),
                sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                device_mesh=one_node,
                device_id=CPU,
            ),
            "sidco-exp",
        ),
        # One rank per node: FSDP1 silently runs NO_SHARD over the 1-rank node (no sync at all).
        "hybrid_fsdp1_one_rank_per_node": lambda: gradsift.register_comm_hook(
            FSDP(
                make_model(WIDTHS, seed=0),
                sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                device_mesh=mesh,
                device_id=CPU,
            ),
            "sidco-exp",
        ),
        "powersgd_no_shard": lambda: gradsift.register_comm_hook(no_shard(), "powersgd"),
        "vgc_no_shard": lambda: gradsift.register_comm_hook(no_shard(), "vgc"),
        "layer_no_shard": lambda: gradsift.register_comm_hook(no_shard(), "topk", granularity="layer"),
        "optimizer_fsdp2": lambda: gradsift.register_comm_hook(
            m := fully_sharded(0, mesh["shard"]),
            "topk",
            process_group=mesh.get_group("replicate"),
            optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
        ),
        "fsdp2_without_group": lambda: gradsift.register_comm_hook(fully_sharded(0, mesh["shard"]), "topk"),
        "fsdp2_native_hsdp": lambda: gradsift.register_comm_hook(
            fully_sharded(0, mesh), "topk", process_group=mesh.get_group("replicate")
        ),
    }
    return refusal_messages(cases)


def test_unsupported_combinations_name_what_is_supported(runs):
    messages = runs[0]["errors"]  # on 2 ranks: on 1, FSDP turns every strategy into NO_SHARD
    expected = {
        "sparse_on_full_shard": "FULL_SHARD reduce-scatters",
        "option_on_full_shard": "hook options ['warmup_steps'] do not apply to SHARD_GRAD_OP",
        "hybrid_fsdp1": "FSDP1 refuses communication hooks for HYBRID_SHARD",
        "hybrid_fsdp1_one_rank_per_node": "never all-reduced across the 2 replicas",
        "powersgd_no_shard": "compressor 'powersgd' is not supported on FSDP models",
        "vgc_no_shard": "compressor 'vgc' is not supported on FSDP models",
        "layer_no_shard": "granularity must be 'bucket'",
        "optimizer_fsdp2": "optimizer= is not supported on fully_shard (FSDP2)",
        "fsdp2_without_group": "pass process_group=<the replicate group>",
        "fsdp2_native_hsdp": "2-D mesh (native HSDP)",
    }
    for name, fragment in expected.items():
        assert fragment in messages[name], (name, messages[name])
        assert "gradsift supports: FSDP1 NO_SHARD" in messages[name], name


EXAMPLE_MARGIN = 0.09


# -- the documented example -----------------------------------------------------------------
@pytest.mark.xdist_group(EXAMPLES_GROUP)
def test_fsdp_example_trains_like_stock_and_resumes_exactly(documented_runs):
    """docs/integrations.md's FSDP block as written: gradsift (FSDP2 hybrid) with a checkpoint
    at step 30, FSDP's own HSDP, and the run resumed from that checkpoint. Margin: over seeds 0-4 of the example
    sidco-exp's held-out loss was -0.44%, +1.03%, +2.75%, -0.24%, +0.38% off stock's
    (docs/integrations.md); the bound is about 3x the largest."""
    from support.doc_commands import summary_line

    block = documented_runs.find("examples/fsdp_example.py", source="docs/integrations.md")
    result = documented_runs.run(block)
    assert result.ok and len(result.runs) == 3, "\n\n".join(run.describe() for run in result.runs)
    compressed, stock, resumed = (summary_line(run.output) for run in result.runs)
    assert resumed == compressed  # same loss, bytes and step: the hook state resumed exactly
    assert compressed["replicas_agree"] and stock["replicas_agree"]
    assert 0 < compressed["bytes_sent"] < 0.15 * compressed["dense_bytes"]  # ratio 0.05 + indices
    assert compressed["loss"] <= stock["loss"] * (1 + EXAMPLE_MARGIN)
