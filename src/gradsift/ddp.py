"""The DDP communication hook: compensate, compress, exchange, decompress.

``register_comm_hook(ddp_model, compressor, **options)`` installs :func:`gradsift_hook`
and returns its :class:`GradsiftHookState`. Per DDP bucket, per backward:

1. Dense steps -- the identity compressor ``none``, and the first ``warmup_steps``
   steps without momentum correction -- run stock DDP's in-place ``allreduce(g / W)``
   (the allreduce exchange with the identity codec).
2. Otherwise the bucket is cut into parts (:mod:`gradsift.layout`): the whole bucket or
   one per layer; parts below ``min_numel`` elements travel dense.
3. compensate: with ``scaler=`` (a ``torch.amp.GradScaler``) the gradient divided by the
   loss scale ``s``; the recipe's weight decay and clipping; then error feedback
   ``c = g + r`` (with momentum correction ``u <- m u + g``, ``c = r + u``) -- so
   weight decay, clipping, fixed thresholds, residuals and velocities all see unscaled
   gradients and a change of the scale leaves the state right.
4. compress + exchange + decompress: the exchange (:mod:`gradsift.exchanges`; the
   compressor's default, or ``exchange=``) encodes each part into its fixed-capacity
   payload, moves it, validates what arrives and writes each part's mean over the
   workers into the bucket's result (times ``s`` under a scaler, as stock DDP's scaled
   mean); the collectives overlap the rest of backward; dense parts go by one allreduce.
5. update: error feedback keeps ``r <- c - s``, ``s`` what this worker's contribution
   stood for.
6. On DDP's last bucket of the backward pass (or when backward ends, for callers
   without buckets), the step closes (:mod:`gradsift.step`) on the thread that ran
   backward: it waits for the exchanges, reads the step's checks in one host transfer
   -- nothing before it reads a tensor on the host, so on a GPU nothing waits for the
   device during backward -- and every rank together commits the step's state, or -- a
   peer failure, a malformed message, a NaN/Inf on any rank -- rolls it back and
   applies the ``nonfinite`` policy, and completes the futures the hook returned. Then
   DDP copies the results into ``.grad``.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime
# (``bucket: dist.GradBucket``, a Future return) and rejects strings.
import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist

from gradsift import recipe
from gradsift.adam import METHODS as ADAM_METHODS
from gradsift.adam import ONE_LINE_WARMUP_STEPS, AdamTakeover, LocalUpdateStep, is_adam
from gradsift.capacity import CapacityPlan
from gradsift.compressors.base import Compressor, Sparsifier
from gradsift.compressors.registry import get_compressor
from gradsift.errors import InvalidOptionError
from gradsift.exchanges import (
    AUTO,
    Codec,
    Context,
    Delivery,
    Exchange,
    Part,
    available_exchanges,
    choose_exchange,
    exchange_for,
    get_exchange,
)
from gradsift.exchanges.allreduce import Allreduce
from gradsift.exchanges.base import IDENTITY, waited
from gradsift.exchanges.collectives import Pending
from gradsift.exchanges.wire import parse_value_dtype
from gradsift.feedback import VELOCITY, ErrorFeedback
from gradsift.first_step import FirstOptimizerStep
from gradsift.layout import GRANULARITIES, ParameterLayout
from gradsift.state import TensorStore
from gradsift.step import NONFINITE_POLICIES, BucketInFlight, BucketOutcome, StepLedger
from gradsift.telemetry import Telemetry
from gradsift.validation import check_choice, check_int, check_ratio, check_real


@dataclasses.dataclass
class HookOptions:
    """The hook's knobs, validated.

    Attributes:
        granularity: ``"bucket"`` (default) -- one ``compress`` per DDP bucket;
            ``"layer"`` -- one per parameter, so every layer gets its own selection.
        min_numel: parts with fewer elements go dense (default 0).
        warmup_steps: the first this many steps are dense (default 0), like PowerSGD's
            ``start_powerSGD_iter``; with ``optimizer=`` Adam/AdamW (``adam="frozen-variance"``)
            0 means :data:`gradsift.adam.ONE_LINE_WARMUP_STEPS` (64), the measured default
            when the run's length is unknown -- pass 10-20 % of a long run's steps.
        value_dtype: dtype of sent values: None (default) keeps the compressor's, or
            ``"fp32"``/``"fp16"``/``"bf16"``. Dense parts travel in the gradient's dtype.
        nonfinite: what a step with NaN/Inf on any rank becomes, on every rank:
            ``"propagate"`` (default) -- the gradients DDP writes are NaN, as with stock
            DDP, so ``torch.amp.GradScaler`` skips the step and backs off its scale;
            ``"skip"`` -- they are all zero; ``"raise"`` -- :class:`NonFiniteGradientError`
            from ``backward()``. In every mode the step leaves no trace in any state
            (see :mod:`gradsift.step`).
        error_feedback: None (default) = the compressor's ``error_feedback``; True/False forces it.
        momentum: DGC momentum correction factor, set by hand (default 0; ``optimizer=``
            sets it from the optimizer instead).
        momentum_masking: DGC's momentum factor masking (default True).
        clip_norm: DGC's local gradient clipping threshold (None = off); see :mod:`gradsift.recipe`.
        density_warmup_steps: steps over which a sparsifier's ratio goes exponentially
            from ``density_warmup_start`` to its target (default 0 = off).
        density_warmup_start: the density the warm-up starts from (default 0.25, DGC's).
        exchange: ``"auto"`` (default: per bucket, among the supported exchanges that
            deliver exactly the mean of every worker's selection, the one the cost model
            predicts fastest -- the allgather for the sparsifiers; never ``"balanced"`` or
            ``"shared-mask"``, which approximate the mean and cost accuracy) or one of
            :func:`gradsift.exchanges.available_exchanges` that the compressor supports.
        scaler: the ``torch.amp.GradScaler`` that scales the loss (None: no loss scaling);
            the hook then works on unscaled gradients (see the module docstring).
        adam: with ``optimizer=`` Adam/AdamW, the method of :mod:`gradsift.adam`:
            ``"frozen-variance"`` (default; its dense warm-up is ``warmup_steps``) or ``"update"``.
        residual_decay: error feedback's ``beta`` in ``c = g + beta r`` (default 1).
        log_every: log every this many steps (``gradsift.ddp`` logger, INFO); 0 = off.
        jsonl_path: also append each logged step to this JSON-lines file.
    """

    granularity: str = "bucket"
    min_numel: int = 0
    warmup_steps: int = 0
    value_dtype: Any = None
    nonfinite: str = "propagate"
    error_feedback: bool | None = None
    momentum: float = 0.0
    momentum_masking: bool = True
    clip_norm: float | None = None
    density_warmup_steps: int = 0
    density_warmup_start: float = 0.25
    exchange: str = AUTO
    scaler: Any = None
    adam: str = "frozen-variance"
    residual_decay: float = 1.0
    log_every: int = 0
    jsonl_path: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        check_choice(self.granularity, "granularity", GRANULARITIES)
        check_int(self.min_numel, "min_numel", low=0)
        check_int(self.warmup_steps, "warmup_steps", low=0)
        self.value_dtype = parse_value_dtype(self.value_dtype)
        check_choice(self.nonfinite, "nonfinite", NONFINITE_POLICIES)
        if self.error_feedback is not None and not isinstance(self.error_feedback, bool):
            raise InvalidOptionError(
                f"error_feedback must be None, True or False, got {self.error_feedback!r}"
            )
        check_real(self.momentum, "momentum", low=0.0, high=1.0, high_open=True)
        if not isinstance(self.momentum_masking, bool):
            raise InvalidOptionError(f"momentum_masking must be True or False, got {self.momentum_masking!r}")
        if self.clip_norm is not None:
            check_real(self.clip_norm, "clip_norm", low=0.0, low_open=True)
        check_int(self.density_warmup_steps, "density_warmup_steps", low=0)
        check_ratio(self.density_warmup_start, "density_warmup_start")
        check_choice(self.exchange, "exchange", (AUTO, *available_exchanges()))
        check_choice(self.adam, "adam", ADAM_METHODS)
        check_real(self.residual_decay, "residual_decay", low=0.0, high=1.0)
        if self.scaler is not None and not hasattr(self.scaler, "is_enabled"):
            raise InvalidOptionError(
                f"scaler must be a torch.amp.GradScaler (or None), got {type(self.scaler).__name__}"
            )
        check_int(self.log_every, "log_every", low=0)


#: Keyword arguments of :func:`register_comm_hook` that configure the hook (the rest go to the compressor).
HOOK_OPTIONS = ("process_group", "optimizer", *(f.name for f in dataclasses.fields(HookOptions)))

_DENSE = Allreduce()


@dataclasses.dataclass
class GradsiftHookState:
    """Everything the hook keeps between calls, as plain data (see :class:`HookOptions`).

    Attributes:
        compressor: the compressor; ``exchange`` the exchange its buckets travel by.
        options: the validated :class:`HookOptions`.
        store: the one keyed store of per-tensor state (residuals, velocities, VGC's
            accumulators), shared by error feedback and the compressor.
        feedback: error feedback (None when the compressor runs without it).
        layout: parameter numbers of the wrapped module and the parts of its buckets.
        ledger: step counting and the per-step transaction.
        weight_decay: per parameter number, weight decay taken over from the optimizer.
        telemetry: per-step and total bytes and phase times (``stats()``).
    """

    compressor: Compressor
    options: HookOptions = dataclasses.field(default_factory=HookOptions)
    process_group: Any = None
    store: TensorStore = dataclasses.field(default_factory=TensorStore)
    feedback: ErrorFeedback | None = None
    layout: ParameterLayout = dataclasses.field(default_factory=ParameterLayout)
    ledger: StepLedger = dataclasses.field(default_factory=StepLedger)
    weight_decay: dict[int, float] = dataclasses.field(default_factory=dict)
    capacities: CapacityPlan = dataclasses.field(default_factory=CapacityPlan)
    adam: AdamTakeover | None = None
    exchange: Exchange = dataclasses.field(init=False)
    telemetry: Telemetry = dataclasses.field(init=False)
    codec: Codec = dataclasses.field(init=False)
    dense_codec: Codec = dataclasses.field(init=False)
    exchanges: dict[str, Exchange] = dataclasses.field(default_factory=dict)
    target_ratio: float | None = dataclasses.field(init=False)
    first_step: FirstOptimizerStep | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.compressor, Compressor):
            raise InvalidOptionError(
                f"compressor must be a registry name or a Compressor, got {self.compressor!r}"
            )
        self.exchange = exchange_for(self.compressor, self.options.exchange)
        if self.exchange.name == "delegated" and self.options.granularity != "bucket":
            raise InvalidOptionError(
                f"{self.compressor.name} runs on whole buckets: use granularity='bucket'"
            )
        if self.options.density_warmup_steps and getattr(self.compressor, "ratio", None) is None:
            raise InvalidOptionError(
                f"density_warmup_steps needs a sparsifier with a ratio; {self.compressor.name} has none"
            )
        uses_feedback = self.options.error_feedback
        if uses_feedback is None:
            uses_feedback = bool(self.compressor.error_feedback)
        if uses_feedback and self.feedback is None:
            self.feedback = ErrorFeedback(
                self.options.momentum, self.options.momentum_masking, self.store, self.options.residual_decay
            )
        self.compressor.bind_store(self.store)
        self.ledger.nonfinite = self.options.nonfinite
        self.telemetry = Telemetry(self.options.log_every, self.options.jsonl_path)
        self.target_ratio = (
            getattr(self.compressor, "ratio", None) if isinstance(self.compressor, Sparsifier) else None
        )
        self.codec = Codec(self.compressor, self.options.value_dtype)
        self.dense_codec = (
            Codec(self.compressor, checks_values=self.options.nonfinite != "propagate")
            if self.compressor.identity
            else IDENTITY
        )

    @classmethod
    def build(cls, compressor: str | Compressor, **options: Any) -> "GradsiftHookState":
        """A state for ``compressor`` (a registry name takes the non-hook options) and hook options."""
        group = options.pop("process_group", None)
        fields = {f.name for f in dataclasses.fields(HookOptions)}
        hook_options = HookOptions(**{k: options.pop(k) for k in list(options) if k in fields})
        return cls(_resolve_compressor(compressor, options), hook_options, group)

    def attach(self, ddp_model: torch.nn.parallel.DistributedDataParallel, optimizer: Any = None) -> None:
        """Bind to ``ddp_model`` (parameter numbers, process group, the compressor's
        instrumentation); with ``optimizer``, take over its momentum (:mod:`gradsift.recipe`)."""
        if getattr(ddp_model, "_use_python_reducer", False):
            raise InvalidOptionError(_PYTHON_REDUCER)
        self.layout.bind(ddp_model.module)
        self.process_group = self.process_group or ddp_model.process_group
        if optimizer is not None and self.feedback is not None:
            one_line = self.options.warmup_steps == 0 and self.options.adam == "frozen-variance"
            if one_line and is_adam(recipe.unwrapped(optimizer)):  # a measured default warm-up
                self.options.warmup_steps = ONE_LINE_WARMUP_STEPS
            taken = recipe.take_over_optimizer(
                optimizer, self.layout.numbers, self.options.warmup_steps, self.options.adam
            )
            if self.options.momentum and self.options.momentum != taken.momentum:
                raise InvalidOptionError(
                    f"momentum={self.options.momentum} disagrees with the optimizer's momentum {taken.momentum}; "
                    "pass one of them (optimizer= takes it from the optimizer)"
                )
            self.feedback.momentum = taken.momentum
            self.weight_decay = taken.weight_decay
            self.adam = taken.adam
        if self.first_step is not None:
            self.first_step.close()
        self.first_step = FirstOptimizerStep(
            list(ddp_model.module.parameters()),
            optimizer,
            check_momentum=self.feedback is not None,
            check_scaler=self.options.scaler is None and not self.compressor.identity,
        )
        self.compressor.attach(ddp_model.module)

    # -- public read-outs -------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Synchronised steps applied so far (``no_sync`` passes and dropped steps do not count)."""
        return self.ledger.step

    @property
    def last_step_skipped(self) -> bool:
        """True when the last step was dropped for a NaN/Inf gradient on some rank."""
        return self.ledger.last_step_skipped

    @property
    def bucket_layouts(self) -> dict[Any, tuple[int, ...]]:
        """Per bucket key, the order of its parameters in the bucket's flat gradient."""
        return self.store.layouts

    def stats(self) -> dict[str, Any]:
        """``{"step": {...}, "total": {...}}``: bytes_sent, bytes_padded, bytes_received,
        dense_bytes, density, compress_ms, communicate_ms, decompress_ms, dense/compressed
        tensor counts; the step dict also has ``step`` and ``skipped``, the totals ``steps``
        and ``skipped_steps``."""
        return self.telemetry.summary()

    # -- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Step, the state store, compressor state and telemetry totals (tensors cloned)."""
        return {
            "step": self.ledger.step,
            "feedback": None if self.feedback is None else {"momentum": self.feedback.momentum},
            "store": self.store.state_dict(),
            "compressor": self.compressor.state_dict(),
            "weight_decay": dict(self.weight_decay),
            "capacities": self.capacities.state_dict(),
            "telemetry": self.telemetry.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        if (state["feedback"] is None) != (self.feedback is None):
            raise InvalidOptionError(
                "checkpoint and hook disagree on error feedback (on in one, off in the other)"
            )
        if self.feedback is not None and float(state["feedback"]["momentum"]) != self.feedback.momentum:
            raise InvalidOptionError(
                f"checkpoint was made with momentum={state['feedback']['momentum']}, "
                f"this hook has {self.feedback.momentum}"
            )
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
        state["ledger"] = dataclasses.replace(self.ledger, current=None)
        state["adam"] = None  # holds the optimizer: register again with optimizer=
        state["first_step"] = None  # a global optimizer hook: attach makes a new one
        return state

    # -- per-step ---------------------------------------------------------------------------
    def dense_step(self) -> bool:
        """Stock DDP's in-place allreduce this step: ``none``, or warm-up without momentum correction."""
        if self.compressor.identity:
            return True
        warming = self.ledger.step < self.options.warmup_steps
        # Adam's warm-up is the optimizer as built: its moments come from dense gradients
        return warming and (self.feedback is None or self.feedback.momentum == 0 or self.adam is not None)

    def exchange_for(self, context: Context) -> Exchange:
        """The exchange of one bucket: the chosen one, or ``"auto"``'s pick."""
        if self.options.exchange != AUTO or len(self.compressor.exchanges) == 1:
            return self.exchange
        name = choose_exchange(self.compressor, context.result.numel(), context.world)
        if name not in self.exchanges:
            self.exchanges[name] = get_exchange(name)
        return self.exchanges[name]

    def loss_scale(self) -> torch.Tensor | None:
        """The scaler's current scale (a device tensor, not read), or None without loss scaling."""
        scaler = self.options.scaler
        if scaler is None or not scaler.is_enabled():
            return None
        return getattr(scaler, "_scale", None)  # None until the scaler scaled a loss

    def close_step(self) -> None:
        """Commit or roll back the step on every rank (:mod:`gradsift.step`); a kept compressed
        step of Adam hands the optimizer's next step to :mod:`gradsift.adam`."""
        closing, was_open = self.ledger.step, self.ledger.current is not None
        self.ledger.close(self.compressor, self.store, self.telemetry, self.capacities)
        if self.first_step is not None:
            self.first_step.keep()
        if self.adam is not None and was_open and not self.ledger.last_step_skipped:
            self.adam.pending = self.adam.compressing(closing)

    def open_step(self) -> Any:
        warming = self.ledger.current is None and self.options.density_warmup_steps
        if warming and self.target_ratio is not None and isinstance(self.compressor, Sparsifier):
            self.compressor.ratio = recipe.density_at(
                self.ledger.step,
                self.target_ratio,
                self.options.density_warmup_steps,
                self.options.density_warmup_start,
            )
        return self.ledger.open(self.compressor, self.store, self.close_step)


def gradsift_hook(state: GradsiftHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook; see the module docstring for the algorithm."""
    if not hasattr(bucket, "buffer"):  # compiled autograd's per-parameter (grad, param) calls
        raise InvalidOptionError(_PYTHON_REDUCER)
    step = state.open_step()
    try:
        parts, context = state.layout.trip(
            bucket,
            state.options.granularity,
            state.store,
            group=state.process_group,
            world=dist.get_world_size(state.process_group),
            rank=dist.get_rank(state.process_group),
            readout=step.readout,
            step=state.step,
            capacity=lambda key, numel: state.capacities.capacity(state.compressor, key, numel),
        )
        step.keys.update([context.key, *(part.key for part in parts)])
        if state.first_step is not None and state.first_step.watching:  # until its checks decided
            state.first_step.offer(bucket.parameters()[0], context.result)
        pending = _exchange_bucket(state, parts, context)
    except BaseException:
        state.ledger.abort(state.compressor, state.store)
        raise
    # DDP gets a future of the hook's own, completed when the step closes (gradsift.step)
    buffer = context.result
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=None if buffer.device.type == "cpu" else [buffer.device]
    )
    step.buckets.append(BucketInFlight(future, pending, buffer, context.record))
    if getattr(bucket, "is_last", lambda: False)():
        state.close_step()  # DDP may wait for the futures before our end-of-backward callback runs
    return future


def exchange_now(state: GradsiftHookState, bucket: Any) -> tuple[torch.Tensor, BucketOutcome]:
    """:func:`gradsift_hook` for callers that need the bucket's mean before backward ends
    (FSDP's hooks consume it on return): the exchange is waited for at once.

    The step still closes at the end of backward (the checks, the non-finite policy,
    the commit or rollback); until then the mean of a step that turns out non-finite is
    not filled (the caller can use the outcome's device flags).
    """
    gradsift_hook(state, bucket)
    assert state.ledger.current is not None  # the hook opened the step
    in_flight = state.ledger.current.buckets[-1]
    try:
        outcome = waited(in_flight.record, in_flight.pending, in_flight.result.device)
    except BaseException:
        state.ledger.abort(state.compressor, state.store)
        raise
    return in_flight.result, outcome


def _exchange_bucket(state: GradsiftHookState, parts: list[Part], context: Context) -> Pending[BucketOutcome]:
    """compensate -> compress -> exchange -> decompress -> update, for one bucket."""
    if state.dense_step():
        whole = [Part(context.key, 0, context.result, [p for part in parts for p in part.params])]
        return _DENSE.start(whole, state.dense_codec, context).then(_outcome(state, context, [], None))
    small = [part for part in parts if part.numel < state.options.min_numel]
    large = [part for part in parts if part.numel >= state.options.min_numel]
    dense = state.ledger.step < state.options.warmup_steps  # warm-up with momentum correction
    loss_scale = state.loss_scale()
    for part in large:
        part.compensated = _compensate(state, part, context.world, loss_scale)
    scale: torch.Tensor | float | None = loss_scale
    if state.adam is not None:  # the mean is the velocity's: Adam's first moment is (1 - beta1) of it
        moment = state.adam.moment_scale()
        scale = moment if scale is None else scale * moment
    batches: list[tuple[list[Part], Exchange, Codec]] = []
    if large:
        batches.append(
            (large, _DENSE, IDENTITY) if dense else (large, state.exchange_for(context), state.codec)
        )
    if small:
        batches.append((small, _DENSE, IDENTITY))
    exchanges = [exchange.start(group, codec, context) for group, exchange, codec in batches]
    return Pending.gather(exchanges).then(_outcome(state, context, large, scale))


def _outcome(
    state: GradsiftHookState, context: Context, large: list[Part], scale: torch.Tensor | float | None
) -> Any:
    """What finishes a bucket once its exchanges delivered: the loss scale put back into the
    compensated parts' means, error feedback's update, and the flags for the step's close."""

    def finish(deliveries: Delivery | list[Delivery]) -> BucketOutcome:
        deliveries = deliveries if isinstance(deliveries, list) else [deliveries]
        if large and state.feedback is not None:  # before the scale: ``sent`` may be the result itself
            for part, sent in zip(large, deliveries[0].sent, strict=True):
                state.feedback.update(
                    part.key, part.input, part.input if sent is None else sent, state.compressor
                )
        if large and scale is not None:
            for part in large:
                part.view(context.result).mul_(scale)
        outcome = BucketOutcome(
            nonfinite=[d.nonfinite for d in deliveries if d.nonfinite is not None],
            malformed=[d.malformed for d in deliveries if d.malformed is not None],
            error=next((d.error for d in deliveries if d.error is not None), None),
        )
        demand = deliveries[0].demand if large else None
        if demand is not None and state.compressor.adaptive_capacity:
            for i, part in enumerate(large):
                outcome.demands[part.key] = (demand[i], part.numel)
        return outcome

    return finish


def _compensate(state: GradsiftHookState, part: Part, world: int, scale: torch.Tensor | None) -> torch.Tensor:
    """Unscaled (under a loss scaler), the recipe's weight decay and local clipping, then
    error feedback: ``c = g / s + wd x + r``."""
    flat = part.flat
    if scale is not None:
        flat = flat * scale.double().reciprocal().float()  # GradScaler's own inverse, fp32
    if state.weight_decay:
        numbers = [state.layout.numbers[id(p)] for p in part.params]
        recipe.add_weight_decay(flat, part.params, numbers, state.weight_decay)
    if state.options.clip_norm is not None:
        total = sum(state.layout.numels.values())
        flat = recipe.clip_local(flat, state.options.clip_norm, part.numel, total, world)
    if state.feedback is None:
        return flat
    if isinstance(state.adam, LocalUpdateStep):  # the worker's own Adam update travels
        return state.feedback.compensate(part.key, state.adam.update(state.store, part.key, flat, state.step))
    if state.adam is not None and state.store.get(VELOCITY, part.key) is None:
        start = state.adam.initial_velocity(part.params)  # the warm-up's first moment
        if start is not None:
            state.store.put(VELOCITY, part.key, start)
    return state.feedback.compensate(part.key, flat)


#: Why compiled autograd's Python reducer is refused.
_PYTHON_REDUCER = (
    "gradsift's hook takes DDP's buckets, but torch._dynamo.config.optimize_ddp='python_reducer' "
    "(which compiled autograd needs) calls communication hooks once per parameter with "
    "(param.grad, param); compile the forward pass only (the default optimize_ddp=True keeps "
    "DDP's buckets and gradsift's hook), or use granularity='layer' with the default reducer"
)


def _resolve_compressor(compressor: Any, options: dict[str, Any]) -> Compressor:
    if isinstance(compressor, str):
        return get_compressor(compressor, **options)
    if options:
        raise InvalidOptionError(
            f"options {sorted(options)} are not hook options and compressor is already built; "
            f"hook options are: {', '.join(HOOK_OPTIONS)}"
        )
    return compressor


def register_comm_hook(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    compressor: str | Compressor | GradsiftHookState = "sidco-exp",
    **options: Any,
) -> GradsiftHookState:
    """Install gradsift's hook on ``ddp_model`` and return its state.

    Args:
        ddp_model: a ``DistributedDataParallel`` model (gloo or NCCL).
        compressor: a registry name, a :class:`Compressor` instance, or a
            :class:`GradsiftHookState` to re-attach (e.g. one restored by pickle).
        options: the hook's knobs (:data:`HOOK_OPTIONS`: ``process_group``, ``optimizer``
            and the fields of :class:`HookOptions`); every other keyword goes to the
            compressor (``ratio``, ``stages``, ...). ``optimizer=`` applies DGC's momentum
            correction (:mod:`gradsift.recipe`): with an error-feedback compressor the
            optimizer's momentum and weight decay move into the hook, so momentum is
            applied exactly once.

    The compressor's ``attach(ddp_model.module)`` is called once here.

    Example::

        model = torch.nn.parallel.DistributedDataParallel(module)
        state = gradsift.register_comm_hook(model, "topk", ratio=0.01, optimizer=optimizer)
        # train as usual; state.stats()["step"] has the last step's bytes and density
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise InvalidOptionError(
            f"ddp_model must be a DistributedDataParallel model, got {type(ddp_model).__name__}"
        )
    optimizer = options.pop("optimizer", None)
    if isinstance(compressor, GradsiftHookState):
        if options:
            raise InvalidOptionError(
                f"a restored hook state takes no options but optimizer, got {sorted(options)}"
            )
        state = compressor
    else:
        state = GradsiftHookState.build(compressor, **options)
    state.attach(ddp_model, optimizer)
    ddp_model.register_comm_hook(state, gradsift_hook)
    return state
