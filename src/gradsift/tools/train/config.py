"""Everything one training run needs, validated once and stored as ``config.json``.

The launcher writes the config; every worker process reads the same file, so the
ranks cannot disagree about a setting.
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from gradsift.compressors.registry import available_compressors, compressor_class, get_compressor
from gradsift.core.errors import InvalidOptionError, UnknownCompressorError
from gradsift.core.validation import check_bool, check_choice, check_int, check_real
from gradsift.frontends.decoupled_momentum import DeMo, DeMoOptions
from gradsift.frontends.diloco import OUTER_OPTIONS, check_round_compressor
from gradsift.frontends.distributed_lion import DistributedLion, LionOptions
from gradsift.hook.auto import AUTO
from gradsift.hook.choice import PASSED_ON
from gradsift.hook.options import HOOK_OPTIONS, check_keywords
from gradsift.hook.state import GradsiftHookState
from gradsift.tools.train.devices import DEVICES
from gradsift.tools.train.models import MODELS

#: Learning-rate schedules after the warm-up (see :func:`learning_rate`).
LR_SCHEDULES = ("step", "cosine")

#: The longest process-group timeout a run takes: a week (``timedelta`` and the stores
#: overflow far above it, and a vanished peer should end a run well within it).
MAX_TIMEOUT_S = 7 * 24 * 3600.0

#: Optimizers of the trainer: SGD with momentum, AdamW (decoupled weight decay), DeMo
#: (``gradsift.DeMo``) or Distributed Lion (``gradsift.DistributedLion``), each of the last
#: two with its own exchange, no DDP.
OPTIMIZERS = ("sgd", "adamw", "demo", "lion")
#: Per optimizer, the defaults of the settings left unset: (lr, weight decay). DeMo's sign
#: step moves every coordinate by ``lr``: a third of AdamW's here; no decay, as the paper's runs.
#: Lion's, as its paper advises: a tenth of AdamW's lr and ten times its decay (the decay per
#: step, ``lr * weight_decay``, stays AdamW's).
OPTIMIZER_DEFAULTS = {"sgd": (0.05, 0.0), "adamw": (3e-3, 0.1), "demo": (1e-3, 0.0), "lion": (3e-4, 1.0)}
#: The optimizers whose step is their exchange (no DDP, no compressor): their options' parser.
OWN_EXCHANGE = {"demo": DeMoOptions.parse, "lion": LionOptions.parse}


def default_optimizer(model: str) -> str:
    """The optimizer a model trains with when none is named: AdamW for the language model
    (as every transformer recipe), SGD for the image models."""
    return "adamw" if model == "gpt" else "sgd"


@dataclass
class TrainConfig:
    """One run. Learning rate at step ``s`` (0-based, see :func:`learning_rate`):
    ``lr * (s + 1) / warmup_steps`` while ``s < warmup_steps``, then with
    ``lr_schedule="step"`` ``lr * decay_factor ** (number of decay_steps <= s)``, with
    ``lr_schedule="cosine"`` ``lr * (1 + cos(pi * (s - w) / (steps - w))) / 2``
    (``w = warmup_steps``: from ``lr`` after the warm-up down to 0 after the last step).

    Attributes:
        model: a key of :data:`gradsift.tools.train.models.MODELS`.
        compressor: a registry name; ``options`` are its keyword options (and the
            DDP hook's, e.g. ``warmup_steps``), passed to ``register_comm_hook``.
        optimizer: ``sgd`` (momentum ``momentum``), ``adamw`` (``betas``), ``demo``
            (:class:`gradsift.DeMo`: no DDP, DeMo's step exchanges; ``options`` are its
            ``beta``, ``chunk``, ``topk``, ``value_dtype``, ``nonfinite``; ``compressor`` stays
            ``none``) or ``lion`` (:class:`gradsift.DistributedLion`, the same way; ``betas``
            are Lion's, ``options`` its ``aggregate``); None picks :func:`default_optimizer`.
            ``lr`` and ``weight_decay`` left None take the optimizer's defaults
            (:data:`OPTIMIZER_DEFAULTS`).
        clip_grad_norm: ``C > 0`` clips the gradients' total norm to ``C`` before every
            optimizer step (``torch.nn.utils.clip_grad_norm_``); 0 (default): no clipping.
        sync_every: 0 (default): DDP with gradsift's hook; ``H > 0``: no DDP, DiLoCo's outer
            step on the compressed pseudo-gradient every ``H`` steps (``gradsift.diloco``;
            its ``outer_lr``, ``outer_momentum``, ``nesterov``, ``buffers``, ``unsent`` go in ``options``).
        recipe: the recipe (default True, see :mod:`gradsift.tools.train.exchange`): for
            error-feedback compressors but ``powersgd`` the optimizer's first moment moves into the hook
            (SGD: DGC's momentum correction + factor masking; AdamW: the frozen-variance
            method of :mod:`gradsift.hook.adam` after a dense warm-up), and error-feedback
            sparsifiers warm their density up; False: the optimizer as built on top of
            plain error feedback.
        workers: number of ranks the launcher starts (torchrun: its WORLD_SIZE).
        batch_size: samples per worker per step.
        steps: optimizer steps in total.
        eval_every: evaluate test accuracy every this many steps (0: only at the end).
        target_accuracy: test accuracy in [0, 1] whose first crossing is
            ``time_to_accuracy_s``; None to skip.
        target_loss: evaluation loss whose first crossing (loss <= target) is
            ``time_to_loss_s``, the language model's target; None to skip.
        bandwidth_bps / latency_s: emulated link (None: plain localhost).
        data_dir: explicit dataset directory; synthetic: tiny generated data (tests).
        timeout_s: process-group timeout; a vanished peer ends the run after it.
        device: ``auto``, ``cpu`` or ``cuda`` (:mod:`gradsift.tools.train.devices`): ``cuda``
            gives every local rank its own GPU and NCCL, ``cpu`` gloo on the CPU,
            ``auto`` CUDA when the machine has it, else the CPU.
    """

    out: str
    model: str = "vgg"
    compressor: str = AUTO
    options: dict[str, Any] = field(default_factory=dict)
    workers: int = 2
    batch_size: int = 32
    lr: float | None = None
    optimizer: str | None = None
    momentum: float = 0.9
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    weight_decay: float | None = None
    clip_grad_norm: float = 0.0
    sync_every: int = 0
    recipe: bool = True
    lr_schedule: str = "step"
    warmup_steps: int = 0
    decay_steps: list[int] = field(default_factory=list)
    decay_factor: float = 0.1
    steps: int = 100
    eval_every: int = 0
    seed: int = 0
    target_accuracy: float | None = None
    target_loss: float | None = None
    bandwidth: str | None = None
    bandwidth_bps: int | None = None
    latency: str | None = None
    latency_s: float = 0.0
    data_dir: str | None = None
    synthetic: bool = False
    timeout_s: float = 300.0
    device: str = "auto"
    progress: bool = True

    def __post_init__(self) -> None:
        check_choice(self.model, "model", tuple(MODELS))
        check_choice(self.compressor, "compressor", (AUTO, *available_compressors()), UnknownCompressorError)
        check_int(self.workers, "workers", low=1, high=256)
        check_int(self.batch_size, "batch_size", low=1)
        check_int(self.steps, "steps", low=1)
        check_int(self.eval_every, "eval_every", low=0)
        check_int(self.warmup_steps, "lr_warmup_steps", low=0)  # the hook's warmup_steps is another
        check_choice(self.lr_schedule, "lr_schedule", LR_SCHEDULES)
        check_int(self.seed, "seed", low=0)
        check_int(self.sync_every, "sync_every", low=0)
        self.optimizer = check_choice(
            self.optimizer or default_optimizer(self.model), "optimizer", OPTIMIZERS
        )
        lr, decay = OPTIMIZER_DEFAULTS[self.optimizer]
        self.lr = check_real(lr if self.lr is None else self.lr, "lr", low=0.0, low_open=True)
        self.weight_decay = check_real(
            decay if self.weight_decay is None else self.weight_decay, "weight_decay", low=0.0
        )
        check_real(self.momentum, "momentum", low=0.0, high=1.0, high_open=True)
        check_real(self.clip_grad_norm, "clip_grad_norm", low=0.0)
        if len(self.betas) != 2:
            raise InvalidOptionError(f"betas must be two numbers, got {self.betas!r}")
        self.betas = [check_real(beta, "betas", low=0.0, high=1.0, high_open=True) for beta in self.betas]
        check_real(self.decay_factor, "decay_factor", low=0.0, high=1.0, low_open=True)
        check_real(self.timeout_s, "timeout_s", low=1.0, high=MAX_TIMEOUT_S)
        check_choice(self.device, "device", DEVICES)
        check_bool(self.recipe, "recipe")
        for step in self.decay_steps:
            check_int(step, "decay_steps", low=1)
        if self.decay_steps and self.lr_schedule != "step":
            raise InvalidOptionError(
                f"decay_steps are the step schedule's milestones; lr_schedule={self.lr_schedule!r} takes none "
                "(drop --decay-steps, or pass --lr-schedule step)"
            )
        if self.target_accuracy is not None:
            check_real(self.target_accuracy, "target_accuracy", low=0.0, high=1.0)
        if self.target_loss is not None:
            check_real(self.target_loss, "target_loss", low=0.0, low_open=True)
        if self.optimizer in OWN_EXCHANGE:
            check_own_exchange_options(self.optimizer, self.compressor, self.options, self.sync_every)
        else:
            adam = self.optimizer == "adamw" and self.recipe  # the hook takes AdamW over
            check_exchange_options(self.compressor, self.options, diloco=self.sync_every > 0, adam=adam)
        self._check_clipping()

    def _check_clipping(self) -> None:
        """``--clip-grad-norm`` clips after the exchange; under SGD's momentum correction (the
        recipe with a named error-feedback compressor) that scales the velocity the hook sends,
        which the hook refuses (:mod:`gradsift.hook.first_step`): refused here, before any worker
        starts, naming DGC's clipping of the gradient instead."""
        named = self.compressor not in (AUTO, "none") and self.sync_every == 0
        if not (self.clip_grad_norm and named and self.optimizer == "sgd" and self.momentum and self.recipe):
            return
        method = compressor_class(self.compressor)
        if method.momentum_correction and self.options.get("error_feedback", method.error_feedback):
            raise InvalidOptionError(
                f"--clip-grad-norm clips after the exchange, which under {self.compressor}'s momentum "
                "correction (the SGD recipe) scales the velocity the hook sends, not the gradient: pass "
                f"--option clip_norm={self.clip_grad_norm:g} (DGC's clipping of each gradient before the "
                "velocity) instead, or --no-recipe"
            )

    def save(self, path: Path) -> None:
        """Write the config as JSON."""
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> TrainConfig:
        """Read a config written by :meth:`save`."""
        return cls(**json.loads(Path(path).read_text()))

    def to_dict(self) -> dict[str, Any]:
        """The config as plain JSON types."""
        return asdict(self)


def check_exchange_options(
    compressor: str, options: dict[str, Any], diloco: bool = False, adam: bool = False
) -> None:
    """Build ``compressor`` and the DDP hook's state with ``options`` once, as every rank
    will, so that an unknown or inapplicable option fails here, before any worker starts;
    ``adam``: the hook will take an Adam-family optimizer over (the frozen-variance methods'
    options are checked too).

    ``options`` holds the compressor's options and the hook's (:data:`gradsift.hook.options.HOOK_OPTIONS`,
    except ``process_group``: the trainer passes its own group).
    """
    if "process_group" in options:
        raise InvalidOptionError(
            "option process_group cannot be set for a training run (it uses its own group)"
        )
    outer = OUTER_OPTIONS
    if not diloco and any(name in options for name in outer):
        raise InvalidOptionError(f"options {', '.join(outer)} are DiLoCo's: they need --sync-every")
    if compressor == AUTO:
        check_auto_options(options, diloco)
        return
    if diloco:
        check_round_compressor(compressor_class(compressor))
        for name in ("optimizer", "granularity", "warmup_steps", "scaler"):
            if name in options:
                raise InvalidOptionError(f"option {name} does not apply with --sync-every (DiLoCo)")
        options = {name: value for name, value in options.items() if name not in outer}
    hook_options = {name: value for name, value in options.items() if name in HOOK_OPTIONS}
    compressor_options = {name: value for name, value in options.items() if name not in HOOK_OPTIONS}
    parameters = inspect.signature(compressor_class(compressor)).parameters
    missing = [
        name
        for name, p in parameters.items()
        if p.default is p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and name not in options
    ]
    if missing:
        raise InvalidOptionError(
            f"compressor {compressor!r} needs option(s) {', '.join(missing)} (--option {missing[0]}=VALUE)"
        )
    check_keywords(compressor, options, ("process_group",))  # a misspelt name, and what it meant
    built = get_compressor(compressor, **compressor_options)
    hook_options.pop("optimizer", None)  # the trainer passes its own optimizer
    state = GradsiftHookState.build(built, **hook_options)
    if state.options.runs_frozen_variance(built, feedback=state.feedback is not None, adam=adam):
        state.options.with_frozen_variance_warmup()


def check_auto_options(options: dict[str, Any], diloco: bool) -> None:
    """``--compressor auto``: the DDP hook picks the method, taking only the hook options it
    passes on (:data:`gradsift.hook.choice.PASSED_ON`); with DiLoCo, DiLoCo's default compressor
    runs, with DiLoCo's outer options only."""
    allowed = OUTER_OPTIONS if diloco else PASSED_ON
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise InvalidOptionError(
            f"--compressor auto picks the method and its options; got {', '.join(unknown)}, where auto "
            f"takes {', '.join(allowed)} (a method's own options need --compressor NAME)"
        )
    if not diloco:  # their values, as auto's dense start checks them in every worker
        GradsiftHookState.build("none", **options)


def check_own_exchange_options(
    optimizer: str, compressor: str, options: dict[str, Any], sync_every: int
) -> None:
    """``--optimizer demo`` or ``lion``: the optimizer exchanges by itself, so no compressor,
    no DiLoCo, and only its own options (:data:`OWN_EXCHANGE`)."""
    if compressor not in ("none", AUTO):
        raise InvalidOptionError(
            f"--optimizer {optimizer} sends its own messages: --compressor must be none, got {compressor!r}"
        )
    if sync_every:
        raise InvalidOptionError(
            f"--optimizer {optimizer} exchanges every step: --sync-every (DiLoCo) does not apply"
        )
    OWN_EXCHANGE[optimizer](options)


def build_optimizer(config: TrainConfig, parameters: Any) -> torch.optim.Optimizer:
    """The run's optimizer over ``parameters`` (its lr is set every step by :func:`learning_rate`);
    DeMo and Distributed Lion need the process group initialised (they start every rank from
    rank 0's parameters)."""
    assert config.lr is not None and config.weight_decay is not None  # resolved in __post_init__
    if config.optimizer == "demo":
        return DeMo(parameters, lr=config.lr, weight_decay=config.weight_decay, **config.options)
    beta1, beta2 = config.betas
    if config.optimizer == "lion":
        return DistributedLion(
            parameters, lr=config.lr, betas=(beta1, beta2), weight_decay=config.weight_decay, **config.options
        )
    if config.optimizer == "adamw":
        return torch.optim.AdamW(
            parameters, lr=config.lr, betas=(beta1, beta2), weight_decay=config.weight_decay
        )
    return torch.optim.SGD(
        parameters, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )


def learning_rate(config: TrainConfig, step: int) -> float:
    """The learning rate of 0-based ``step``: linear warm-up, then step or cosine decay."""
    peak = config.lr
    assert peak is not None  # resolved in __post_init__
    if step < config.warmup_steps:
        return peak * (step + 1) / config.warmup_steps
    if config.lr_schedule == "cosine":
        progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    decays = sum(1 for milestone in config.decay_steps if milestone <= step)
    return peak * config.decay_factor**decays
