"""PyTorch Lightning: gradsift's hook, its telemetry and its checkpoint state (extra ``lightning``).

:class:`GradsiftCallback` holds one hook (:class:`~gradsift.integrations.hook_state.PendingHook`) and

1. offers a named method's state to Lightning's own mechanism, ``DDPStrategy(ddp_comm_state=cb.state,
   ddp_comm_hook=cb.hook)`` (Lightning then calls ``model.register_comm_hook(state, hook)``);
   ``compressor="auto"`` (the default, :mod:`gradsift.hook.auto`) builds its state from the
   DDP model, so it offers nothing (:meth:`GradsiftCallback.strategy_kwargs` is empty);
2. on ``on_fit_start`` -- after the model is wrapped in DDP, before the first backward --
   binds the state to the DDP model and, where Lightning did not register the hook
   (Lightning registers comm hooks only on CUDA; on CPU/gloo it skips them, a plain
   ``strategy="ddp"`` never passes one, and ``"auto"`` has none to pass), registers it itself;
3. logs ``state.stats()`` to every logger of the trainer each ``log_every_n_steps``
   (``gradsift/hook/ledger/bytes_sent``, ``gradsift/total/density``, ...);
4. checkpoints the hook state of *every rank* (``state_dict`` gathers them to rank 0, which
   writes the file, on the CPU) and gives each rank its own entry back on resume. Lightning
   restores callbacks before it moves the model to its device and wraps it in DDP, so the
   entry is kept until ``on_fit_start`` and then placed on the DDP model's device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gradsift.compressors.base import Compressor
from gradsift.core.errors import InvalidOptionError
from gradsift.core.extras import require
from gradsift.core.validation import check_bool
from gradsift.hook.auto import AUTO, AutoHookState
from gradsift.hook.handshake import check_hook_settings
from gradsift.hook.route import gradsift_hook
from gradsift.hook.state import GradsiftHookState
from gradsift.integrations.checkpoint import gather_hook_states, rank_entry, restore_hook_state
from gradsift.integrations.hook_state import PendingHook
from gradsift.integrations.telemetry import scalar_metrics

if TYPE_CHECKING:
    from pytorch_lightning import Callback
else:
    Callback = require("pytorch_lightning", "lightning", purpose="gradsift.integrations.lightning").Callback


class GradsiftCallback(Callback):
    """Compress DDP gradients under Lightning, log the hook's statistics, checkpoint its state.

    Args:
        compressor: ``"auto"`` (default; registered at ``on_fit_start``), a registry name
            (``"sidco-exp"``, ``"topk"``, ...) or a built :class:`~gradsift.compressors.base.Compressor`.
        take_optimizer: hand the hook the trainer's optimizer as ``optimizer=`` (default
            True): SGD's momentum and weight decay, Adam's first moment, move into the
            exchange (DGC's momentum correction, :mod:`gradsift.hook.recipe`); a module with
            several optimizers needs ``take_optimizer=False``.
        options: hook options (:data:`gradsift.hook.options.HOOK_OPTIONS`: ``granularity``,
            ``warmup_steps``, ...) and compressor options (``ratio``, ...), as for
            :func:`gradsift.register_comm_hook`.

    Attributes:
        state: the hook state (a named method's: pass it as ``DDPStrategy(ddp_comm_state=...)``;
            ``"auto"``'s exists from ``on_fit_start`` on).
        hook: the hook callable of a named method (pass it as ``DDPStrategy(ddp_comm_hook=...)``).
    """

    hook = staticmethod(gradsift_hook)

    def __init__(
        self, compressor: str | Compressor = AUTO, take_optimizer: bool = True, **options: Any
    ) -> None:
        self.take_optimizer = check_bool(take_optimizer, "take_optimizer")
        self._hook = PendingHook(compressor, options)
        self._ddp_model: Any = None
        self._restored: dict[str, Any] | None = None  # a checkpoint's entry until the model is placed

    @property
    def state(self) -> GradsiftHookState | AutoHookState:
        """The hook's state (:attr:`gradsift.integrations.hook_state.PendingHook.state`)."""
        return self._hook.state

    def strategy_kwargs(self) -> dict[str, Any]:
        """``{"ddp_comm_state": state, "ddp_comm_hook": hook}`` for ``DDPStrategy(**...)``; ``{}``
        under ``"auto"``, whose hook the callback registers at ``on_fit_start``."""
        if self._hook.named is None:
            return {}
        return {"ddp_comm_state": self._hook.named, "ddp_comm_hook": self.hook}

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        ddp_model = trainer.strategy.model
        if not hasattr(ddp_model, "register_comm_hook"):
            raise InvalidOptionError(
                "GradsiftCallback needs a DDP strategy (strategy='ddp' or DDPStrategy(...)) with at least "
                f"2 processes; the trainer's model is a {type(ddp_model).__name__}"
            )
        optimizer = self._optimizer(trainer)
        named = self._hook.named
        if named is not None and any(state is named for _, state in getattr(ddp_model, "_comm_hooks", ())):
            self._hook.check_optimizer(optimizer)
            named.attach(ddp_model, optimizer)  # Lightning registered it (CUDA): bind it only
            check_hook_settings(named, "GradsiftCallback")  # collective: ranks that disagree stop
        else:
            self._hook.register(ddp_model, optimizer)
        self._ddp_model = ddp_model
        if self._restored is not None:
            self._load(self._restored)

    def _optimizer(self, trainer: Any) -> Any:
        """The trainer's one optimizer when the hook takes it (``strategy.setup`` made it before ``on_fit_start``)."""
        if not self.take_optimizer:
            return False  # none, and the hook does not look for one
        optimizers = list(getattr(trainer, "optimizers", []))
        if len(optimizers) > 1:
            raise InvalidOptionError(
                f"GradsiftCallback hands the hook one optimizer, and the module has {len(optimizers)}: "
                "pass take_optimizer=False (then run the optimizers without momentum)"
            )
        return optimizers[0] if optimizers else None

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step % max(1, trainer.log_every_n_steps) == 0:
            metrics = scalar_metrics(self.state.stats())
            for logger in trainer.loggers:  # logger methods run on rank 0 only
                logger.log_metrics(metrics, step=trainer.global_step)

    def state_dict(self) -> dict[str, Any]:
        """Collective (Lightning calls it on every rank): every rank's hook state, on rank 0."""
        return gather_hook_states(self.state) or {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check ``state_dict`` and take this rank's entry; restore it now if the DDP model
        is known, else at ``on_fit_start`` (once Lightning has put the model on its device)."""
        self._restored = {"entry": rank_entry(state_dict), "settings": state_dict.get("settings")}
        if self._ddp_model is not None:
            self._load(self._restored)

    def _load(self, restored: dict[str, Any]) -> None:
        """Check and restore this rank's entry onto the DDP model's device."""
        device = next(self._ddp_model.parameters()).device
        restore_hook_state(
            self.state, restored["entry"], restored["settings"], device, "Lightning's checkpoint"
        )
        self._restored = None
