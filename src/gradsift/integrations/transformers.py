"""Hugging Face ``Trainer``: gradsift's hook on the Trainer's DDP model, saved in its checkpoints.

Extra ``transformers`` (transformers >= 5). Where the Trainer lets a hook in (read from
its source, transformers 5.24):

1. ``Trainer.train()`` wraps the model in ``DistributedDataParallel`` itself (through
   Accelerate's ``prepare``) and keeps the wrapper as ``trainer.model_wrapped``; callback
   events receive only the unwrapped model, so :class:`GradsiftTrainerCallback` holds the
   trainer. (Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` accepts only
   PyTorch's built-in hooks, named by an enum, not a custom one.)
2. ``on_train_begin`` fires after that wrapping -- and, in a resumed run, after model,
   optimizer and scheduler were loaded -- and before the first forward pass: the callback
   registers the hook there and, when resuming, restores this rank's hook state.
3. ``on_save`` fires on every rank right after the Trainer wrote
   ``OUTPUT_DIR/checkpoint-STEP``. The Trainer keeps per-rank state there already
   (``rng_state_RANK.pth``); the callback writes each rank's hook state beside it, as
   ``gradsift_hook_state_RANK.pt`` (:data:`HOOK_STATE_FILE`): residuals, compressor
   state, RNG stream, step and telemetry totals. Each rank writes its own file, so no
   collective runs and every node keeps the files of its own ranks. A resumed run reads
   it as plain data (``torch.load(weights_only=True)``, :mod:`gradsift.core.plain`), as the
   Trainer reads its own files there: nothing in the file is run.
4. A resumed run starts with ``state.global_step`` read from the checkpoint. The folder is
   the callback's ``resume_from``, else ``TrainingArguments.resume_from_checkpoint``, else
   ``OUTPUT_DIR/checkpoint-STEP`` (where ``train(resume_from_checkpoint=True)`` resumes).
   A resumed run without its hook state is an error: restarting error feedback from zero
   residuals would not continue the run that was saved.
5. The Trainer's optimizer exists at ``on_train_begin`` (Accelerate's wrapper around it:
   the callback hands the hook the ``torch.optim`` optimizer inside). With
   ``take_optimizer=True`` (the default) it moves into the hook as ``optimizer=`` does for
   a compressor with error feedback: the Trainer's default AdamW gets the frozen-variance
   method of :mod:`gradsift.hook.adam`, with a dense warm-up of a tenth of ``max_steps`` unless
   ``warmup_steps`` is given; SGD gets DGC's momentum correction. The Trainer's own
   gradient clipping (``max_grad_norm``, 1 by default) then clips Adam's first moment; under
   SGD's momentum correction it would clip the velocity the hook sends, which a named method
   refuses where it binds (:mod:`gradsift.hook.first_step`: set ``max_grad_norm=0`` and pass the
   callback ``clip_norm=``) and ``auto`` leaves for stock DDP.
6. ``compressor="auto"`` (the default, :mod:`gradsift.hook.auto`) builds its state from the
   DDP model, so the callback registers it at ``on_train_begin``, where its options are
   checked; it is told the run's length (``steps=max_steps``, unless given), which decides
   whether the 1-bit Adam method is among its candidates, and keeps its own warm-up rule.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradsift.compressors.base import Compressor
from gradsift.core.errors import InvalidOptionError
from gradsift.core.extras import require
from gradsift.core.plain import read_plain
from gradsift.core.validation import check_bool
from gradsift.hook.adam import default_warmup_steps, is_adam
from gradsift.hook.auto import AUTO, AutoHookState
from gradsift.hook.handshake import hook_settings
from gradsift.hook.state import GradsiftHookState
from gradsift.integrations.checkpoint import check_same_world_size, restore_hook_state, to_cpu
from gradsift.integrations.hook_state import PendingHook

if TYPE_CHECKING:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
else:
    TrainerCallback = require(
        "transformers", "transformers", purpose="gradsift.integrations.transformers"
    ).TrainerCallback
    PREFIX_CHECKPOINT_DIR = require("transformers.trainer_utils", "transformers").PREFIX_CHECKPOINT_DIR

#: Name of each rank's hook state inside a Trainer checkpoint folder.
HOOK_STATE_FILE = "gradsift_hook_state_{rank}.pt"


class GradsiftTrainerCallback(TrainerCallback):
    """Install gradsift's hook on a ``Trainer``'s DDP model and checkpoint its state with the Trainer's.

    Usage::

        trainer = Trainer(model=model, args=training_args, train_dataset=train)
        trainer.add_callback(GradsiftTrainerCallback(trainer))  # "auto"; or e.g. "topk", ratio=0.01
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    Args:
        trainer: the ``transformers.Trainer`` this callback is added to.
        compressor: ``"auto"`` (default; module docstring, 6.), a registry name (``"sidco-exp"``,
            ``"topk"``, ...) or a built :class:`~gradsift.compressors.base.Compressor`.
        resume_from: the checkpoint folder a resumed run continues from, when it is
            neither ``TrainingArguments.resume_from_checkpoint`` nor
            ``OUTPUT_DIR/checkpoint-STEP``.
        take_optimizer: hand the hook the Trainer's optimizer (module docstring, 5.);
            False: plain error feedback under the optimizer as built.
        options: hook options (``granularity``, ``warmup_steps``, ...) and compressor
            options (``ratio``, ...), as for :func:`gradsift.register_comm_hook`.

    Attributes:
        state: the :class:`~gradsift.hook.state.GradsiftHookState` (``state.stats()`` for bytes,
            density and timings); under ``"auto"`` the
            :class:`~gradsift.hook.auto.AutoHookState`, from ``on_train_begin`` on.
    """

    def __init__(
        self,
        trainer: Any,
        compressor: str | Compressor = AUTO,
        *,
        resume_from: str | os.PathLike[str] | None = None,
        take_optimizer: bool = True,
        **options: Any,
    ) -> None:
        check_bool(take_optimizer, "take_optimizer")
        self.trainer = trainer
        self._hook = PendingHook(compressor, options)
        self.resume_from = resume_from
        self.take_optimizer = take_optimizer
        self.warmup_given = "warmup_steps" in options
        self._ddp_model: DistributedDataParallel | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        wrapped = self.trainer.model_wrapped
        ddp_model = getattr(wrapped, "_orig_mod", wrapped)  # torch_compile=True: the DDP model compiled
        if not isinstance(ddp_model, DistributedDataParallel):
            raise InvalidOptionError(
                "GradsiftTrainerCallback needs the Trainer to train with DistributedDataParallel, i.e. on "
                "2 or more processes (torchrun --nproc-per-node 2 SCRIPT); trainer.model_wrapped is a "
                f"{type(ddp_model).__name__}"
            )
        if ddp_model is not self._ddp_model:  # a second train() reuses the wrapper and its hook
            optimizer = self.trainers_optimizer(state) if self.take_optimizer else False  # none, not found
            self._hook.register(ddp_model, optimizer, steps=state.max_steps)
            self._ddp_model = ddp_model
        if state.global_step > 0:
            self.load(self.resume_folder(args, state.global_step), state.global_step)

    def trainers_optimizer(self, state: Any) -> torch.optim.Optimizer | None:
        """The ``torch.optim`` optimizer the Trainer steps (inside Accelerate's wrapper; None
        before the Trainer made one); under a named method an Adam without an explicit
        ``warmup_steps`` gets a tenth of the TrainerState's ``max_steps`` dense."""
        wrapped = getattr(self.trainer, "optimizer", None)
        optimizer: torch.optim.Optimizer | None = getattr(wrapped, "optimizer", wrapped)
        named = self._hook.named
        if is_adam(optimizer) and not self.warmup_given and named is not None:
            warmup = default_warmup_steps(state.max_steps)
            named.options = dataclasses.replace(named.options, warmup_steps=warmup)
        return optimizer

    @property
    def state(self) -> GradsiftHookState | AutoHookState:
        """The hook's state (:attr:`gradsift.integrations.hook_state.PendingHook.state`)."""
        return self._hook.state

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        self.save(folder, state.global_step)

    def resume_folder(self, args: Any, global_step: int) -> Path:
        """The checkpoint folder a run resumed at ``global_step`` continues from (see the module doc)."""
        if self.resume_from is not None:
            return Path(self.resume_from)
        if isinstance(args.resume_from_checkpoint, str) and args.resume_from_checkpoint:
            return Path(args.resume_from_checkpoint)
        return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{global_step}"

    def save(self, folder: str | os.PathLike[str], global_step: int) -> Path:
        """Write this rank's hook state into the checkpoint ``folder``; return the file."""
        path = Path(folder) / HOOK_STATE_FILE.format(rank=dist.get_rank())
        path.parent.mkdir(parents=True, exist_ok=True)
        saved = {
            "world_size": dist.get_world_size(),
            "global_step": global_step,
            "hook": self.state.state_dict(),
            "settings": hook_settings(cast(GradsiftHookState, self.state)),  # auto's reads as its method's
        }
        torch.save(to_cpu(saved), path)
        return path

    def load(self, folder: str | os.PathLike[str], global_step: int) -> None:
        """Restore this rank's hook state from the checkpoint ``folder`` of a run resumed at ``global_step``."""
        path = Path(folder) / HOOK_STATE_FILE.format(rank=dist.get_rank())
        if not path.is_file():
            raise InvalidOptionError(
                f"the Trainer resumed at step {global_step} but {path} does not exist, so the hook's "
                "error-feedback state cannot be restored; pass the checkpoint folder as "
                "GradsiftTrainerCallback(..., resume_from=FOLDER) or TrainingArguments(resume_from_checkpoint=FOLDER)"
            )
        saved = read_plain(path, str(path))
        if not isinstance(saved, dict) or not {"world_size", "global_step", "hook"} <= set(saved):
            raise InvalidOptionError(
                f"{path} is not a gradsift hook state file (a dict with keys world_size, global_step, hook)"
            )
        check_same_world_size(saved["world_size"])
        if saved["global_step"] != global_step:
            raise InvalidOptionError(
                f"{path} holds the hook state of step {saved['global_step']}, but the Trainer resumed at "
                f"step {global_step}: pass the folder of the checkpoint the Trainer resumed from"
            )
        device = next(self.trainer.model_wrapped.parameters()).device
        restore_hook_state(self.state, saved["hook"], saved.get("settings"), device, str(path))
