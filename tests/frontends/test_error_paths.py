"""Argument checks of the DDP hook's public entry points, in one process.

These checks run before anything collective happens, so they need no process group
and sit here rather than in the multi-process (``distributed``, ``slow``) test_ddp.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import gradsift
from gradsift.core.errors import InvalidOptionError
from gradsift.hook.state import GradsiftHookState


def test_register_comm_hook_refuses_a_model_that_is_not_ddp():
    with pytest.raises(
        InvalidOptionError, match="ddp_model must be a DistributedDataParallel model, got Linear"
    ):
        gradsift.register_comm_hook(torch.nn.Linear(2, 2), "topk", ratio=0.1)


@pytest.mark.parametrize("first", ["gradsift", "gradsift-auto", "pytorch-fp16"])
def test_a_second_hook_is_refused_before_the_optimizer_is_taken_over(one_process_group, first):
    """DDP takes one communication hook: a second registration is refused naming the one there,
    and the optimizer keeps its momentum (DDP's own refusal came after the takeover had moved it)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = DistributedDataParallel(torch.nn.Linear(4, 4))
    if first == "pytorch-fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:
        gradsift.register_comm_hook(ddp, *(() if first.endswith("auto") else ("topk",)), optimizer=False)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    named = "fp16_compress_hook" if first == "pytorch-fp16" else "gradsift's hook is already registered"
    with pytest.raises(InvalidOptionError, match=named):
        gradsift.register_comm_hook(ddp, "topk", ratio=0.5, optimizer=optimizer)
    assert (
        optimizer.param_groups[0]["momentum"] == 0.9 and "gradsift_momentum" not in optimizer.param_groups[0]
    )


def test_a_compiled_ddp_model_gets_the_hook_on_the_ddp_model_it_compiles(one_process_group):
    """``register_comm_hook(torch.compile(ddp))`` (refused as "got OptimizedModule"): the hook
    goes on ``ddp`` itself, which then takes no second hook."""
    ddp = DistributedDataParallel(torch.nn.Linear(4, 2))
    state = gradsift.register_comm_hook(torch.compile(ddp, backend="eager"), "topk", ratio=0.5)
    assert state.hooked == list(ddp.module.parameters())
    with pytest.raises(RuntimeError, match="can only be called once"):
        ddp.register_comm_hook(None, lambda state, bucket: None)


@pytest.mark.parametrize("compressor", ["topk", "efsignsgd"])
def test_an_optimizer_holding_none_of_the_models_parameters_is_refused(one_process_group, compressor):
    torch.manual_seed(0)
    model, other = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    for optimizer in (
        torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9),
        torch.optim.AdamW(other.parameters()),
    ):
        with pytest.raises(InvalidOptionError, match=r"optimizer= \((SGD|AdamW)\) holds none of the hooked"):
            gradsift.register_comm_hook(DistributedDataParallel(model), compressor, optimizer=optimizer)


def test_a_restored_hook_state_takes_no_compressor_options():
    state = GradsiftHookState.build("topk", ratio=0.1)
    # The refusal comes before the model is touched: a bare (never initialised) DDP object
    # passes the type check and would fail on its first attribute if the check were gone.
    model = DistributedDataParallel.__new__(DistributedDataParallel)
    with pytest.raises(InvalidOptionError, match=r"a restored hook state takes no options, got \['ratio'\]"):
        gradsift.register_comm_hook(model, state, ratio=0.2)
    assert state.compressor.ratio == 0.1


@pytest.mark.parametrize("saved_with_feedback", [True, False])
def test_a_checkpoint_with_the_other_error_feedback_setting_is_refused(saved_with_feedback):
    saved = GradsiftHookState.build("topk", ratio=0.1, error_feedback=saved_with_feedback).state_dict()
    hook = GradsiftHookState.build("topk", ratio=0.1, error_feedback=not saved_with_feedback)
    with pytest.raises(
        InvalidOptionError,
        match=r"checkpoint and hook disagree on error feedback \(on in one, off in the other\)",
    ):
        hook.load_state_dict(saved)


def test_error_feedback_on_a_method_that_keeps_its_own_residual_is_refused():
    # VGC's residual is its error feedback (its paper's accumulation): a second residual in the
    # hook would send every unsent value again. The forced option crashed at the first steps
    # (the hook decoded VGC's padded message alone), so it is refused when the state is built.
    with pytest.raises(
        InvalidOptionError,
        match=r"error_feedback=True .*vgc keeps what it did not send .*drop error_feedback=",
    ):
        GradsiftHookState.build("vgc", error_feedback=True)
    assert GradsiftHookState.build("vgc", error_feedback=False).feedback is None  # its own setting
    assert GradsiftHookState.build("qsgd", error_feedback=True).feedback is not None  # a residual QSGD lacks


def _with_sparse_embedding() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(50, 8, sparse=True), torch.nn.Flatten(), torch.nn.Linear(32, 2)
    )


@pytest.mark.parametrize("compressor", ["auto", "topk", "bf16"])
def test_a_model_with_sparse_gradients_is_refused_naming_the_module(one_process_group, compressor):
    ddp = DistributedDataParallel(_with_sparse_embedding())
    with pytest.raises(InvalidOptionError, match=r"0 \(Embedding\(sparse=True\)\).*sparse=False.*'none'"):
        gradsift.register_comm_hook(ddp, compressor)


def test_none_on_sparse_gradients_trains_as_stock_ddp(one_process_group):
    """``none`` is stock DDP's allreduce, which gloo runs on sparse gradients as DDP does."""
    runs = []
    for hooked in (False, True):
        ddp = DistributedDataParallel(_with_sparse_embedding())
        if hooked:
            gradsift.register_comm_hook(ddp, "none")
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(3):
            tokens = torch.randint(50, (4, 4), generator=torch.Generator().manual_seed(step))
            optimizer.zero_grad()
            ddp(tokens).square().mean().backward()
            optimizer.step()
        runs.append([p.detach().clone() for p in ddp.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
