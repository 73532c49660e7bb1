"""One rank's training loop: data shard, model, DDP + gradsift hook, timing, evaluation.

Run by every worker process (started by :mod:`gradsift.tools.train.launcher` or by
torchrun). Rank and world size come from the standard environment variables
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``. Rank 0 writes ``steps.jsonl``, ``evals.jsonl`` and ``summary.json``
into the run directory and shows the progress bar.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from gradsift.core.collectives import blocking
from gradsift.tools.train.config import OWN_EXCHANGE, TrainConfig, build_optimizer, learning_rate
from gradsift.tools.train.data import batches, shard_indices
from gradsift.tools.train.datasets import is_language_model, load_for_model
from gradsift.tools.train.devices import backend_for, resolve_device
from gradsift.tools.train.exchange import install_diloco, install_exchange, install_own_exchange
from gradsift.tools.train.models import build_model, parameter_count
from gradsift.tools.train.records import JsonlRecords
from gradsift.tools.train.summary import summarize


def threads_per_worker(local_world_size: int, cpus: int | None = None) -> int:
    """CPU threads for one worker: the machine's cores split evenly, at least 1."""
    return max(1, (cpus or os.cpu_count() or 1) // max(1, local_world_size))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``(..., classes)`` logits against ``(...)`` targets: one
    prediction per image, or one per position of a text window."""
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction
    )


def evaluate(
    model: torch.nn.Module, test, device: torch.device, batch_size: int = 500
) -> tuple[float, float]:
    """Accuracy and mean loss per prediction over the whole evaluation split (images:
    test accuracy; text: next-byte accuracy and loss in nats per byte), each rank scoring
    ``test[rank::world]`` and one allreduce of ``(correct, loss_sum, count)``.

    The totals stay on ``device`` (the model's): NCCL reduces only CUDA tensors, and
    the device is read once, after the allreduce, instead of once per batch.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    indices = torch.arange(rank, len(test), world, device="cpu")  # the split lives on the host
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    model.eval()
    with torch.no_grad():
        for inputs, targets in batches(test, indices, batch_size):
            logits = model(inputs.to(device))
            targets = targets.to(device)
            totals[0] += (logits.argmax(dim=-1) == targets).sum()
            totals[1] += cross_entropy(logits, targets, reduction="sum")
            totals[2] += targets.numel()
    model.train()
    blocking("evaluation allreduce", None, lambda: dist.all_reduce(totals, async_op=True))
    correct, loss_sum, count = totals.tolist()
    return correct / count, loss_sum / count


class RunWriter:
    """Rank 0's output files: the step records go to ``steps.jsonl`` and are read back from
    there (:class:`~gradsift.tools.train.records.JsonlRecords`), so no rank's memory grows
    with the run's length; the evaluations (one per ``eval_every`` steps, all of them in the
    summary) stay in memory too. Other ranks keep nothing."""

    def __init__(self, out: Path, enabled: bool) -> None:
        self.out = out
        self.enabled = enabled
        self.steps: JsonlRecords | None = None
        self.evals: list[dict[str, Any]] = []
        self._evals_file: Any = None
        if enabled:
            out.mkdir(parents=True, exist_ok=True)
            self.steps = JsonlRecords(out / "steps.jsonl")
            self._evals_file = open(out / "evals.jsonl", "w")  # noqa: SIM115

    def step(self, record: dict[str, Any]) -> None:
        """Record one training step."""
        if self.steps is not None:
            self.steps.append(record)

    def eval(self, record: dict[str, Any]) -> None:
        """Record one evaluation."""
        if self._evals_file is not None:
            self.evals.append(record)
            self._evals_file.write(json.dumps(record) + "\n")
            self._evals_file.flush()

    def close(self, summary: dict[str, Any] | None) -> None:
        """Close the JSONL files and write ``summary.json`` (when there is one)."""
        if self.steps is not None:
            self.steps.close()
        if self._evals_file is not None:
            self._evals_file.close()
        if self.enabled and summary is not None:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def rank_device(config: TrainConfig) -> tuple[torch.device, str]:
    """This rank's device and backend (:func:`gradsift.tools.train.devices.resolve_device` for
    the machine's ``LOCAL_WORLD_SIZE`` ranks); on CUDA the rank's GPU is made current
    (``LOCAL_RANK``), so NCCL and every ``cuda`` tensor without an index use it."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    kind = resolve_device(config.device, local_world, count_name="LOCAL_WORLD_SIZE")
    if kind == "cpu":
        return torch.device("cpu"), backend_for(kind)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device, backend_for(kind)


def flush_subnormals(device: torch.device) -> None:
    """On CPU, treat subnormal floats (``0 < |x| < 1.18e-38`` in fp32) as zero in every op
    (``torch.set_flush_denormal``: x86's FTZ and DAZ): x86 cores take a slow path for them,
    and flushing them leaves the loss as it is (docs/decisions.md has the GPT's times). GPUs
    keep their modes."""
    if device.type == "cpu":
        torch.set_flush_denormal(True)


def run_worker(config: TrainConfig) -> dict[str, Any] | None:
    """Train on this rank's shard; returns the summary on rank 0 (None elsewhere)."""
    with process_group(config) as (device, backend):
        return run_in_group(config, device, backend)


@contextmanager
def process_group(config: TrainConfig) -> Iterator[tuple[torch.device, str]]:
    """This rank's process group on ``config``'s device, with its timeout; yields the device
    and the backend, and destroys the group on the way out. Several runs may share it
    (:func:`gradsift.tools.train.launcher.run_trainings`)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    torch.set_num_threads(threads_per_worker(local_world))
    device, backend = rank_device(config)
    flush_subnormals(device)
    # device_id binds the NCCL communicator to this rank's GPU (its barrier then needs no guess)
    dist.init_process_group(
        backend,
        timeout=timedelta(seconds=config.timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    try:
        yield device, backend
    finally:
        dist.destroy_process_group()


def run_in_group(config: TrainConfig, device: torch.device, backend: str) -> dict[str, Any] | None:
    """One run in an initialised process group; returns once every rank has finished it (the
    summary on rank 0, None elsewhere). The run seeds its own model and data order, so a run
    after another in the same group trains as it would in a process of its own."""
    result, _ = train_rank(config, device, backend)
    dist.barrier()  # leave together: an early teardown can abort a peer still closing its pairs
    return result


def _run_facts(config: TrainConfig, model: torch.nn.Module, world: int, backend: str, device: torch.device,
               source: str) -> dict[str, Any]:  # fmt: skip
    """The fixed facts of a run that head its summary."""
    return {
        "compressor": config.compressor, "options": config.options, "model": config.model,
        "parameters": parameter_count(model), "workers": world, "batch_size": config.batch_size,
        "bandwidth": config.bandwidth, "bandwidth_bps": config.bandwidth_bps, "latency": config.latency,
        "backend": backend, "device": str(device), "data": source, "seed": config.seed,
    }  # fmt: skip


def train_rank(
    config: TrainConfig, device: torch.device, backend: str
) -> tuple[dict[str, Any] | None, torch.nn.Module]:
    """This rank's whole run inside an initialised process group: returns the summary
    (rank 0; None elsewhere) and the trained model."""
    rank, world = dist.get_rank(), dist.get_world_size()
    train, test, source = load_for_model(
        config.model, config.data_dir, synthetic=config.synthetic, seed=config.seed
    )
    model = build_model(config.model, config.seed).to(device)
    optimizer = build_optimizer(config, model.parameters())
    forward: torch.nn.Module = model  # DiLoCo, DeMo, Lion: no DDP, each worker's gradients stay its own
    finish_round = None
    if config.sync_every:  # DiLoCo: an outer step every sync_every steps
        exchange_stats, recipe, finish_round = install_diloco(model, optimizer, config)
    elif config.optimizer in OWN_EXCHANGE:  # DeMo, Distributed Lion: the step is the exchange
        exchange_stats, recipe = install_own_exchange(optimizer)
    else:
        forward = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        exchange_stats, recipe = install_exchange(
            forward, config.compressor, config.options, optimizer, config.steps, recipe=config.recipe
        )
    writer = RunWriter(Path(config.out), enabled=rank == 0)
    progress = tqdm(
        total=config.steps,
        disable=rank != 0 or not config.progress,
        desc=config.optimizer if config.optimizer in OWN_EXCHANGE else config.compressor,
        unit="step",
    )
    step, epoch, train_time = 0, 0, 0.0
    started = time.perf_counter()
    summary = None
    try:
        while step < config.steps:
            shard = shard_indices(len(train), rank, world, epoch=epoch, seed=config.seed)
            for inputs, targets in batches(train, shard, config.batch_size):
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate(config, step)
                begin = time.perf_counter()
                loss = cross_entropy(forward(inputs.to(device)), targets.to(device))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if config.clip_grad_norm:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad_norm)
                optimizer.step()
                if finish_round is not None and step + 1 == config.steps:
                    finish_round()  # the run ends on shared parameters
                loss_value = float(loss.detach())  # syncs the device: the step is finished
                step_s = time.perf_counter() - begin
                train_time += step_s
                exchange = exchange_stats()
                phases = exchange["compress_s"] + exchange["communicate_s"] + exchange["decompress_s"]
                writer.step(
                    {"step": step, "loss": loss_value, "lr": learning_rate(config, step), "step_s": step_s,
                     "compute_s": max(0.0, step_s - phases), **exchange}
                )  # fmt: skip
                step += 1
                progress.update()
                progress.set_postfix(loss=f"{loss_value:.3f}", refresh=False)
                last = step == config.steps
                if last or (config.eval_every and step % config.eval_every == 0):
                    accuracy, test_loss = evaluate(model, test, device)
                    writer.eval(
                        {"step": step, "accuracy": accuracy, "loss": test_loss, "train_time_s": train_time,
                         "wall_time_s": time.perf_counter() - started}
                    )  # fmt: skip
                    progress.set_postfix(loss=f"{loss_value:.3f}", acc=f"{accuracy:.3f}", refresh=False)
                if last:
                    break
            epoch += 1
        progress.close()
        if rank == 0:
            run = _run_facts(config, model, world, backend, device, source)
            run["epochs_seen"] = round(step * config.batch_size * world / len(train), 4)
            run["recipe"] = recipe
            summary = summarize(
                writer.steps or (), writer.evals, run=run, target_accuracy=config.target_accuracy,
                target_loss=config.target_loss, wall_time_s=time.perf_counter() - started,
            )  # fmt: skip
            if is_language_model(config.model) and writer.evals:
                summary["final_perplexity"] = math.exp(writer.evals[-1]["loss"])
    finally:
        writer.close(summary)
    return summary, model
