"""The hook's state in a torch.distributed.checkpoint checkpoint (gradsift.integrations.dcp): on 4
gloo ranks a run saved with the model and the optimizer and resumed in fresh objects ends bit for
bit where the uninterrupted run ends, each rank restoring its own residuals; a checkpoint
without the hook's entries is refused naming what is missing."""

from __future__ import annotations

import pytest
import torch

from support.distributed import run_workers

SAVE_AT, STEPS = 6, 10


def worker(rank: int, world: int, directory: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsift
    from gradsift.integrations.dcp import hook_state_dict, load_hook_state_dict

    def fresh():
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
        return model, optimizer, gradsift.register_comm_hook(model, "topk", ratio=0.1, optimizer=optimizer)

    def train(model, optimizer, steps):
        for step in steps:
            data = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))
            optimizer.zero_grad()
            model(data).square().mean().backward()
            optimizer.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    model, optimizer, state = fresh()
    train(model, optimizer, range(SAVE_AT))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save(
        {"model": model_sd, "optim": optim_sd, **hook_state_dict(state)}, checkpoint_id=f"{directory}/ckpt"
    )
    full = train(model, optimizer, range(SAVE_AT, STEPS))
    residuals = sum(float(r.abs().sum()) for r in state.store.table("residual").values())

    resumed_model, resumed_optimizer, resumed_state = fresh()
    model_sd, optim_sd = get_state_dict(resumed_model, resumed_optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{directory}/ckpt")
    set_state_dict(resumed_model, resumed_optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    load_hook_state_dict(resumed_state, f"{directory}/ckpt")
    resumed = train(resumed_model, resumed_optimizer, range(SAVE_AT, STEPS))

    dcp.save({"model": get_state_dict(model, optimizer)[0]}, checkpoint_id=f"{directory}/bare")
    try:
        load_hook_state_dict(fresh()[2], f"{directory}/bare")
        refusal = None
    except gradsift.InvalidOptionError as error:
        refusal = str(error)
    return {"full": full, "resumed": resumed, "residuals": residuals, "refusal": refusal}


@pytest.mark.slow
@pytest.mark.distributed
def test_a_four_rank_dcp_checkpoint_resumes_bit_for_bit(tmp_path):
    results = run_workers(__file__, "worker", 4, timeout=180, directory=str(tmp_path))
    for rank, result in enumerate(results):
        assert torch.equal(result["full"], result["resumed"]), rank
        assert torch.equal(result["full"], results[0]["full"]), rank  # replicas equal
        assert result["residuals"] > 0  # each rank had its own residuals to restore
        assert "no gradsift hook state for rank" in result["refusal"]
