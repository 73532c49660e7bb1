"""The checkpoint helpers on CUDA, as a CPU machine can show them: gathered hook states on
the CPU, loaded back onto the hook's device (a lazy-tensor device stands in for the GPU:
``lazy_device.py``), and the replica digest chunk by chunk against its definition."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import gradsift
import gradsift.frontends.ddp
from gradsift.core.errors import InvalidOptionError
from gradsift.integrations.checkpoint import hook_state_on, parameter_digest, to_cpu
from support.distributed import run_workers
from support.lazy_device import lazy_device, needs_lazy, tensors

# -- gather_hook_states / load_hook_state: CPU in the file, the hook's device on load -------
IN, OUT = 12, 5


def trained_hook(rank: int) -> tuple[DistributedDataParallel, object]:
    """A DDP model with dgc (residuals in the store, a generator state in the compressor's
    state) after one step on rank-dependent data."""
    torch.manual_seed(0)
    ddp_model = DistributedDataParallel(torch.nn.Linear(IN, OUT))
    state = gradsift.register_comm_hook(ddp_model, "dgc", ratio=0.2)
    generator = torch.Generator().manual_seed(rank)
    ddp_model(torch.randn(8, IN, generator=generator)).square().mean().backward()
    return ddp_model, state


def gather_worker(rank: int, world: int, checkpoint: str) -> dict:
    from gradsift.integrations.checkpoint import gather_hook_states, load_hook_state

    device = lazy_device()
    _, state = trained_hook(rank)
    own = state.state_dict()
    for table in state.store.tables.values():  # the residuals as a GPU run holds them
        for key in table:
            table[key] = table[key].to(device)
    gathered = gather_hook_states(state)
    if rank == 0:
        torch.save({"gradsift": gathered}, checkpoint)
    dist.barrier()
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    on_device = gradsift.hook.state.GradsiftHookState.build("dgc", ratio=0.2)
    load_hook_state(on_device, saved["gradsift"], device=device)
    default = gradsift.hook.state.GradsiftHookState.build("dgc", ratio=0.2)
    load_hook_state(default, saved["gradsift"])  # gloo: the CPU
    return {
        "own": own,
        "gathered": gathered,
        "loaded_devices": sorted({str(t.device) for t in tensors(on_device.store.tables)}),
        "loaded": to_cpu(on_device.state_dict()),
        "default_devices": sorted({str(t.device) for t in tensors(default.store.tables)}),
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_gathered_checkpoint_is_on_the_cpu_and_loads_onto_the_hooks_device(tmp_path: Path) -> None:
    needs_lazy()
    results = run_workers(__file__, "gather_worker", 2, timeout=180, checkpoint=str(tmp_path / "ckpt.pt"))
    gathered = results[0]["gathered"]
    assert results[1]["gathered"] is None and gathered["world_size"] == 2
    for rank, result in enumerate(results):
        entry, own = gathered["ranks"][rank], result["own"]
        assert tensors(entry) and all(t.device.type == "cpu" for t in tensors(entry))
        assert entry["store"]["layouts"] == own["store"]["layouts"]
        residuals = own["store"]["tables"]["residual"]
        assert any(bool(t.abs().sum() > 0) for t in residuals.values())
        for key, residual in residuals.items():
            assert torch.equal(entry["store"]["tables"]["residual"][key], residual)
            assert torch.equal(result["loaded"]["store"]["tables"]["residual"][key], residual)
        assert result["loaded_devices"] == ["lazy:0"]  # the store on the hook's device
        assert result["default_devices"] == ["cpu"]
        # DGC's sample stream restored (its per-key call counters: host ints)
        assert result["loaded"]["compressor"]["calls"] == own["compressor"]["calls"] != {}


def test_hook_state_on_moves_the_store_and_floating_compressor_state_only() -> None:
    needs_lazy()
    device = lazy_device()
    entry = {
        "step": 3,
        "store": {"tables": {"residual": {(0, 1): torch.ones(4)}, "bounds": {(0, 1): torch.arange(3)}},
                  "layouts": {(0, 1): (0, 1)}},
        "compressor": {"p_memory_dict": {0: torch.ones(2)}, "generators": {"cpu": torch.Generator().get_state()},
                       "rng": {"keys": torch.arange(5)}},
    }  # fmt: skip
    placed = hook_state_on(to_cpu(entry), device)
    assert placed["store"]["tables"]["residual"][(0, 1)].device == device
    assert placed["store"]["tables"]["bounds"][(0, 1)].device == device  # integer state meets positions
    assert placed["compressor"]["p_memory_dict"][0].device == device
    assert placed["compressor"]["generators"]["cpu"].device.type == "cpu"
    assert placed["compressor"]["rng"]["keys"].device.type == "cpu"
    assert placed["step"] == 3 and placed["store"]["layouts"] == {(0, 1): (0, 1)}
    back = hook_state_on(placed, "cpu")
    assert torch.equal(back["store"]["tables"]["bounds"][(0, 1)], torch.arange(3))


# -- parameters_agree: the digest, chunk by chunk -------------------------------------------
def digest_reference(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: the whole flattened model in float64; also each sum's magnitude scale."""
    flat = torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])
    positions = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
    terms = [flat, flat * positions, flat.square()]
    return torch.stack([t.sum() for t in terms]), torch.stack([t.abs().sum() for t in terms])


class LargestFloat64(TorchDispatchMode):
    """Records the largest float64 tensor any operation produces (the parameters are float32,
    so every float64 tensor is a new allocation)."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float64:
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.mark.parametrize("chunk", [1, 7, 1000, 1 << 20])
def test_digest_is_the_definition_chunk_by_chunk(chunk: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 41), torch.nn.Linear(41, 3))  # 12 464 elements
    digest = parameter_digest(model, chunk=chunk)
    reference, scale = digest_reference(model)
    assert digest.dtype == torch.float64 and digest.shape == (3,)
    assert torch.all((digest - reference).abs() <= 1e-13 * scale)


@pytest.mark.distributed
def test_parameters_agree_keeps_its_float64_temporaries_one_chunk_long(one_process_group: None) -> None:
    from gradsift.integrations.checkpoint import DIGEST_CHUNK, parameters_agree

    model = torch.nn.Linear(2048, 1100)  # 2.25 M elements: more than two chunks
    with LargestFloat64() as mode:
        assert parameters_agree(model)
    assert 0 < mode.largest <= DIGEST_CHUNK  # not the whole model (2.25 M) in float64


def test_digest_sees_a_swap_across_a_chunk_boundary_and_refuses_bad_input() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 1, bias=False)
    before = parameter_digest(model, chunk=4)
    with torch.no_grad():
        model.weight[0, [3, 4]] = model.weight[0, [4, 3]].clone()  # sum and sum of squares unchanged
    after = parameter_digest(model, chunk=4)
    assert after[0] == pytest.approx(float(before[0]), rel=1e-12) and not torch.equal(before, after)
    with pytest.raises(InvalidOptionError, match="has no parameters"):
        parameter_digest(torch.nn.ReLU())
    with pytest.raises(InvalidOptionError, match="chunk must"):
        parameter_digest(model, chunk=0)


def agree_worker(rank: int, world: int) -> dict:
    from gradsift.integrations.checkpoint import DIGEST_CHUNK, parameters_agree

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1100), torch.nn.Linear(1100, 2))  # > one chunk
    assert sum(p.numel() for p in model.parameters()) > DIGEST_CHUNK
    same = parameters_agree(model)
    weight = model[0].weight.data.view(-1)
    if rank == 1:  # one ulp, in the second chunk
        weight[DIGEST_CHUNK + 5] = torch.nextafter(weight[DIGEST_CHUNK + 5], torch.tensor(1.0))
    one_ulp = parameters_agree(model)
    if rank == 1:
        weight[DIGEST_CHUNK + 5] = torch.nextafter(weight[DIGEST_CHUNK + 5], torch.tensor(-1.0))
        weight[[10, DIGEST_CHUNK + 10]] = weight[[DIGEST_CHUNK + 10, 10]].clone()  # a swap across chunks
    swapped = parameters_agree(model)
    return {"same": same, "one_ulp": one_ulp, "swapped": swapped}


@pytest.mark.distributed
@pytest.mark.slow
def test_parameters_agree_detects_a_diverged_replica() -> None:
    for result in run_workers(__file__, "agree_worker", 2, timeout=180):
        assert result == {"same": True, "one_ulp": False, "swapped": False}
