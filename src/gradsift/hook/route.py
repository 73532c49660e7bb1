"""The route of one bucket, top to bottom: compensate, compress, exchange, decompress, update.

Every frontend hands its buckets here (DDP's ``GradBucket``, an FSDP unit, a DiLoCo
round: :class:`~gradsift.hook.layout.FlatBucket`). Per bucket, per backward:

1. **open** -- the first bucket of a backward opens the step (:mod:`gradsift.hook.ledger`):
   the state store's transaction, the compressor's snapshot, the step's readout.
2. **stock step?** -- the identity compressor ``none``, and the first ``warmup_steps``
   steps without momentum correction, run stock DDP's in-place ``allreduce(g / W)`` of the
   whole bucket and skip 3-6 (no parts, no codec, no state: the least Python per bucket).
3. **cut** -- the bucket becomes parts (:mod:`gradsift.hook.layout`): the whole bucket or
   one per layer, and one :class:`~gradsift.core.parts.Context` for their trip; parts below
   ``min_numel`` elements are *small* and travel by the stock allreduce.
4. **compensate** -- with ``scaler=`` the gradient divided by the loss scale ``s``; the
   recipe's weight decay and local clipping; then error feedback ``c = g + r`` (with
   momentum correction ``u <- m u + g``, ``c = r + u``), so weight decay, clipping,
   thresholds, residuals and velocities all see unscaled gradients.
5. **exchange** -- the bucket's exchange (:mod:`gradsift.exchanges`) encodes each part
   into its fixed-capacity payload, moves it, validates what arrives and writes each
   part's mean over the workers into the bucket's result; the collectives overlap the
   rest of backward. In a window of ``variance_refresh`` the gradients also travel as in
   Adam's warm-up, beside the method's message (:mod:`gradsift.hook.variance_refresh`).
6. **update** -- error feedback keeps ``r <- c - sent`` (with momentum correction and a
   sparse payload on an exchange that copies its input, lazily: ``c`` is written over the
   gradient and dropped once encoded, the residual made in place at the commit; on the
   allgather, once the state is stored, the new velocity waits in the gradient's memory
   instead and both are committed in place at the close, gated on the step's flag, before
   the mean is written there: :mod:`gradsift.hook.feedback`, step 3); with
   ``server_feedback`` every rank compresses the compressed parts' mean again with a server
   residual (1-bit Adam's second stage, :func:`~gradsift.hook.feedback.server_stage`); the
   mean is multiplied back by ``s`` (stock DDP's scaled mean) and, under Adam, by the first
   moment's scale.
7. **close** -- on the last bucket (or when backward ends) the step closes on the device,
   with no host read: it waits for the exchanges, fills the results where some rank's
   input was non-finite or a message malformed (the ``nonfinite`` policy's fill) and
   completes the futures; a peer failure raises here.
8. **settle** -- after backward returned (the next optimizer step, forward, step, or a read
   of the hook's state) the step's checks are read in one host transfer -- nothing before
   it reads a tensor on the host -- and every rank together commits the step or rolls it
   back (a malformed message, a NaN/Inf on any rank) and raises what the policy raises.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime
# (``bucket: dist.GradBucket``, a Future return) and rejects strings.
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from gradsift.core.collectives import Pending
from gradsift.core.errors import InvalidOptionError
from gradsift.core.mean import divide_, unscaled
from gradsift.core.parts import Context, Outcome, Part
from gradsift.core.payload import Payload
from gradsift.core.telemetry import BucketRecord
from gradsift.exchanges.allreduce import any_nonfinite, start_mean_allreduce
from gradsift.exchanges.base import IDENTITY, wait_timed
from gradsift.hook import recipe, variance_refresh, zero_one
from gradsift.hook.adam import AdamStep
from gradsift.hook.compatibility import PYTHON_REDUCER
from gradsift.hook.feedback import VELOCITY, server_stage
from gradsift.hook.layout import BucketLike, Grouped
from gradsift.hook.ledger import BucketInFlight
from gradsift.hook.local_update import LocalUpdateStep
from gradsift.hook.state import STOCK_ALLREDUCE, GradsiftHookState
from gradsift.hook.warmup_code import CodedWarmup
from gradsift.hook.zero_one import ZeroOneAdamStep


def gradsift_hook(state: GradsiftHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook (``ddp_model.register_comm_hook(state, gradsift_hook)``)."""
    if not hasattr(bucket, "buffer"):  # compiled autograd's per-parameter (grad, param) calls
        raise InvalidOptionError(PYTHON_REDUCER)
    return route_bucket(state, bucket)


def route_bucket(
    state: GradsiftHookState, bucket: BucketLike, mean_at_once: bool = False
) -> torch.futures.Future[torch.Tensor]:
    """Steps 1-7 of the module docstring for one bucket; the future completes at the step's
    close. ``mean_at_once``: the caller waits for this bucket's mean before backward ends
    (:func:`exchange_now`), so the bucket may not hold new state until the close."""
    step = state.open_step(closes_itself=isinstance(bucket, dist.GradBucket))  # 1
    try:
        if state.stock_step():  # 2
            result = bucket.buffer()
            record = state.bucket_record(result)
            _offer_first_step(state, bucket, result)
            pending = _stock_allreduce(state, result, record)
        else:
            parts, order, bucket = state.layout.parts(
                bucket, state.options.granularity, state.store, regroup=not state.exchange.whole_bucket
            )  # 3
            context = state.context(bucket.buffer(), parts, step.readout, order=order, bucket=bucket)
            step.keys.update([context.key, *(part.key for part in parts)])
            result, record = context.result, context.record
            _offer_first_step(state, bucket, result)
            pending = _exchange(state, parts, context, mean_at_once)  # 4-6
    except BaseException:
        state.ledger.abort()
        raise
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=None if result.device.type == "cpu" else [result.device]
    )
    step.buckets.append(BucketInFlight(future, pending, result, record, list(bucket.parameters())))
    if bucket.is_last():  # 7; DDP may wait for the futures before our end-of-backward callback runs
        state.close_step()
    if isinstance(bucket, Grouped):
        return future.then(lambda done: bucket.laid_back(done.value()))
    return future


def exchange_now(state: GradsiftHookState, bucket: BucketLike) -> tuple[torch.Tensor, Outcome]:
    """:func:`route_bucket` for callers that need the bucket's mean before backward ends
    (FSDP's hooks consume it on return): the exchange is waited for at once.

    The step still closes at the end of backward and settles after it (the checks, the
    non-finite policy, the commit or rollback); the mean returned here is not filled for a
    step that turns out non-finite (the caller can use the outcome's device flags).
    """
    route_bucket(state, bucket, mean_at_once=True)
    assert state.ledger.current is not None  # the route opened the step
    in_flight = state.ledger.current.buckets[-1]
    try:
        outcome = wait_timed(in_flight.record, in_flight.pending, in_flight.result.device)
    except BaseException:
        state.ledger.abort()
        raise
    return in_flight.result, outcome


def _offer_first_step(state: GradsiftHookState, bucket: BucketLike, result: torch.Tensor) -> None:
    """The first optimizer step's check watches the step's first bucket with an element until
    it has decided: its first parameter with elements, whose gradient ``result`` starts with
    (a parameter of no elements before it takes no room)."""
    if state.first_step is not None and state.first_step.watching:
        param = next((p for p in bucket.parameters() if p.numel()), None)
        if param is not None:
            state.first_step.offer(param, result)


def _stock_allreduce(
    state: GradsiftHookState, buffer: torch.Tensor, record: BucketRecord
) -> Pending[Outcome]:
    """Step 2: stock DDP's ``allreduce(g / W)`` of the bucket in place -- no parts, no codec, no
    state touched (so the step keeps no keys) -- with the mean's NaN/Inf flag where the
    ``nonfinite`` policy needs it (:attr:`~gradsift.hook.state.GradsiftHookState.stock_checks`)."""
    world = dist.get_world_size(state.process_group)
    checks = state.stock_checks
    record.add_tensor(buffer.numel(), dense=True)
    return start_mean_allreduce(divide_(buffer, world), world, state.process_group, record).then(
        lambda mean: Outcome.of([], [], nonfinite=any_nonfinite([mean]) if checks else None)
    )


def _exchange(
    state: GradsiftHookState, parts: list[Part], context: Context, mean_at_once: bool = False
) -> Pending[Outcome]:
    """Steps 4-6: compensate -> exchange (-> decode) -> update."""
    small = [part for part in parts if part.numel < state.options.min_numel]
    large = [part for part in parts if part.numel >= state.options.min_numel]
    loss_scale = state.loss_scale()
    warming = state.warming()  # SGD's warm-up with momentum correction, or Adam's in a code
    coded = state.coded_warmup if warming and state.adam is not None else None
    warmup = (STOCK_ALLREDUCE, IDENTITY) if state.coded_warmup is None else state.coded_warmup.route
    exchange, codec = warmup if warming else (state.exchange, state.codec)
    feedback = state.feedback if coded is None else coded.feedback
    lazy = exchange.copies_input and feedback is not None and feedback.keeps_lazily(codec.compressor)
    refresh = None if warming else variance_refresh.start_trip(state, large, context, loss_scale, warmup)
    defers = exchange.copies_input and exchange.defers_mean and not mean_at_once and refresh is None
    in_result = coded is None and _keeps_in_result(state, large, defers)
    for part in large:  # 4 (after the refresh's trip read the gradients)
        part.compensated = _compensate(state, part, context.world, loss_scale, coded, lazy, in_result)
    local = isinstance(state.adam, ZeroOneAdamStep) and not warming and not state.adam.syncs(context.step)
    trips = []  # 5
    if large:
        trip_context = (
            replace(context, before_mean=_committer(state, large, context)) if in_result else context
        )
        trips.append(
            zero_one.start_local_trip(large, context) if local else exchange.start(large, codec, trip_context)
        )
        if lazy or in_result:  # the payloads hold what error feedback needs of ``c``: it lived only for them
            for part in large:
                part.compensated = None
    if small:
        trips.append(STOCK_ALLREDUCE.start(small, IDENTITY, context))
    if refresh is not None:  # after the compressed parts' outcome, which the update reads first
        trips.append(refresh)
    scale = loss_scale if coded is not None else _mean_scale(state, loss_scale, context.step)
    return Pending.gather(trips).then(
        _update(
            state,
            context,
            large,
            scale,
            compressed=not warming,
            coded=coded,
            local=local,
            in_result=in_result,
        )
    )  # 6


def _keeps_in_result(state: GradsiftHookState, large: list[Part], defers_mean: bool) -> bool:
    """Whether the bucket's new velocity waits in its own memory for the step's flag
    (:meth:`~gradsift.hook.feedback.ErrorFeedback.compensate_in_result`): the exchange copies
    its input and writes its means after the flag (``defers_mean``), a momentum-corrected
    velocity -- SGD's, or the frozen-variance Adam method's, which keeps nothing of the mean --
    with no server stage, a compressor whose decode flags nothing, and every large part's
    velocity and residual already stored in its gradient's dtype."""
    feedback, adam = state.feedback, state.adam
    keeps_nothing_of_the_mean = adam is not None and type(adam).exchanged is AdamStep.exchanged
    plain_velocity = adam is None or (keeps_nothing_of_the_mean and not isinstance(adam, LocalUpdateStep))
    return (
        defers_mean
        and feedback is not None
        and not state.compressor.decode_checks
        and plain_velocity
        and not state.options.server_feedback
        and all(feedback.holds(part.key, part.flat) for part in large)
    )


def _committer(
    state: GradsiftHookState, large: list[Part], context: Context
) -> Callable[[list[Payload], torch.Tensor | None], None]:
    """The trip's ``before_mean``: error feedback's commit of each part, gated on the step's flag."""
    feedback, compressor = state.feedback, state.compressor
    assert feedback is not None  # _keeps_in_result

    def commit(sent: list[Payload], dropped: torch.Tensor | None) -> None:
        with context.record.timed("compress_ms", context.result.device):
            for part, payload in zip(large, sent, strict=True):
                feedback.commit_in_result(part.key, part.flat, payload, dropped, compressor)

    return commit


def _compensate(
    state: GradsiftHookState,
    part: Part,
    world: int,
    scale: torch.Tensor | None,
    coded: CodedWarmup | None,
    lazy: bool,
    in_result: bool = False,
) -> torch.Tensor:
    """Unscaled (under a loss scaler), the recipe's weight decay and local clipping, then
    error feedback: ``c = g / s + wd x + r``; in Adam's ``coded`` warm-up ``c = g / s + r``
    (the optimizer as built applies its own decay). When error feedback keeps the residual
    lazily (``lazy``), ``c`` is written over the part's gradient where the dtypes agree (the
    velocity has taken ``g`` in; the mean is written there after the exchange read ``c``),
    so the step allocates no ``c`` of its own; kept ``in_result``, the new velocity is
    written there instead and ``c`` lives only while the part is encoded."""
    flat = part.flat
    if scale is not None:
        flat = unscaled(flat, scale)
    if coded is not None:
        return coded.feedback.compensate(part.key, flat)
    if state.weight_decay:
        numbers = [state.layout.numbers[id(p)] for p in part.params]
        recipe.add_weight_decay(flat, part.params, numbers, state.weight_decay)
    if state.options.clip_norm is not None:
        total = sum(state.layout.numels.values())
        canonical = state.store.canonical(part.key)
        flat = recipe.clip_local(flat, state.options.clip_norm, part.numel, total, world, canonical)
    if state.feedback is None:
        return flat
    if isinstance(state.adam, LocalUpdateStep):  # the worker's own Adam update travels
        return state.feedback.compensate(part.key, state.adam.update(state.store, part.key, flat, state.step))
    if isinstance(state.adam, ZeroOneAdamStep):  # the interval's accumulated update travels at its end
        syncing = state.adam.syncs(state.step)
        travelling = state.adam.accumulate(state.store, part.key, flat, part.params, syncing)
        return state.feedback.compensate(part.key, travelling) if syncing else travelling
    if state.adam is not None and state.store.get(VELOCITY, part.key) is None:
        start = state.adam.initial_velocity(part.params)  # the warm-up's first moment
        if start is not None:
            state.store.put(VELOCITY, part.key, start)
    if in_result:
        return state.feedback.compensate_in_result(part.key, flat, part.flat)
    widened = part.flat.dtype in (torch.float16, torch.bfloat16)  # ``c`` is float32: no room in ``g``
    return state.feedback.compensate(part.key, flat, out=part.flat if lazy and not widened else None)


def _mean_scale(
    state: GradsiftHookState, loss_scale: torch.Tensor | None, step: int
) -> torch.Tensor | float | None:
    """What the compensated parts' mean is multiplied by: the loss scale ``s`` (stock DDP's
    scaled mean) and, under Adam, the first moment's share of it (``1 - beta1`` of a velocity)."""
    if state.adam is None:
        return loss_scale
    moment = state.adam.moment_scale(step)
    return moment if loss_scale is None else loss_scale * moment


def _update(
    state: GradsiftHookState,
    context: Context,
    large: list[Part],
    scale: torch.Tensor | float | None,
    compressed: bool = True,
    coded: CodedWarmup | None = None,
    local: bool = False,
    in_result: bool = False,
) -> Callable[[list[Outcome]], Outcome]:
    """Step 6, once the bucket's trips delivered (the compressed parts' first): error
    feedback's ``r <- c - sent`` (the ``coded`` warm-up's own, with its code); when ``large``
    travelled ``compressed``, the server stage on their mean and what the Adam method keeps
    of it (both in the residuals' units, before the scale); the scale put back into the
    mean; one outcome for the close. A ``local`` step (0/1 Adam's) only scales. Kept
    ``in_result``, error feedback commits before the mean is written (the trip's
    ``before_mean``) and the scale waits for that mean in the outcome's ``writes``."""
    feedback, compressor = (
        (state.feedback, state.compressor) if coded is None else (coded.feedback, coded.compressor)
    )
    compressed = compressed and not local
    feedback = None if local or in_result else feedback

    def rescale(_dropped: torch.Tensor | None = None) -> None:
        assert scale is not None  # called only then
        for part in large:
            part.view(context.result).mul_(scale)

    def finish(outcomes: list[Outcome]) -> Outcome:
        if large and feedback is not None:  # before the scale: ``sent`` may be the result itself
            for part, sent in zip(large, outcomes[0].sent, strict=True):
                feedback.update(part.key, part.compensated, part.input if sent is None else sent, compressor)
        if large and compressed and state.options.server_feedback:
            with context.record.timed("compress_ms", context.result.device):
                for part in large:
                    server_stage(
                        state.store, part.key, part.view(context.result), state.compressor, context.readout
                    )
        if large and compressed and state.adam is not None:
            for part in large:
                state.adam.exchanged(state.store, part.key, part.view(context.result))
        outcome = Outcome.joined(outcomes)
        if large and scale is not None:
            if in_result:
                outcome.writes.append(rescale)
            else:
                rescale()
        if not state.compressor.adaptive_capacity:
            outcome.demands.clear()
        return outcome

    return finish
