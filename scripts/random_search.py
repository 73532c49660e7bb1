"""Random search of the hook's configurations: ranks that agree, equal replicas, resume bit for bit.

Each case draws its configuration from its seed, as a user could write one: a registry
compressor (or ``auto``) with some of its options, some of the hook's options, an optimizer
(SGD, SGD with momentum, Adam, AdamW) passed as ``optimizer=`` or left to be found, a
``GradScaler`` passed, found or absent; DDP's bucket cap, ``static_graph`` and
``gradient_as_bucket_view``; a model with a frozen parameter, an unused layer
(``find_unused_parameters=True``), an expert layer that each sample routes to or around (so the
layers used differ by rank and step, as in a mixture of experts), a parameter of no elements,
or none of these, in float32, bfloat16 or float64 (not float16: PyTorch's ``GradScaler``
refuses its gradients, and Adam's ``eps`` rounds to zero in it), in a quarter of the cases with
a convolution stem in ``channels_last`` (a parameter DDP's bucket holds in its memory order,
not row-major), in a third with weight decay, and then (drawn in this order, after everything
else, so the other draws of a seed are what they were before them) one parameter group or two
(biases without weight decay at half the learning rate), ``zero_grad(set_to_none=False)`` in
three cases of ten, an LR schedule in three of ten (a step schedule, or in half of those
``OneCycleLR`` with or without its momentum cycled), the hook's checkpoint as each
rank's ``state.state_dict()``, as the documented helpers' file (``gather_hook_states`` on
every rank, rank 0's result through ``torch.save``, ``load_hook_state`` on every rank) or in a
``torch.distributed.checkpoint`` folder (``hook_state_dict``, ``load_hook_state_dict``), and in
three cases of ten one of the optimizer's flags (:data:`OPTIMIZER_FLAGS`: Nesterov momentum,
dampening, ``maximize``, ``amsgrad``, the per-tensor loop, the fused kernel), and in two of
ten a weight-decay schedule (every group's decay set once, before the third step), and in two
of five the layers under activation checkpointing (``torch.utils.checkpoint``, reentrant or
not; not reentrant where a layer is left out, with which stock DDP fails or hangs); one or
two micro-batches a step, accumulated under ``no_sync()`` or with a backward pass each (one with ``static_graph``,
which PyTorch 2.13's DDP fails with ``no_sync()`` on its own: docs/pitfalls.md); and in some
cases an Inf or a NaN in one rank's second batch. ``--frontend`` wraps the model in DDP (the
default), FSDP1 ``NO_SHARD`` or FSDP2 hybrid sharding (``fully_shard`` on a 1-rank shard mesh,
the hook on the replicate group), each as one unit or one per linear layer; FSDP draws its mixed
precision (bf16 parameters, reductions or both) and, for FSDP1, ``use_orig_params`` (with
neither ``granularity``, ``clip_norm`` nor ``optimizer=`` where FSDP refuses them), and sets
FSDP2's ``set_reduce_scatter_unused_params`` for the models with a layer some step leaves out
(drawn as one unit where ranks route apart, as FSDP's units' collectives pair by order, and on
FSDP2 with one micro-batch, as its native HSDP hangs accumulating a layer some ranks skipped).
On ``--world`` gloo ranks it checks:

* control: the same configuration without the hook (DDP's or FSDP1's own allreduce, FSDP2's
  native HSDP) trains; where it fails the case is ``stock fails``, not the hook's to pass;
* registration: every rank registers the hook, or every rank refuses it with a ``GradsiftError``;
* training, 8 steps: every rank trains, or every rank refuses with a ``GradsiftError`` before
  its first optimizer step has run (a refusal later is a finding, ``refused late``: what the
  hook cannot do it refuses before anything trained; but a non-finite gradient under
  ``nonfinite="raise"`` in a case that poisons one); the ranks end with equal parameters (NaN equal to NaN); the losses are finite, but for the
  poisoned step's and, when a NaN reached the parameters (``nonfinite="propagate"`` without a
  ``GradScaler``, as in stock DDP), the later ones;
* resume: the model, optimizer, scaler and hook states saved after step 4, a fresh model, DDP,
  optimizer, scaler and hook that load them repeat steps 5-8 bit for bit (PowerSGD's first
  step after a load is dense by design, ``auto`` checkpointed while it measures measures again
  and may choose otherwise (docs/auto.md), on three or more ranks an allreduce may differ
  in its last bits, as stock DDP's does: docs/distributed.md, and under
  ``zero_grad(set_to_none=False)`` on the model whose expert layer some steps leave out: the
  uninterrupted run holds a zero gradient for it, which a method that moves a parameter on a
  zero gradient (Adam, momentum, the hook's velocity) steps, where the resumed run's gradient is
  None and the optimizer skips it, as stock DDP with Adam does; they are reported all the same).

Anything else is a finding (a configuration that fails without the hook too is not). Each rank
writes one JSON line per case to ``OUT-rRANK.jsonl``; the search prints a count per outcome and
every finding. A rank that dies ends the ranks, and the search starts again past that case.

    flock /tmp/gradsift-cpu.lock python scripts/random_search.py --seeds 0 300 --world 2 --out search
    flock /tmp/gradsift-cpu.lock python scripts/random_search.py --frontend fsdp2 --seeds 0 300 --out fsdp2

Exit status: 0 when nothing was found but resumes of those two kinds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import gc
import io
import json
import os
import random
import shutil
import sys
import tempfile
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.utils.checkpoint

STEPS = 8
POISONED = 1  # the step whose batch holds an Inf or a NaN on the last rank, when a case poisons one
DECAY_SET_AT, DECAY_SET = 2, 0.005  # a weight-decay schedule's one change: before this step, to this value
#: Values drawn for a compressor's options, by option name (an option not listed keeps its default).
COMPRESSOR_VALUES: dict[str, list[Any]] = {
    "ratio": [0.001, 0.01, 0.3, 1.0], "threshold": [0.001, 0.1], "rank": [1, 2], "levels": [2, 16],
    "bits": [2, 4, 8], "first_ratio": [0.05, 0.5], "stages": [1, 2], "alpha": [0.5, 2.0], "seed": [0, 3],
    "start_iter": [2, 3], "block_size": [16, 256], "subset": [0.1, 0.5], "topk": [0.1, 0.5],
    "bucket_size": [16, 512], "use_error_feedback": [True, False], "warm_start": [True, False],
}  # fmt: skip
#: Values drawn for the hook's options.
HOOK_VALUES: dict[str, list[Any]] = {
    "granularity": ["bucket", "layer"], "min_numel": [0, 50, 10000], "warmup_steps": [None, 0, 2],
    "value_dtype": [None, "fp16", "bf16"], "nonfinite": ["propagate", "skip", "raise"],
    "error_feedback": [None, True, False], "momentum": [0.0, 0.9], "momentum_masking": [True, False],
    "clip_norm": [None, 1.0], "density_warmup_steps": [0, 3], "residual_decay": [None, 0.9],
    "exchange": ["auto", "allreduce", "allgather", "delegated", "balanced", "shared-mask", "two-stage"],
    "adam": ["frozen-variance", "onebit", "zero-one", "update"], "server_feedback": [False, True],
}  # fmt: skip
MODELS = ("plain", "frozen", "unused", "routed", "empty")
FRONTENDS = ("ddp", "fsdp1", "fsdp2")
#: Hook options that need the model's parameters, which FSDP flattens or shards.
FSDP_REFUSED = ("granularity", "clip_norm")
#: Flags an optimizer is built with in some cases, by family (one drawn; SGD's ``nesterov``
#: needs a momentum, so stock fails it without one, as PyTorch does).
OPTIMIZER_FLAGS: dict[str, list[dict[str, Any]]] = {
    "sgd": [{"nesterov": True}, {"dampening": 0.1}, {"maximize": True}, {"foreach": False}],
    "adam": [{"amsgrad": True}, {"maximize": True}, {"foreach": False}, {"fused": True}],
}
#: FSDP's mixed precision: what is cast to bfloat16 (None: nothing).
MIXED = (None, "params", "reductions", "both")


def draw(seed: int, names: list[str], frontend: str = "ddp") -> dict[str, Any]:
    """The configuration of case ``seed`` (``names``: the registry's compressors) on ``frontend``;
    a DDP case draws what it drew before FSDP was added, so earlier seeds repeat."""
    rng = random.Random(seed)
    name, options = draw_compressor(rng, names)
    for key, values in HOOK_VALUES.items():
        if rng.random() < 0.2:
            options[key] = rng.choice(values)
    model = rng.choice(MODELS)
    static_graph = model != "routed" and rng.random() < 0.3  # a static graph uses every layer
    config = {
        "compressor": name, "options": options, "optimizer": rng.choice(["sgd", "sgd-m", "adam", "adamw"]),
        "pass_optimizer": rng.random() < 0.5, "scaler": rng.choice([None, None, None, "found", "passed"]),
        "model": model, "micro_batches": 1 if static_graph else rng.choice([1, 1, 2]),
        "dtype": rng.choice(["float32", "float32", "float32", "bfloat16", "float64"]),
        "sync_each_backward": rng.random() < 0.3, "poison": rng.choice([None, None, None, "inf", "nan"]),
        "static_graph": static_graph, "bucket_view": rng.random() < 0.3, "bucket_cap_mb": rng.choice([0.002, 0.004, 25.0]),
        "frontend": frontend,
    }  # fmt: skip
    if frontend != "ddp":
        for ddp_only in ("static_graph", "bucket_view", "bucket_cap_mb"):
            config.pop(ddp_only)
        one_unit = model == "routed"  # FSDP pairs its units' collectives by order: not one some ranks skip
        if one_unit and frontend == "fsdp2":
            config["micro_batches"] = 1  # native HSDP hangs when it accumulates a layer some ranks skipped
        config.update(
            units="model" if one_unit else rng.choice(["model", "layers"]), mixed=rng.choice(MIXED),
            orig_params=frontend == "fsdp1" and (model == "frozen" or rng.random() < 0.4),  # FSDP1 needs it there
        )  # fmt: skip
        for per_parameter in FSDP_REFUSED:  # refused on FSDP by design (docs/integrations.md)
            config["options"].pop(per_parameter, None)
        if frontend == "fsdp2" or config["orig_params"]:
            config["pass_optimizer"] = False  # a DTensor or an original parameter: not what the hook sees
    config["layout"] = "channels_last" if rng.random() < 0.25 else "row-major"  # drawn last: see above
    config["weight_decay"] = rng.choice([0.0, 0.0, 0.01])  # drawn after the layout, for the same reason
    config.update(  # drawn after the weight decay, for the same reason
        groups=rng.choice(["one", "one", "two"]), set_to_none=rng.random() < 0.7,
        schedule=rng.random() < 0.3, checkpoint=rng.choice(["state_dict", "gathered"]),
    )  # fmt: skip
    family = "sgd" if config["optimizer"].startswith("sgd") else "adam"
    config["optimizer_flags"] = rng.choice(OPTIMIZER_FLAGS[family]) if rng.random() < 0.3 else {}
    config["decay_schedule"] = rng.random() < 0.2
    if config["checkpoint"] == "gathered" and rng.random() < 0.5:  # half of those through DCP instead
        config["checkpoint"] = "dcp"
    # half of the schedules one-cycle, cycling the momentum or not
    if config["schedule"] and rng.random() < 0.5:
        config["schedule"] = rng.choice(["one-cycle, cycling momentum", "one-cycle"])
    config["recompute"] = rng.choice([None, None, None, "reentrant", "non-reentrant"])
    if config["recompute"] == "reentrant" and model in ("unused", "routed"):
        config["recompute"] = "non-reentrant"  # PyTorch's DDP: reentrant recompute needs every layer used
    if frontend == "fsdp2":  # fully_shard refuses a non-contiguous parameter (torch 2.13)
        config["layout"] = "row-major"
    return config


def draw_compressor(rng: random.Random, names: list[str]) -> tuple[str, dict[str, Any]]:
    """A registry name of ``names`` or ``auto``, and some of its own options (``threshold`` always)."""
    from gradsift.compressors.registry import compressor_options

    name = rng.choice([*names, "auto"])
    options: dict[str, Any] = {}
    if name != "auto":
        for key in compressor_options(name):
            if key in COMPRESSOR_VALUES and (key == "threshold" or rng.random() < 0.5):
                options[key] = rng.choice(COMPRESSOR_VALUES[key])
    return name, options


class Net(torch.nn.Module):
    """Three linear layers; ``kind`` adds a frozen bias, an unused layer, an expert layer that a
    batch whose first value is positive passes through, or a parameter of no elements;
    ``layout="channels_last"`` a residual convolution stem before them, its weight in
    ``channels_last``; ``recompute`` (``"reentrant"``, ``"non-reentrant"``) runs the last two
    layers under ``torch.utils.checkpoint`` of that kind (activations recomputed in backward,
    as a transformer's blocks with gradient checkpointing, on the first layer's output, which
    requires a gradient as a block's input does)."""

    def __init__(self, kind: str, layout: str = "row-major", recompute: str | None = None) -> None:
        super().__init__()
        self.recompute = recompute
        self.stem = None
        if layout == "channels_last":
            stem = torch.nn.Conv2d(2, 2, (1, 3), padding=(0, 1))  # 16 features as 2 x 2 x 4
            self.stem = stem.to(memory_format=torch.channels_last)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(16, 32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 4),
        )
        self.unused = torch.nn.Linear(4, 4) if kind == "unused" else None
        self.expert = torch.nn.Linear(4, 4) if kind == "routed" else None
        self.empty = torch.nn.Parameter(torch.zeros(0)) if kind == "empty" else None
        if kind == "frozen":
            self.body[2].bias.requires_grad_(False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.stem is not None:
            image = inputs.reshape(-1, 2, 2, 4).contiguous(memory_format=torch.channels_last)
            inputs = inputs + self.stem(image).flatten(1)
        if self.recompute is None:
            out = self.body(inputs)
        else:
            reentrant, first, rest = self.recompute == "reentrant", self.body[:2], self.body[2:]
            out = torch.utils.checkpoint.checkpoint(rest, first(inputs), use_reentrant=reentrant)
        if self.expert is not None and inputs[0, 0] > 0:
            out = out + self.expert(out)
        return out if self.empty is None else out + self.empty.sum()


@functools.cache
def mesh() -> Any:
    """The ``(replicate, shard)`` mesh of FSDP2 cases: every rank a replica (made once: a collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))


def wrapped(model: Net, config: dict[str, Any], hooked: bool) -> torch.nn.Module:
    """``model`` in ``config``'s frontend; without the hook, FSDP2 is native HSDP on the 2-D mesh."""
    skips = config["model"] in ("unused", "routed")  # a layer some step leaves out
    if config["frontend"] == "ddp":
        return torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=config["bucket_cap_mb"], find_unused_parameters=skips,
            static_graph=config["static_graph"], gradient_as_bucket_view=config["bucket_view"],
        )  # fmt: skip
    half, full = torch.bfloat16, None
    mixed = {None: (full, full), "params": (half, full), "reductions": (full, half), "both": (half, half)}
    param_dtype, reduce_dtype = mixed[config["mixed"]]
    if config["frontend"] == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(
            model, sharding_strategy=ShardingStrategy.NO_SHARD, device_id=torch.device("cpu"),
            auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}) if config["units"] == "layers" else None,
            use_orig_params=config["orig_params"], mixed_precision=MixedPrecision(param_dtype, reduce_dtype),
        )  # fmt: skip
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype, reduce_dtype)
    shards = mesh()["shard"] if hooked else mesh()
    units = (
        [m for m in model.modules() if isinstance(m, torch.nn.Linear)] if config["units"] == "layers" else []
    )
    for module in [*units, model]:
        fully_shard(module, mesh=shards, mp_policy=policy)
    if skips:
        cast(Any, model).set_reduce_scatter_unused_params(True)  # FSDP2's find_unused_parameters
    return model


def build(config: dict[str, Any], seed: int, hooked: bool = True) -> tuple[Any, ...]:
    """The wrapped model, optimizer, scaler, hook state (None unless ``hooked``) and LR schedule
    (None unless ``config["schedule"]``) of ``config``, the weights from ``seed``."""
    import gradsift

    torch.manual_seed(seed)
    model = Net(config["model"], config["layout"], config.get("recompute")).to(
        getattr(torch, config["dtype"])
    )
    ddp = wrapped(model, config, hooked)
    kind, decay = config["optimizer"], config["weight_decay"]
    lr = 0.05 if kind.startswith("sgd") else 1e-3
    params: Any = list(ddp.parameters())
    if config.get("groups") == "two":  # the usual split: no weight decay and another lr for biases
        params = [{"params": [p for p in params if p.dim() > 1]},
                  {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0, "lr": lr / 2}]  # fmt: skip
    flags = config.get("optimizer_flags", {})
    optimizer = (
        torch.optim.SGD(params, lr=lr, momentum=0.9 if kind == "sgd-m" else 0.0, weight_decay=decay, **flags)
        if kind.startswith("sgd")
        else (torch.optim.Adam if kind == "adam" else torch.optim.AdamW)(
            params, lr=lr, weight_decay=decay, **flags
        )
    )
    schedule = scheduled(optimizer, config.get("schedule"), lr)
    scaler = None if config["scaler"] is None else torch.amp.GradScaler("cpu", init_scale=2.0**8)
    options = dict(config["options"])
    if config["pass_optimizer"]:
        options["optimizer"] = optimizer
    if config["scaler"] == "passed":
        options["scaler"] = scaler
    if config["frontend"] == "fsdp2":
        options["process_group"] = mesh().get_group("replicate")
    state = gradsift.register_comm_hook(ddp, config["compressor"], **options) if hooked else None
    return ddp, optimizer, scaler, state, schedule


def scheduled(optimizer: torch.optim.Optimizer, schedule: bool | str | None, lr: float) -> Any:
    """The LR schedule ``schedule`` names: a step schedule (True), ``OneCycleLR`` over the
    case's steps up to twice ``lr`` with or without its default ``cycle_momentum`` (which SGD's
    momentum and Adam's first beta follow), or none."""
    if not schedule:
        return None
    if schedule is True:
        return torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5)
    return torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=2 * lr, total_steps=STEPS + 1, cycle_momentum=schedule.endswith("cycling momentum")
    )


def train(
    built: tuple[Any, ...],
    batches: list[torch.Tensor],
    config: dict[str, Any],
    losses: list[float] | None = None,
    start: int = 0,
) -> list[float]:
    """One step per batch of :func:`build`'s ``built`` (the first is the case's step ``start``),
    its micro-batches but the last under ``no_sync()`` (or each synced, with
    ``sync_each_backward``), the schedule's step after each, and, with ``decay_schedule``, every
    group's weight decay set to :data:`DECAY_SET` before step :data:`DECAY_SET_AT`; each step's
    loss appended to ``losses`` (a new list when None), which it returns."""
    ddp, optimizer, scaler, _, schedule = built
    losses, micro_batches = [] if losses is None else losses, config["micro_batches"]
    for step, batch in enumerate(batches, start):
        if config.get("decay_schedule") and step == DECAY_SET_AT:
            for group in optimizer.param_groups:
                group["weight_decay"] = DECAY_SET
        optimizer.zero_grad(set_to_none=config.get("set_to_none", True))
        for index, inputs in enumerate(batch.chunk(micro_batches)):
            synced = index == micro_batches - 1 or config["sync_each_backward"]
            with contextlib.nullcontext() if synced else accumulating(ddp):
                loss = torch.nn.functional.mse_loss(ddp(inputs), inputs[:, :4]) / micro_batches
                (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        if schedule is not None:
            schedule.step()
        losses.append(loss.item())
    return losses


@contextlib.contextmanager
def accumulating(model: Any) -> Iterator[None]:
    """Backward passes that accumulate without an exchange: DDP's and FSDP1's ``no_sync()``,
    FSDP2's ``set_requires_gradient_sync(False)``."""
    if hasattr(model, "no_sync"):
        with model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    """This rank's parameters in one tensor (an FSDP2 DTensor's local shard: all of it here)."""
    return torch.cat([getattr(p, "to_local", p.detach)().detach().reshape(-1) for p in model.parameters()])


def expected_finite(losses: list[float], config: dict[str, Any]) -> list[float]:
    """The losses that must be finite: all but the poisoned step's, and none after it when its
    NaN reaches the parameters (``nonfinite="propagate"``, the default, without a scaler)."""
    if config["poison"] is None:
        return losses
    spread = config["scaler"] is None and config["options"].get("nonfinite", "propagate") == "propagate"
    return losses[:POISONED] if spread else losses[:POISONED] + losses[POISONED + 1 :]


def same(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Equal to the bit, a NaN equal to a NaN."""
    return torch.allclose(first, second, rtol=0, atol=0, equal_nan=True)


def agree(label: str, value: Any, world: int) -> str | None:
    """A finding when the ranks' ``value`` differ (a collective: every rank calls it)."""
    values: list[Any] = [None] * world
    dist.all_gather_object(values, value)
    return None if len(set(map(str, values))) == 1 else f"ranks disagree on {label}: {values}"


def attempt(stage: str, world: int, action: Callable[[], Any]) -> tuple[Any, dict[str, Any] | None]:
    """``(action(), None)`` when it ran on every rank; else ``(None, verdict)``: refused when every
    rank raised a ``GradsiftError``, a finding when one raised anything else or the ranks differ
    (a collective: every rank calls it)."""
    from gradsift.core.errors import GradsiftError

    result, how = None, "ran"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            result = action()
        except GradsiftError as refusal:
            how = f"refused at {stage}: {type(refusal).__name__}: {str(refusal)[:200]}"
        except Exception:
            how = f"{stage} raised " + traceback.format_exc()[-1200:]
    finding = agree(stage, how.split(":")[0], world)
    if finding is None and how == "ran":
        return result, None
    return None, {
        "outcome": "finding" if finding or " raised" in how else "refused",
        "detail": finding or how,
    }


def late(verdict: dict[str, Any], steps: int, poisoned: bool) -> dict[str, Any]:
    """``verdict`` of a training that stopped after ``steps`` optimizer steps, a refusal among them
    made a finding, ``refused late``, when it came after the first step: what the hook cannot do
    it refuses when registered or at the first step, where nothing has trained yet. A refusal of
    a non-finite gradient in a case that ``poisoned`` one (``nonfinite="raise"``) stays one."""
    if verdict["outcome"] != "refused" or steps == 0:
        return verdict
    if poisoned and verdict["detail"].split(":")[1].strip() == "NonFiniteGradientError":
        return verdict
    return {"outcome": "refused late", "detail": f"after {steps} steps, {verdict['detail']}"}


def trained_around_a_checkpoint(
    world: int,
    first: Callable[[list[float]], Any],
    save: Callable[[], Any],
    then: Callable[[list[float]], Any],
    poisoned: bool,
) -> tuple[tuple[list[float], Any] | None, dict[str, Any] | None]:
    """A case's training in one :func:`attempt` (a collective): ``first(stepped)``, ``save()``,
    ``then(stepped)``, each training call appending its steps' losses to ``stepped``;
    ``((losses, saved), None)``, or ``(None, verdict)`` with a refusal judged by :func:`late`."""
    stepped: list[float] = []

    def halves() -> tuple[list[float], Any]:
        first(stepped)
        saved = save()
        then(stepped)
        return stepped, saved

    result, verdict = attempt("training", world, halves)
    return (None, late(verdict, len(stepped), poisoned)) if verdict is not None else (result, None)


def dcp_folder(seed: int) -> Path:
    """The DCP folder of case ``seed``: one name on every rank (the launcher is their parent)."""
    return Path(tempfile.gettempdir(), f"gradsift-search-dcp-{os.getppid()}-{seed}")


def run_case(rank: int, world: int, seed: int, config: dict[str, Any]) -> dict[str, Any]:
    """:func:`checked_case`, then rank 0 removes the case's DCP folder, if it made one."""
    try:
        return checked_case(rank, world, seed, {**config, "seed": seed})
    finally:
        if rank == 0:
            shutil.rmtree(dcp_folder(seed), ignore_errors=True)


def checked_case(rank: int, world: int, seed: int, config: dict[str, Any]) -> dict[str, Any]:
    """The checks of the module docstring on one case; ``outcome`` names what happened."""
    generator = torch.Generator().manual_seed(1000 * rank + seed)
    dtype = getattr(torch, config["dtype"])
    batches = [torch.randn(8, 16, generator=generator).to(dtype) for _ in range(STEPS)]
    if config["poison"] is not None and rank == world - 1:
        batches[POISONED] = batches[POISONED] * float(config["poison"])
    half = STEPS // 2

    def stock() -> None:
        train(build(config, seed, hooked=False), batches, config)

    _, verdict = attempt("control", world, stock)
    gc.collect()  # its optimizer and scaler gone, for discovery to find the case's own
    if verdict is not None:
        return {"outcome": "stock fails", "detail": verdict["detail"]}
    built, verdict = attempt("registration", world, lambda: build(config, seed))
    if verdict is not None:
        return verdict
    trained, verdict = trained_around_a_checkpoint(
        world,
        lambda stepped: train(built, batches[:half], config, stepped),
        lambda: checkpoint(built, config, rank),
        lambda stepped: train(built, batches[half:], config, stepped, start=half),
        config["poison"] is not None,
    )
    if verdict is not None:
        return verdict
    losses, saved = trained
    flat = flat_parameters(built[0])
    every = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    if not all(torch.isfinite(torch.tensor(expected_finite(losses, config)))):
        return {"outcome": "finding", "detail": f"a loss is not finite: {losses}"}
    if not all(same(every[0], other) for other in every[1:]):
        return {"outcome": "finding", "detail": "the replicas differ"}
    del built, trained  # as in a new process: one optimizer, one scaler, one hook for discovery to find
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            built = restored(config, seed + 1, saved)
            train(built, batches[half:], config, start=half)
        except Exception:
            return {"outcome": "finding", "detail": "the resume raised " + traceback.format_exc()[-1200:]}
    resumed = flat_parameters(built[0])
    if not same(flat, resumed):
        gap = (flat - resumed).abs().max().item()
        return {"outcome": "resume differs", "detail": f"by {gap:.3g}"}
    return {"outcome": "ok"}


def checkpoint(built: tuple[Any, ...], config: dict[str, Any], rank: int) -> dict[str, Any]:
    """What a script saves of :func:`build`'s ``built``, copied: the hook's state as
    ``state.state_dict()`` (``config["checkpoint"] == "state_dict"``: each rank its own), as
    the documented helper's file (``"gathered"``: every rank's entry, gathered to rank 0 and
    written with ``torch.save``; the bytes every rank reads, sent from rank 0), or in a
    ``torch.distributed.checkpoint`` folder (``"dcp"``: each rank's ``hook_state_dict``, one
    ``dcp.save`` into :func:`dcp_folder`)."""
    from gradsift.integrations.checkpoint import gather_hook_states
    from gradsift.integrations.dcp import hook_state_dict

    ddp, optimizer, scaler, state, schedule = built
    saved = copy.deepcopy({
        "model": ddp.state_dict(), "optimizer": optimizer.state_dict(),
        "scaler": None if scaler is None else scaler.state_dict(),
        "schedule": None if schedule is None else schedule.state_dict(),
    })  # fmt: skip
    if config.get("checkpoint") == "dcp":
        saved["dcp"] = str(dcp_folder(config["seed"]))
        dcp.save(hook_state_dict(state, state.process_group), checkpoint_id=saved["dcp"],
                 process_group=state.process_group)  # fmt: skip
        return saved
    if config.get("checkpoint") != "gathered":
        saved["hook"] = copy.deepcopy(state.state_dict())
        return saved
    gathered = gather_hook_states(state, state.process_group)
    file: list[Any] = [None]
    if rank == 0:
        written = io.BytesIO()
        torch.save(gathered, written)
        file = [written.getvalue()]
    dist.broadcast_object_list(file, src=0)
    saved["file"] = file[0]
    return saved


def restored(config: dict[str, Any], seed: int, saved: dict[str, Any]) -> tuple[Any, ...]:
    """A fresh :func:`build` (weights from ``seed``) with :func:`checkpoint`'s ``saved`` loaded,
    the hook's state through ``load_hook_state`` when it was gathered, ``load_hook_state_dict``
    from a DCP folder."""
    from gradsift.integrations.checkpoint import load_hook_state
    from gradsift.integrations.dcp import load_hook_state_dict

    built = build(config, seed)
    ddp, optimizer, scaler, state, schedule = built
    load_each([(ddp, saved["model"]), (optimizer, saved["optimizer"]),
               (scaler, saved["scaler"]), (schedule, saved["schedule"])])  # fmt: skip
    if "file" in saved:
        read = torch.load(io.BytesIO(saved["file"]), map_location="cpu", weights_only=True)
        load_hook_state(state, read, state.process_group, device="cpu")
    elif "dcp" in saved:
        load_hook_state_dict(state, saved["dcp"], state.process_group, device="cpu")
    else:
        state.load_state_dict(saved["hook"])
    return built


def load_each(pairs: list[tuple[Any, Any]]) -> None:
    """``holder.load_state_dict(saved)`` for each ``(holder, saved)``, in order, but a None holder."""
    for holder, saved in pairs:
        if holder is not None:
            holder.load_state_dict(saved)


#: A search's two functions: a seed's configuration on a frontend, and one rank's run of a case.
Configure = Callable[[int, str], dict[str, Any]]
RunCase = Callable[[int, int, int, dict[str, Any]], dict[str, Any]]


def worker(
    rank: int,
    world: int,
    seeds: list[int],
    frontend: str,
    out: str,
    port: int,
    configure: Configure,
    run: RunCase,
) -> None:
    """One rank: the cases ``seeds`` in turn (``configure``'d, ``run``), each appended to ``OUT-rRANK.jsonl``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    with open(f"{out}-r{rank}.jsonl", "a") as log:
        for seed in seeds:
            config = configure(seed, frontend)
            result = {"seed": seed, **run(rank, world, seed, config), "config": config}
            log.write(json.dumps(result, default=str) + "\n")
            log.flush()
    dist.destroy_process_group()


def written(out: str, rank: int) -> set[int]:
    """The seeds ``rank`` has written to its file."""
    path = Path(f"{out}-r{rank}.jsonl")
    return {json.loads(line)["seed"] for line in path.read_text().splitlines()} if path.exists() else set()


def configs(seed: int, frontend: str) -> dict[str, Any]:
    """:func:`draw`'s configuration of ``seed`` on ``frontend``, drawn from the installed registry."""
    import gradsift

    return draw(seed, gradsift.available_compressors(), frontend)


def search(
    first: int,
    stop: int,
    world: int,
    frontend: str,
    out: str,
    configure: Configure = configs,
    run: RunCase = run_case,
) -> list[dict[str, Any]]:
    """Run the cases ``first <= seed < stop`` not yet in ``OUT-r0.jsonl``; rank 0's result of
    each (a case that killed a rank is written for every rank, after the cases it stopped)."""
    from gradsift.tools.train.launcher import free_port

    while todo := [seed for seed in range(first, stop) if seed not in written(out, 0)]:
        try:
            arguments = (world, todo, frontend, out, free_port(), configure, run)
            mp.start_processes(worker, args=arguments, nprocs=world, start_method="spawn")
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as failure:  # a rank died in a case
            finished = set.intersection(*(written(out, rank) for rank in range(world)))
            seed = min(set(todo) - finished)
            died = {
                "seed": seed,
                "outcome": "finding",
                "detail": f"a rank died: {failure}",
                "config": configure(seed, frontend),
            }
            for rank in range(world):
                with open(f"{out}-r{rank}.jsonl", "a") as log:
                    log.write(json.dumps(died) + "\n")
    results: dict[int, dict[str, Any]] = {}
    for line in Path(f"{out}-r0.jsonl").read_text().splitlines():
        result = json.loads(line)
        results.setdefault(result["seed"], result)
    return [results[seed] for seed in range(first, stop)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs=2, default=[0, 100], metavar=("FIRST", "STOP"),
                        help="cases FIRST <= seed < STOP (default: 0 100)")  # fmt: skip
    parser.add_argument("--world", type=int, default=2, help="gloo ranks (default: 2)")
    parser.add_argument(
        "--frontend", choices=FRONTENDS, default="ddp", help="the model's wrapper (default: ddp)"
    )
    parser.add_argument("--out", default="random-search", help="prefix of the per-rank JSONL files")
    args = parser.parse_args(argv)
    first, stop = args.seeds
    results = search(first, stop, args.world, args.frontend, args.out)
    return report(results, lambda result: _expected_resume(result, args.world))


def report(results: list[dict[str, Any]], expected_resume: Callable[[dict[str, Any]], bool]) -> int:
    """Print a count per outcome and every finding; the exit status: 0 when every finding is a
    resume that differs as ``expected_resume`` allows, else 1."""
    print(dict(Counter(r["outcome"] for r in results)))
    found = [r for r in results if r["outcome"] not in ("ok", "refused", "stock fails")]
    for result in found:
        print(result["seed"], result["outcome"], result.get("config"), result["detail"][-400:])
    expected = [r for r in found if r["outcome"] == "resume differs" and expected_resume(r)]
    return 0 if len(found) == len(expected) else 1


def _expected_resume(result: dict[str, Any], world: int) -> bool:
    """A resume that may differ by the rules of the module docstring: PowerSGD, ``auto`` (its
    choice comes from timings), three ranks or more, or a zero gradient kept for a layer a step
    leaves out."""
    config = result.get("config", {})
    kept_zero = config.get("set_to_none") is False and config.get("model") == "routed"
    return config.get("compressor") in ("powersgd", "auto") or world >= 3 or kept_zero


if __name__ == "__main__":
    sys.exit(main())
