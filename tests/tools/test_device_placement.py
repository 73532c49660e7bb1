"""CUDA + NCCL correctness of the trainer that a CPU machine can show: the evaluation's
allreduce on the model's device (a lazy-tensor device stands in for the GPU:
``lazy_device.py``), and which device and backend a run picks (``torch.cuda``'s answers
monkeypatched)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import gradsift.tools.train.demo
from gradsift.core.errors import InvalidOptionError
from gradsift.tools.train.config import TrainConfig
from gradsift.tools.train.devices import fallback_device, resolve_device
from support.distributed import run_workers
from support.lazy_device import lazy_device, needs_lazy


def reduce_via_host(devices: list[str]):
    """A ``dist.all_reduce`` that records the device of what it is given and reduces a
    lazy tensor through a CPU copy (gloo reduces CPU tensors only)."""
    real = dist.all_reduce

    def all_reduce(tensor: torch.Tensor, *args, **kwargs):
        devices.append(str(tensor.device))
        if tensor.device.type == "cpu":
            return real(tensor, *args, **kwargs)
        host = tensor.cpu()
        work = real(host, *args, **kwargs)
        work.wait()
        tensor.copy_(host)
        return work

    return all_reduce


# -- evaluate: the totals stay on the model's device ----------------------------------------
def evaluate_worker(rank: int, world: int) -> dict:
    from gradsift.tools.train.data import load_dataset
    from gradsift.tools.train.loop import evaluate
    from gradsift.tools.train.models import build_model

    device = lazy_device()
    _, test, _ = load_dataset(synthetic=True, seed=0)
    model = build_model("mlp", 0)
    with torch.no_grad():  # the definition, on the whole split in one process
        logits = model(test.images)
        reference = (
            float((logits.argmax(dim=-1) == test.labels).double().mean()),
            float(torch.nn.functional.cross_entropy(logits, test.labels)),
        )
    devices: list[str] = []
    dist.all_reduce = reduce_via_host(devices)
    accuracy, loss = evaluate(model.to(device), test, device, batch_size=100)
    return {"devices": devices, "accuracy": accuracy, "loss": loss, "reference": reference}


@pytest.mark.distributed
@pytest.mark.slow
def test_evaluate_reduces_on_the_models_device_and_matches_the_whole_split() -> None:
    needs_lazy()
    results = run_workers(__file__, "evaluate_worker", 2, timeout=180)
    for result in results:
        assert result["devices"] == ["lazy:0"]  # one allreduce, of a tensor on the model's device
        accuracy, loss = result["reference"]
        assert result["accuracy"] == pytest.approx(accuracy, abs=1e-12)
        assert result["loss"] == pytest.approx(loss, rel=1e-5)
    assert results[0]["accuracy"] == results[1]["accuracy"] and results[0]["loss"] == results[1]["loss"]


# -- which device and backend a run picks ------------------------------------------------------
@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    """``gpus(n)``: pretend this machine has CUDA with ``n`` GPUs (``None``: no CUDA);
    ``set_device`` calls are recorded in the returned list."""
    calls: list = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)

    def pretend(count: int | None) -> list:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count is not None)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count or 0)
        return calls

    return pretend


def test_resolve_device_refuses_too_few_gpus_and_suggests_the_cpu(gpus) -> None:
    gpus(None)
    assert resolve_device("auto", 2) == "cpu" and resolve_device("cpu", 2) == "cpu"
    with pytest.raises(InvalidOptionError, match="--device cuda needs CUDA"):
        resolve_device("cuda", 1)
    gpus(2)
    assert resolve_device("auto", 2) == "cuda" and resolve_device("cuda", 2) == "cuda"
    assert resolve_device("cpu", 4) == "cpu"
    for requested in ("auto", "cuda"):
        with pytest.raises(InvalidOptionError, match=r"--workers 3 needs 3 GPUs .* has 2: .*--device cpu"):
            resolve_device(requested, 3)
    with pytest.raises(InvalidOptionError, match="device must be one of auto, cpu, cuda; got 'gpu'"):
        resolve_device("gpu", 1)
    with pytest.raises(InvalidOptionError, match="device must be one of"):
        TrainConfig(out="x", device="gpu")


def test_fallback_device_trains_on_the_cpu_with_too_few_gpus(gpus) -> None:
    gpus(1)
    device, note = fallback_device(2)
    assert device == "cpu" and "1 GPU(s) for 2 workers" in note and "CPU with gloo" in note
    gpus(2)
    assert fallback_device(2) == ("cuda", None)
    gpus(None)
    assert fallback_device(2) == ("cpu", None)


def test_rank_device_takes_its_local_gpu_or_the_cpu(gpus, monkeypatch: pytest.MonkeyPatch) -> None:
    from gradsift.tools.train.loop import rank_device

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    calls = gpus(1)
    with pytest.raises(InvalidOptionError, match="LOCAL_WORLD_SIZE 2 needs 2 GPUs"):
        rank_device(TrainConfig(out="x"))
    assert calls == []  # refused before cuda:1 is touched
    assert rank_device(TrainConfig(out="x", device="cpu")) == (torch.device("cpu"), "gloo")
    calls = gpus(2)
    assert rank_device(TrainConfig(out="x")) == (torch.device("cuda", 1), "nccl")
    assert calls == [torch.device("cuda", 1)]
    gpus(None)
    assert rank_device(TrainConfig(out="x")) == (torch.device("cpu"), "gloo")


class _Stop(Exception):
    pass


def test_demo_with_fewer_gpus_than_workers_trains_on_the_cpu_and_says_so(
    gpus, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    configs: list[TrainConfig] = []

    def run_trainings(launched: list[TrainConfig], home: Path) -> None:
        configs.extend(launched)
        raise _Stop

    monkeypatch.setattr(gradsift.tools.train.demo, "run_trainings", run_trainings)
    gpus(1)
    with pytest.raises(_Stop):
        gradsift.tools.train.demo.run_demo(tmp_path, quick=True, emulate=False, progress=False)
    printed = capsys.readouterr().out
    assert [c.device for c in configs] == ["cpu"] * 5
    assert printed.count("1 GPU(s) for 2 workers") == 1 and "on the CPU (gloo)" in printed
    configs.clear()
    gpus(2)
    with pytest.raises(_Stop):
        gradsift.tools.train.demo.run_demo(tmp_path, quick=True, emulate=False, progress=False)
    assert [c.device for c in configs] == ["cuda"] * 5 and "on CUDA (NCCL)" in capsys.readouterr().out
