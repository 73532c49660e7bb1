"""An optimizer whose step is its exchange: what DeMo and Distributed Lion share.

Such an optimizer replaces the stock one on a model that DDP does not wrap: each worker's
gradients stay its own, and its ``step()`` sends what the method makes of them to every
other worker, one all-gather of a message whose layout is fixed at construction. What does
not depend on the method lives here:

- construction: ``lr`` and ``weight_decay`` checked; the trainable parameters with elements,
  on one device (every one takes part in every step, so every worker's message has one
  layout; a group cannot be added afterwards); the world of ``process_group`` (default: the
  world when ``torch.distributed`` is initialised, else this process alone);
- :meth:`ExchangingOptimizer.start`, called last by the method's constructor: the settings
  every rank must share compared (:func:`gradsift.core.agreement.check_agreement`), then
  every rank set to rank 0's parameters (one broadcast each, as DDP does when it wraps a
  model);
- :meth:`ExchangingOptimizer.gather`: every worker's message in rank order (a worker that
  dies makes the others raise :class:`~gradsift.core.errors.PeerFailureError` within the
  process group's timeout);
- :meth:`ExchangingOptimizer.step`: the closure, the release of the last step's collective
  handles, the method's :meth:`~ExchangingOptimizer.exchange` and the step's telemetry record
  (the message sent, ``(W-1)`` received); :meth:`~ExchangingOptimizer.stats` like the DDP
  hook's ``stats()``, and the checkpoint: ``state_dict()`` adds the step count and the byte
  totals under the method's key, with the settings a checkpoint must have been made with and
  the rank that saved it (each worker's momenta are its own: another rank's is refused).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from gradsift.core.agreement import check_agreement, setting_text, tensors_text
from gradsift.core.collectives import KEPT_WORKS, allgather, broadcast_from_first
from gradsift.core.errors import InvalidOptionError, InvalidTensorError
from gradsift.core.spelling import closest, did_you_mean
from gradsift.core.telemetry import BucketRecord, Telemetry
from gradsift.core.validation import check_real
from gradsift.core.worker_state import check_worker, worker_stamp

T = TypeVar("T")
#: How to save every rank's state, named when a rank loads another's.
EVERY_RANK = (
    "write each rank's optimizer.state_dict() to a file of its own (its momenta differ by rank, unlike "
    "a DDP optimizer's) and load each rank's own"
)


def parse_options(cls: type[T], options: dict[str, Any], method: str) -> T:
    """The dataclass ``cls`` built from keyword ``options``; an unknown name raises, listing
    ``method``'s options and the closest of them (:func:`gradsift.core.spelling.closest`)."""
    known = cls.__dataclass_fields__  # type: ignore[attr-defined]
    unknown = sorted(set(options) - set(known))
    if unknown:
        hints = [match for name in unknown if (match := closest(name, known))]
        raise InvalidOptionError(
            f"{method} has no option {', '.join(unknown)}{did_you_mean(hints)}; "
            f"its options are: {', '.join(known)}"
        )
    return cls(**options)


class ExchangingOptimizer(torch.optim.Optimizer):
    """The shared part of an optimizer whose step is its exchange (see the module docstring).

    A method names itself as the class is defined (``class DeMo(ExchangingOptimizer,
    method="DeMo", key="demo")``: its name in messages, its entry in the state dict), sets
    :attr:`message_bytes` and :attr:`elements_sent` and calls :meth:`start` at the end of its
    constructor, implements :meth:`exchange`, and extends :meth:`settings` and
    :meth:`checkpoint_settings` with its own.
    """

    method: str
    key: str

    def __init_subclass__(cls, *, method: str, key: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.method, cls.key = method, key

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], process_group: Any) -> None:
        check_real(defaults["lr"], "lr", low=0.0, low_open=True)
        check_real(defaults["weight_decay"], "weight_decay", low=0.0)
        super().__init__(params, defaults)
        if process_group is not None and not dist.is_initialized():
            raise InvalidOptionError("process_group needs an initialised torch.distributed")
        self.process_group = process_group
        self.world = dist.get_world_size(process_group) if dist.is_initialized() else 1
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad and p.numel()]
        if not params:
            raise InvalidOptionError(f"{self.method} needs at least one trainable parameter with elements")
        if len({p.device for p in params}) > 1:
            raise InvalidTensorError(
                f"{self.method}'s parameters must share one device (its exchange is one message)"
            )
        #: Every parameter that takes part, in the groups' order (the message's layout).
        self.params: list[torch.Tensor] = params
        self.numel = sum(p.numel() for p in params)
        #: The parameters in their own dtype: what an fp32 (or bf16, ...) allreduce would move.
        self.dense_bytes = sum(p.numel() * p.element_size() for p in params)
        #: The bytes of one worker's message, and the elements it carries per parameter
        #: (set by the method before :meth:`start`).
        self.message_bytes = 0
        self.elements_sent: list[int] = []
        self.steps = 0
        self.telemetry = Telemetry()

    def start(self) -> None:
        """Collective when there are other workers: they agree on :meth:`settings` and take
        rank 0's parameters, before anything moves."""
        if self.world > 1:
            check_agreement(self.settings(), self.process_group, self.method)
            broadcast_from_first(self.params, self.process_group)

    def settings(self) -> dict[str, str]:
        """What every rank must share (:mod:`gradsift.core.agreement`): every group's numbers
        (``lr``, ``weight_decay`` and the method's own) and the parameters' layout; a method
        adds its options."""
        groups = [
            {name: value for name, value in group.items() if name != "params"} for group in self.param_groups
        ]
        return {"groups": setting_text(groups), "parameters": setting_text(tensors_text(self.params))}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group while the optimizer is built; afterwards the layout of the message is fixed."""
        if hasattr(self, "params"):
            raise InvalidOptionError(
                f"{self.method}'s parameters are fixed at construction (every worker's message has one layout)"
            )
        for name in ("lr", "weight_decay"):
            if name in param_group:
                check_real(param_group[name], name, low=0.0, low_open=name == "lr")
        super().add_param_group(param_group)

    # -- the step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step: ``closure`` (if given) computes the loss with gradients first; the last
        step's all-gather is done, so its collective handles and buffers are released; then
        the method's :meth:`exchange`, counted as one message of :attr:`message_bytes` sent
        and ``(W-1)`` received (an all-gather's). Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        KEPT_WORKS.next_step()
        record = BucketRecord(dense_bytes=self.dense_bytes, elements=self.numel)
        skipped = self.exchange(record, self.params[0].device)
        record.add_bytes(sent=self.message_bytes, padded=self.message_bytes,
                         received=(self.world - 1) * self.message_bytes)  # fmt: skip
        for count in self.elements_sent:
            record.add_tensor(count, dense=False)
        self.telemetry.end_step(self.steps, [record], skipped=skipped, running=record.settle())
        self.steps += 1
        return loss

    def exchange(self, record: BucketRecord, device: torch.device) -> bool:
        """The method's step on every parameter, its phases timed in ``record``
        (``compress_ms``, ``communicate_ms``, ``decompress_ms``); whether it was skipped."""
        raise NotImplementedError

    def gather(self, message: torch.Tensor) -> list[torch.Tensor]:
        """Every worker's ``message`` (uint8, one layout on every worker), in rank order (one
        all-gather; none for one worker)."""
        if self.world == 1:
            return [message]
        out = torch.empty(self.world * message.numel(), dtype=torch.uint8, device=message.device)
        allgather(out, message, self.process_group, f"{self.method} all-gather").wait()
        return list(out.view(self.world, -1).unbind(0))

    # -- read-outs and checkpoints ------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """``{"step": {...}, "total": {...}}`` as the DDP hook's ``stats()``: bytes_sent,
        bytes_padded (= sent), bytes_received, dense_bytes (the parameters' allreduce message
        in their dtype), density (elements sent per element), skipped (the last step) and
        skipped_steps (the total), compress/communicate/decompress_ms."""
        return self.telemetry.summary()

    def checkpoint_settings(self) -> dict[str, Any]:
        """The settings a checkpoint must have been made with to be loaded (none here)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's (its per-parameter state, the groups), the step count, the byte totals and
        the rank that saved it (:mod:`gradsift.core.worker_state`: each worker's momenta are its own)."""
        state = super().state_dict()
        state[self.key] = {"steps": self.steps, **self.checkpoint_settings(),
                           "telemetry": self.telemetry.state_dict(),
                           "worker": worker_stamp(self.process_group)}  # fmt: skip
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, made by this rank with the same :meth:`checkpoint_settings`."""
        state_dict = dict(state_dict)
        own = state_dict.pop(self.key, None)
        if own is None:
            raise InvalidOptionError(f"not a {self.method} state dict: it has no {self.key!r} entry")
        check_worker(own.get("worker"), self.process_group, f"the {self.method} optimizer state", EVERY_RANK)
        fixed = self.checkpoint_settings()
        made = {name: own.get(name) for name in fixed}
        if made != fixed:
            raise InvalidOptionError(
                f"the checkpoint was made with {', '.join(f'{k}={v}' for k, v in made.items())}; "
                f"this optimizer has {', '.join(f'{k}={v}' for k, v in fixed.items())}"
            )
        super().load_state_dict(state_dict)
        self.steps = int(own["steps"])
        self.telemetry.load_state_dict(own["telemetry"])
