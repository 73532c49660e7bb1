"""Random search of the frontends without DDP: DiLoCo's rounds and the optimizers that exchange.

The companion of ``scripts/random_search.py`` (whose case machinery it shares) for
``gradsift.diloco`` and for ``gradsift.DeMo`` / ``DistributedLion``. Each case draws from its
seed, as a user could write one:

* ``--frontend diloco``: a registry compressor or ``auto``, some of its options and of the hook's
  (a few that DiLoCo refuses by design too), the outer options (``outer_lr``, ``outer_momentum``,
  ``nesterov``, ``buffers``, ``unsent``), ``sync_every`` 1-4 and an inner SGD, SGD with
  momentum, Adam or AdamW;
* ``--frontend exchanging``: DeMo (``chunk``, ``topk``, ``beta``, ``value_dtype``,
  ``nonfinite``) or Distributed Lion (``aggregate``, ``betas``), weight decay, two parameter
  groups, a step LR schedule and ``zero_grad(set_to_none=...)``;

on a model with a frozen parameter, an unused layer, a parameter of no elements, BatchNorm, or
none of these, in float32, bfloat16 or float64, and in some cases an Inf or a NaN in one rank's
second batch. On two gloo ranks it checks: every rank builds and trains, or every rank refuses
with a ``GradsiftError`` before its first optimizer step (later, ``refused late``, a finding,
but for a poisoned case's non-finite gradient, as in ``random_search``); the ranks end with equal parameters (but under ``unsent="model"``,
where each worker keeps its own unsent part by design); the losses before the poisoned step are
finite; the state saved after step :data:`RESUME` and loaded into fresh objects repeats the
rest bit for bit (PowerSGD's first step after a load is dense by design, docs/quantizers.md).
Anything else is a finding. Results go to ``OUT-rRANK.jsonl``, one line per case.

    flock /tmp/gradsift-cpu.lock python scripts/search_low_comm.py --frontend diloco --seeds 0 400 --out diloco
    flock /tmp/gradsift-cpu.lock python scripts/search_low_comm.py --frontend exchanging --seeds 0 200 --out xopt

Exit status: 0 when nothing was found but PowerSGD's resumes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_search import (
    HOOK_VALUES,
    Net,
    attempt,
    draw_compressor,
    flat_parameters,
    load_each,
    report,
    same,
    search,
    trained_around_a_checkpoint,
)

STEPS, RESUME = 12, 5
FRONTENDS = ("diloco", "exchanging")
#: Hook options a DiLoCo case draws: the first often, the last four rarely (DiLoCo refuses them).
DILOCO_HOOK = ("value_dtype", "nonfinite", "error_feedback", "residual_decay", "exchange", "min_numel")
DILOCO_REFUSED = ("warmup_steps", "granularity", "momentum", "clip_norm")
MODELS = ("plain", "frozen", "unused", "empty", "batchnorm")


def draw(seed: int, names: list[str], frontend: str) -> dict[str, Any]:
    """The configuration of case ``seed`` on ``frontend`` (``names``: the registry's compressors)."""
    rng = random.Random(seed)
    config: dict[str, Any] = {"frontend": frontend}
    if frontend == "diloco":
        name, options = draw_compressor(rng, names)
        for key in (*DILOCO_HOOK, *DILOCO_REFUSED):
            if rng.random() < (0.25 if key in DILOCO_HOOK else 0.04):
                options[key] = rng.choice(HOOK_VALUES[key])
        outer: dict[str, Any] = {}
        for key, values in (("outer_lr", [0.5, 0.7, 1.0]), ("outer_momentum", [0.0, 0.9]),
                            ("nesterov", [True, False]), ("buffers", ["mean", "local"])):  # fmt: skip
            if rng.random() < 0.4:
                outer[key] = rng.choice(values)
        if rng.random() < 0.25:
            outer["unsent"] = "model"
            if rng.random() < 0.7:
                options["residual_decay"] = 1.0  # what unsent="model" needs
        config.update(compressor=name, options=options, outer=outer, sync_every=rng.choice([1, 2, 3, 4]),
                      optimizer=rng.choice(["sgd", "sgd-m", "adam", "adamw"]))  # fmt: skip
    else:
        which = rng.choice(["demo", "lion"])
        own: dict[str, Any] = {}
        drawn = (
            {"chunk": [1, 4, 8, 64], "topk": [1, 2, 16], "beta": [0.0, 0.9],
             "value_dtype": ["fp16", "bf16", "fp32"], "nonfinite": ["raise", "propagate"]}
            if which == "demo" else {"aggregate": ["vote", "average"], "betas": [(0.9, 0.99), (0.0, 0.5)]}
        )  # fmt: skip
        for key, values in drawn.items():
            if rng.random() < 0.4:
                own[key] = rng.choice(values)
        config.update(optimizer=which, options=own, weight_decay=rng.choice([0.0, 0.1]),
                      groups=rng.random() < 0.3, schedule=rng.random() < 0.3, set_to_none=rng.random() < 0.5)  # fmt: skip
    config.update(model=rng.choice(MODELS), dtype=rng.choice(["float32", "float32", "bfloat16", "float64"]),
                  poison=rng.choice([None, None, None, "inf", "nan"]))  # fmt: skip
    return config


class BatchNormNet(torch.nn.Module):
    """Linear, BatchNorm, ReLU, Linear: a buffer DiLoCo averages (or keeps, ``buffers="local"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.norm, self.last = (
            torch.nn.Linear(16, 32),
            torch.nn.BatchNorm1d(32),
            torch.nn.Linear(32, 4),
        )

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.norm(self.first(inputs))))


def build(config: dict[str, Any], seed: int) -> tuple[torch.nn.Module, Any, Any, Any]:
    """The model, the optimizer, the LR schedule (or None) and DiLoCo's state (or None)."""
    import gradsift
    from gradsift.frontends.distributed_lion import DistributedLion

    torch.manual_seed(seed)
    model = BatchNormNet() if config["model"] == "batchnorm" else Net(config["model"])
    model = model.to(getattr(torch, config["dtype"]))
    params = [p for p in model.parameters() if p.requires_grad]
    kind = config["optimizer"]
    if config["frontend"] == "diloco":
        inner = (
            torch.optim.SGD(params, lr=0.05, momentum=0.9 if kind == "sgd-m" else 0.0)
            if kind.startswith("sgd")
            else (torch.optim.Adam if kind == "adam" else torch.optim.AdamW)(params, lr=1e-3)
        )
        state = gradsift.diloco(model, inner, sync_every=config["sync_every"], compressor=config["compressor"],
                                **config["outer"], **config["options"])  # fmt: skip
        return model, inner, None, state
    groups: Any = [{"params": params[:2], "lr": 1e-2}, {"params": params[2:]}] if config["groups"] else params
    optimizer = (gradsift.DeMo if kind == "demo" else DistributedLion)(
        groups, lr=1e-3, weight_decay=config["weight_decay"], **config["options"]
    )
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5) if config["schedule"] else None
    return model, optimizer, schedule, None


def train(
    built: tuple[Any, ...],
    batches: list[torch.Tensor],
    config: dict[str, Any],
    losses: list[float] | None = None,
) -> list[float]:
    """One optimizer step per batch, each step's loss appended to ``losses`` (a new list when
    None), which it returns."""
    model, optimizer, schedule, _ = built
    losses = [] if losses is None else losses
    for inputs in batches:
        optimizer.zero_grad(set_to_none=config.get("set_to_none", True))
        loss = model(inputs).square().mean()
        loss.backward()
        optimizer.step()
        if schedule is not None:
            schedule.step()
        losses.append(loss.item())
    return losses


def saved_state(built: tuple[Any, ...]) -> dict[str, Any]:
    model, optimizer, schedule, state = built
    return copy.deepcopy({
        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "schedule": None if schedule is None else schedule.state_dict(),
        "diloco": None if state is None else state.state_dict(),
    })  # fmt: skip


def restored(config: dict[str, Any], seed: int, saved: dict[str, Any]) -> tuple[Any, ...]:
    built = build(config, seed)
    model, optimizer, schedule, state = built
    load_each([(model, saved["model"]), (optimizer, saved["optimizer"]),
               (schedule, saved["schedule"]), (state, saved["diloco"])])  # fmt: skip
    return built


def run_case(rank: int, world: int, seed: int, config: dict[str, Any]) -> dict[str, Any]:
    """The checks of the module docstring on one case; ``outcome`` names what happened."""
    generator = torch.Generator().manual_seed(1000 * rank + seed)
    batches = [
        torch.randn(8, 16, generator=generator).to(getattr(torch, config["dtype"])) for _ in range(STEPS)
    ]
    if config["poison"] is not None and rank == world - 1:
        batches[1] = batches[1] * float(config["poison"])
    built, verdict = attempt("registration", world, lambda: build(config, seed))
    if verdict is not None:
        return verdict

    result, verdict = trained_around_a_checkpoint(
        world,
        lambda stepped: train(built, batches[:RESUME], config, stepped),
        lambda: saved_state(built),
        lambda stepped: train(built, batches[RESUME:], config, stepped),
        config["poison"] is not None,
    )
    if verdict is not None:
        return verdict
    losses, saved = result
    parameters = flat_parameters(built[0])
    every = [torch.empty_like(parameters) for _ in range(world)]
    dist.all_gather(every, parameters)
    apart = config.get("outer", {}).get("unsent") == "model"  # each worker keeps what it did not send
    if not apart and not all(same(every[0], other) for other in every[1:]):
        return {"outcome": "finding", "detail": "the replicas differ"}
    if not all(torch.isfinite(torch.tensor(losses[: 1 if config["poison"] else STEPS]))):
        return {"outcome": "finding", "detail": f"a loss is not finite: {losses}"}
    if built[3] is not None:
        built[3].detach()  # DiLoCo stops counting this optimizer's steps
    try:
        again = restored(config, seed + 1, saved)
        train(again, batches[RESUME:], config)
    except Exception as error:  # a finding, whatever it is
        return {"outcome": "finding", "detail": f"the resume raised {type(error).__name__}: {error}"[:1200]}
    if again[3] is not None:
        again[3].detach()
    resumed = flat_parameters(again[0])
    if not same(parameters, resumed):
        return {"outcome": "resume differs", "detail": f"by {(parameters - resumed).abs().max().item():.3g}"}
    return {"outcome": "ok"}


def configs(seed: int, frontend: str) -> dict[str, Any]:
    """:func:`draw`'s configuration of ``seed`` on ``frontend``, drawn from the installed registry."""
    import gradsift

    return draw(seed, gradsift.available_compressors(), frontend)


def quiet_case(rank: int, world: int, seed: int, config: dict[str, Any]) -> dict[str, Any]:
    """:func:`run_case` with the frontends' warnings (a skipped step, each refusal's) silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_case(rank, world, seed, config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--frontend", choices=FRONTENDS, required=True, help="diloco, or exchanging (DeMo, Lion)"
    )
    parser.add_argument("--seeds", type=int, nargs=2, default=[0, 100], metavar=("FIRST", "STOP"),
                        help="cases FIRST <= seed < STOP (default: 0 100)")  # fmt: skip
    parser.add_argument("--out", default="low-comm-search", help="prefix of the per-rank JSONL files")
    args = parser.parse_args(argv)
    results = search(*args.seeds, 2, args.frontend, args.out, configure=configs, run=quiet_case)
    return report(results, lambda result: result["config"].get("compressor") == "powersgd")


if __name__ == "__main__":
    sys.exit(main())
