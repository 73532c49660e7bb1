"""What the hook keeps between calls: :class:`GradsiftHookState`, its collaborators as plain data.

One state per hooked model: the compressor and the exchange its buckets travel by, the
validated :class:`~gradsift.hook.options.HookOptions`, the one keyed store of per-tensor
state (:mod:`gradsift.core.store`), error feedback, the parameter layout, the step ledger
(the per-step transaction), the capacities of adaptive payloads, the optimizer takeover
(:mod:`gradsift.hook.recipe`, :mod:`gradsift.hook.adam`), and the telemetry. The route
of a bucket through them is :mod:`gradsift.hook.route`; checkpoints are
:meth:`GradsiftHookState.state_dict` / :meth:`~GradsiftHookState.load_state_dict`.
"""

import dataclasses
import weakref
from typing import Any

import torch
import torch.distributed as dist

from gradsift.compressors.base import Compressor, Sparsifier
from gradsift.core.errors import InvalidOptionError
from gradsift.core.parts import Context, Part
from gradsift.core.readout import Readout
from gradsift.core.store import TensorStore
from gradsift.core.telemetry import BucketRecord, Telemetry
from gradsift.core.worker_state import worker_stamp
from gradsift.exchanges.allreduce import Allreduce
from gradsift.exchanges.base import Codec, Exchange
from gradsift.exchanges.choice import resolve_exchange
from gradsift.hook import discovery, recipe, variance_refresh
from gradsift.hook.adam import AdamStep, is_adam
from gradsift.hook.before_step import BEFORE_STEP, settles_before_forward
from gradsift.hook.capacity import CapacityPlan
from gradsift.hook.compatibility import PYTHON_REDUCER, refuse_incompatible
from gradsift.hook.feedback import ErrorFeedback
from gradsift.hook.first_step import FirstOptimizerStep
from gradsift.hook.layout import ParameterLayout
from gradsift.hook.ledger import StepLedger
from gradsift.hook.options import HookOptions, check_keywords, resolve_compressor
from gradsift.hook.resumable import check_resumable
from gradsift.hook.taken_over import TakenOverChecks
from gradsift.hook.warmup_code import CodedWarmup, refuse_without_frozen_adam

#: Stock DDP's exchange: the in-place ``allreduce(g / W)`` of a stock step and of small parts.
STOCK_ALLREDUCE = Allreduce()


@dataclasses.dataclass
class GradsiftHookState:
    """Everything the hook keeps between calls, as plain data, grouped by role: **what was
    asked** (``compressor``, validated ``options``, ``process_group``); **how a bucket travels**,
    built from those (``exchange``, ``codec``: the compressor as the exchange sees it, Adam's
    warm-up code ``coded_warmup``, adaptive payloads' ``capacities``, a sparsifier's
    ``target_ratio``); **what persists across steps**, checkpointed (the keyed ``store`` of
    per-tensor state, error ``feedback``, the parameters' ``layout``, the ``ledger``: step count
    and per-step transaction, the ``telemetry`` of ``stats()``); **the optimizer taken over**
    (:meth:`adopt`, :meth:`discover`: the ``weight_decay`` moved into the exchange, the ``adam``
    takeover, the ``first_step`` and ``taken_over`` checks, the ``hooked`` parameters, the
    ``optimizer``, and whether the next first bucket still looks for one or a scaler).
    """

    # what was asked
    compressor: Compressor
    options: HookOptions = dataclasses.field(default_factory=HookOptions)
    process_group: Any = None
    # how a bucket travels
    exchange: Exchange = dataclasses.field(init=False)
    codec: Codec = dataclasses.field(init=False)
    coded_warmup: CodedWarmup | None = dataclasses.field(init=False)
    capacities: CapacityPlan = dataclasses.field(init=False)
    target_ratio: float | None = dataclasses.field(init=False)
    # what persists across steps
    store: TensorStore = dataclasses.field(default_factory=TensorStore)
    feedback: ErrorFeedback | None = None
    layout: ParameterLayout = dataclasses.field(default_factory=ParameterLayout)
    ledger: StepLedger = dataclasses.field(default_factory=StepLedger)
    telemetry: Telemetry = dataclasses.field(init=False)
    # the optimizer taken over
    weight_decay: dict[int, float] = dataclasses.field(default_factory=dict)
    adam: AdamStep | None = None
    first_step: FirstOptimizerStep | None = None
    taken_over: TakenOverChecks | None = None
    hooked: list[torch.nn.Parameter] = dataclasses.field(default_factory=list, repr=False)
    optimizer: Any = dataclasses.field(default=None, repr=False)
    discovering: bool = False
    find_optimizer: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.compressor, Compressor):
            raise InvalidOptionError(
                f"compressor must be a registry name or a Compressor, got {self.compressor!r}"
            )
        self.exchange = resolve_exchange(self.compressor, self.options.exchange)
        refuse_incompatible(self.compressor, self.exchange, self.options)
        uses_feedback = self.options.error_feedback
        if uses_feedback is None:
            uses_feedback = bool(self.compressor.error_feedback)
        if uses_feedback and self.feedback is None:
            decay = self.options.feedback_decay(self.compressor)
            self.feedback = ErrorFeedback(
                self.options.momentum, self.options.momentum_masking, self.store, decay
            )
        self.capacities = CapacityPlan(self.options.padding_target)
        self.compressor.bind_store(self.store)
        self.ledger.nonfinite = self.options.nonfinite
        self.telemetry = Telemetry(self.options.log_every, self.options.jsonl_path)
        self.target_ratio = self.compressor.ratio if isinstance(self.compressor, Sparsifier) else None
        self.codec = Codec(self.compressor, self.options.value_dtype)
        code = self.options.warmup_compressor
        self.coded_warmup = (
            None if code is None else CodedWarmup.build(code, self.store, self.options.exchange)
        )

    @classmethod
    def build(cls, compressor: str | Compressor, **options: Any) -> "GradsiftHookState":
        """A state for ``compressor`` (a registry name takes the non-hook options) and hook options."""
        group = options.pop("process_group", None)
        fields = {f.name for f in dataclasses.fields(HookOptions)}
        hook_options = HookOptions(**{k: options.pop(k) for k in list(options) if k in fields})
        return cls(resolve_compressor(compressor, options), hook_options, group)

    @classmethod
    def resolve(
        cls,
        compressor: "str | Compressor | GradsiftHookState",
        options: dict[str, Any],
        refused: tuple[str, ...] = (),
        where: str = "",
        own: tuple[str, tuple[str, ...]] | None = None,
    ) -> "GradsiftHookState":
        """A frontend's state: a restored state as it is (it takes no options), or one built by
        :meth:`build`; an option of ``refused`` (the frontend's one denylist: hook options with no
        meaning there) is refused with ``f"{name}= is not supported {where}"``, an unknown one
        naming the frontend's ``own`` keywords too (:func:`~gradsift.hook.options.check_keywords`)."""
        if isinstance(compressor, GradsiftHookState):
            if options:
                raise InvalidOptionError(f"a restored hook state takes no options, got {sorted(options)}")
            return compressor
        check_keywords(compressor, options, refused, where, own)
        return cls.build(compressor, **options)

    def attach(self, ddp_model: torch.nn.parallel.DistributedDataParallel, optimizer: Any = None) -> None:
        """Bind to ``ddp_model`` (parameter numbers, process group, the compressor's
        instrumentation) and adopt ``optimizer`` (:meth:`adopt`); without one (None), and without
        ``scaler=``, the first step's first bucket looks for them (:meth:`discover`);
        ``optimizer=False``, or a ``momentum=`` set by hand, means none, not looked for."""
        if getattr(ddp_model, "_use_python_reducer", False):
            raise InvalidOptionError(PYTHON_REDUCER)
        self.layout.bind(ddp_model.module, getattr(ddp_model, "parameters_to_ignore", ()))
        self.process_group = self.process_group or ddp_model.process_group
        self.watch(self.layout.params, optimizer)
        self.compressor.attach(ddp_model.module)
        if isinstance(ddp_model, torch.nn.Module):  # the next forward settles the last step
            ddp_model.register_forward_pre_hook(settles_before_forward(self))

    def watch(self, params: Any, optimizer: Any = None) -> None:
        """:meth:`attach`'s optimizer side, also FSDP1 ``NO_SHARD``'s (``params``: its flat parameters)."""
        self.hooked = list(params)
        BEFORE_STEP.add(self)  # an optimizer stepping these parameters settles the closed step first
        self.find_optimizer = optimizer is None and not self.options.momentum  # momentum= by hand: none
        optimizer = None if optimizer is False else optimizer
        self.discovering = self.find_optimizer or self.options.scaler is None
        looks = self.options.scaler is None  # an earlier run's scaler, still alive, is not this run's
        self.earlier_scalers = discovery.scalers_that_scaled() if looks else weakref.WeakSet()
        self.adopt(optimizer)

    def adopt(self, optimizer: Any, take_over: bool = True) -> None:
        """Take over ``optimizer``'s momentum (:mod:`gradsift.hook.recipe`; Adam's method,
        :mod:`gradsift.hook.adam`) when the compressor runs error feedback, and watch the
        first optimizer step (:mod:`gradsift.hook.first_step`); ``take_over=False``: only
        watch again (a scaler was found)."""
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidOptionError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        if take_over and optimizer is not None and self.feedback is not None:
            adam = is_adam(recipe.unwrapped(optimizer))
            if self.options.runs_frozen_variance(self.compressor, feedback=True, adam=adam):
                self.options = self.options.with_frozen_variance_warmup()
            method = (self.options.warmup_steps, self.options.adam, self.compressor, self.options.local_steps)
            taken = recipe.take_over(optimizer, self.layout.numbers, *method)
            if self.options.momentum and self.options.momentum != taken.momentum:
                raise InvalidOptionError(
                    f"momentum={self.options.momentum} disagrees with the optimizer's momentum {taken.momentum}; "
                    "pass one of them (optimizer= takes it from the optimizer)"
                )
            self.feedback.momentum = taken.momentum
            self.feedback.seed_velocity(taken.velocity, self.layout.numels)  # an SGD that already stepped
            self.weight_decay = taken.weight_decay
            self.adam = taken.adam
            self.taken_over = TakenOverChecks(self) if taken.momentum or taken.adam else None
        if self.first_step is not None:
            self.first_step.close()  # the new checks keep its clipping policy
        self.first_step = FirstOptimizerStep.of(self, optimizer)

    def discover(self, scaler: bool = True) -> None:
        """Adopt what the training script built and did not pass (:mod:`gradsift.hook.discovery`):
        the one optimizer stepping the hooked parameters, as ``optimizer=``, and (``scaler``)
        the one enabled ``GradScaler`` that scaled a loss, as ``scaler=``. Each is looked for
        once: the optimizer at the first of the first step's first bucket and a checkpoint's
        load (:meth:`prepare_load`), the scaler at that bucket (before it, no loss was scaled)."""
        look_for_scaler = scaler and self.options.scaler is None
        params, self.find_optimizer = (self.hooked if self.find_optimizer else None), False
        found, found_scaler = (None, None)
        if params is not None or look_for_scaler:  # one walk over the live objects for both
            found, found_scaler = discovery.find(params, look_for_scaler, self.earlier_scalers)
        if found is not None and (self.feedback is None or recipe.can_hold(found)):  # else: not taken over
            self.adopt(found)
        if scaler:
            self.discovering = False
            if found_scaler is not None:
                self.options = dataclasses.replace(self.options, scaler=found_scaler)
                self.adopt(self.optimizer, take_over=False)

    def prepare_load(self, entry: dict[str, Any]) -> "GradsiftHookState":
        """The state that loads ``entry`` (a :meth:`state_dict`): this one, its optimizer found
        first, so the settings it is checked against are those the run that saved it had."""
        del entry  # the same state whatever the entry (AutoHookState's picks by it)
        self.discover(scaler=False)
        return self

    # -- public read-outs -------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Synchronised steps applied so far (``no_sync`` passes and dropped steps do not count)."""
        self.settle()
        return self.ledger.step

    @property
    def last_step_skipped(self) -> bool:
        """True when the last step was dropped for a NaN/Inf gradient on some rank."""
        self.settle()
        return self.ledger.last_step_skipped

    @property
    def bucket_layouts(self) -> dict[Any, tuple[int, ...]]:
        """Per bucket key, the order of its parameters in the bucket's flat gradient."""
        return self.store.layouts

    def stats(self) -> dict[str, Any]:
        """``{"step": {...}, "total": {...}}``: bytes_sent, bytes_padded, bytes_received,
        dense_bytes, density, compress_ms, communicate_ms, decompress_ms, dense/compressed
        tensor counts; the step dict also has ``step`` and ``skipped``, the totals ``steps``
        and ``skipped_steps``; under a frozen Adam method ``adam_warmup`` (:mod:`gradsift.hook.adam`)."""
        self.settle()
        return {**self.telemetry.summary(), **(self.adam.stats() if self.adam is not None else {})}

    # -- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The compressor's name, step, the state store (residuals, the server residual, ...),
        compressor state, telemetry totals (tensors cloned) and the parameters' bucket orders."""
        self.settle()
        return {
            "method": self.compressor.name,
            "step": self.ledger.step,
            "feedback": None if self.feedback is None else {"momentum": self.feedback.momentum},
            "server_feedback": self.options.server_feedback,
            "store": self.store.state_dict(),
            "compressor": self.compressor.state_dict(),
            "weight_decay": dict(self.weight_decay),
            "capacities": self.capacities.state_dict(),
            "telemetry": self.telemetry.state_dict(),
            "orders": dict(self.layout.orders),  # the store's flat tensors are in these orders
            "worker": worker_stamp(self.process_group),  # the store's residuals are this worker's
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, an optimizer still to be found found first (:meth:`prepare_load`)."""
        self.settle()
        self.prepare_load(state)
        check_resumable(state, self.compressor, self.feedback, self.options, self.layout, self.process_group)
        self.ledger.step = int(state["step"])
        self.store.load_state_dict(state["store"])
        self.compressor.load_state_dict(state["compressor"])
        self.weight_decay = dict(state["weight_decay"])
        self.capacities.load_state_dict(state.get("capacities", {}))
        self.telemetry.load_state_dict(state["telemetry"])

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the process group and the steps in flight (like ``PowerSGDState``)."""
        state = dict(self.__dict__)
        state["process_group"] = None
        state["ledger"] = dataclasses.replace(self.ledger, current=None, closed=None)
        state["adam"] = None  # holds the optimizer: register again with optimizer=
        state["first_step"] = state["taken_over"] = None  # global optimizer hooks: attach makes new ones
        state["earlier_scalers"] = ()  # held weakly, not pickled: attach looks again
        return state

    # -- per-step ---------------------------------------------------------------------------
    def stock_step(self) -> bool:
        """Stock DDP's in-place allreduce this step: ``none``, or warm-up without momentum correction."""
        refuse_without_frozen_adam(self.adam, self.compressor, self.options)
        if self.compressor.identity:
            return True
        if self.adam is not None:  # Adam's warm-up is the optimizer as built, on fp32 or coded means
            return self.warming() and self.coded_warmup is None
        return self.warming() and (self.feedback is None or self.feedback.momentum == 0)

    def warming(self) -> bool:
        """Whether this step is dense warm-up: under Adam the method's (given or measured), else ``dense_steps``."""
        if self.adam is not None:
            return not self.adam.compressing(self.ledger.step)
        return self.ledger.step < self.options.dense_steps

    def context(
        self,
        result: torch.Tensor,
        parts: list[Part],
        readout: Readout,
        *,
        order: tuple[int, ...] = (),
        bucket: Any = None,
        source: torch.Tensor | None = None,
    ) -> Context:
        """The one :class:`Context` of a trip of ``parts`` into ``result`` this step (every
        frontend's): the group, each part's payload capacity (:mod:`gradsift.hook.capacity`),
        and a fresh telemetry record whose dense size is ``source``'s (default ``result``)."""
        record = self.bucket_record(result if source is None else source)
        rooms = {part.key: self.capacities.capacity(self.compressor, part.key, part.numel) for part in parts}
        capacities = {key: room for key, room in rooms.items() if room is not None}
        return Context(
            group=self.process_group,
            world=dist.get_world_size(self.process_group),
            rank=dist.get_rank(self.process_group),
            result=result,
            record=record,
            readout=readout,
            store=self.store,
            key=tuple(sorted(order)),
            order=order,
            numels=self.layout.numels,
            capacities=capacities,
            step=self.step,
            bucket=bucket,
        )

    @property
    def stock_checks(self) -> bool:
        """Whether a stock step flags a NaN/Inf in its mean: always during a compressor's warm-up
        (the step's check, as on its compressed steps); for ``none``, only under a ``nonfinite``
        policy other than ``"propagate"`` (stock DDP's own behaviour, with no extra pass)."""
        return not self.compressor.identity or self.options.nonfinite != "propagate"

    @staticmethod
    def bucket_record(source: torch.Tensor) -> BucketRecord:
        """A fresh telemetry record for a trip whose dense size is ``source``'s."""
        return BucketRecord(dense_bytes=source.numel() * source.element_size(), elements=source.numel())

    def loss_scale(self) -> torch.Tensor | None:
        """The scaler's current scale (a device tensor, not read), or None without loss scaling."""
        scaler = self.options.scaler
        if scaler is None or not scaler.is_enabled():
            return None
        return getattr(scaler, "_scale", None)  # None until the scaler scaled a loss

    def close_step(self) -> None:
        """Close the step on the device (:mod:`gradsift.hook.ledger`: no host read); the first
        optimizer step, forward, step or state read after it settles it (:meth:`settle`)."""
        self.ledger.close()
        if self.first_step is not None:
            self.first_step.keep()

    def settle(self) -> None:
        """Settle the closed step on the host (:mod:`gradsift.hook.ledger`): its one host read,
        commit or roll back, the errors it raises; a kept compressed step of Adam hands the
        optimizer's next step to :mod:`gradsift.hook.adam`. A no-op when no step waits."""
        settling = self.ledger.step
        if self.ledger.settle(self.telemetry, self.capacities) and self.adam is not None:
            self.adam.pending = self.adam.compressing(settling)
            variance_refresh.settled(self, settling)

    def before_step(self, optimizer: Any) -> None:
        """An optimizer that steps the hooked parameters settles the closed step first
        (:mod:`gradsift.hook.before_step`); another model's optimizer leaves it alone."""
        if self.ledger.closed is not None:
            hooked = {id(p) for p in self.hooked}
            if any(id(p) in hooked for group in optimizer.param_groups for p in group["params"]):
                self.settle()

    def open_step(self, closes_itself: bool = False) -> Any:
        """Open the step at its first bucket (:mod:`gradsift.hook.ledger`; ``closes_itself``: DDP's
        last bucket closes it), the last one settled first, after the first step's :meth:`discover`
        and the groups added or a weight decay set again since the takeover (:mod:`gradsift.hook.taken_over`);
        while the density warms up, set the sparsifier's ratio (:func:`gradsift.hook.recipe.density_at`)."""
        if self.ledger.current is None:
            self.settle()
        if self.discovering and self.ledger.current is None:
            self.discover()
        if self.ledger.current is None and self.taken_over is not None:
            self.taken_over.follow_groups()  # groups added, a weight-decay schedule: before the exchange
        warming = self.ledger.current is None and self.options.density_warmup_steps
        if warming and self.target_ratio is not None and isinstance(self.compressor, Sparsifier):
            self.compressor.ratio = recipe.density_at(
                self.ledger.step,
                self.target_ratio,
                self.options.density_warmup_steps,
                self.options.density_warmup_start,
            )
        return self.ledger.open(self.compressor, self.store, self.close_step, closes_itself)
