"""The DDP communication hook: compress each bucket, exchange, decompress.

``register_comm_hook(ddp_model, compressor, **options)`` installs
:func:`gradsift_hook` and returns its :class:`GradsiftHookState`. Per DDP bucket, per
backward:

1. Warm-up (``step < warmup_steps``) and the identity compressor ``none``: the bucket
   is averaged in place by a plain dense allreduce, exactly as stock DDP does
   (``allreduce(g / W)``), plus one read of the result for the non-finite flag.
2. Delegation: a compressor with a ``ddp_hook(process_group, bucket)`` method (the
   PowerSGD wrapper) runs its own communication; the hook only times it.
3. Otherwise the bucket is cut into *parts* -- the whole bucket
   (``granularity="bucket"``) or one part per parameter (``"layer"``). Parts with
   fewer than ``min_numel`` elements go dense. For every other part:
   ``c = g + residual`` (error feedback), ``p = compress(c)``, ``p' = to_wire(p)``.
4. Dense parts and the values of allreduce-compatible payloads (``none``, ``fp16``,
   ``bf16``, seeded ``randomk``) travel in one allreduce per dtype; the other payloads
   in one sparse exchange: a header allgather (lengths + non-finite flag) and one
   padded allgather per field (:mod:`gradsift.comm`).
5. When the data arrive (a future callback, overlapping the rest of backward) each
   worker's message is validated (:func:`gradsift.wire.decode`) and the compressor's
   ``decompress`` forms ``(1/W) sum_w decode(p'_w)`` for each part.
6. When backward ends, one engine callback waits for the step's futures, re-raises a
   peer failure as :class:`~gradsift.errors.PeerFailureError`, applies the non-finite
   policy on every rank together, and records telemetry; then DDP copies the results
   into ``.grad``.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime
# (``bucket: dist.GradBucket``, a Future return) and rejects strings.
import dataclasses
import os
import time
from collections.abc import Hashable
from typing import Any

import torch
import torch.distributed as dist

from gradsift import comm, wire
from gradsift.compressors.base import Compressor, Payload
from gradsift.compressors.registry import get_compressor
from gradsift.errors import GradsiftError, InvalidOptionError, NonFiniteGradientError
from gradsift.feedback import ErrorFeedback
from gradsift.telemetry import BucketRecord, Telemetry
from gradsift.validation import all_finite, check_choice, check_int

GRANULARITIES = ("bucket", "layer")
NONFINITE_POLICIES = ("raise", "skip")


class GradsiftHookState:
    """Everything the hook needs between calls; every knob with its default.

    Args:
        process_group: the group to communicate in; None = the DDP model's group.
        compressor: a :class:`~gradsift.compressors.base.Compressor` instance.
        granularity: ``"bucket"`` (default) -- one ``compress`` per DDP bucket;
            ``"layer"`` -- one per parameter of the bucket (``bucket.gradients()``),
            so every layer gets its own threshold/selection.
        min_numel: parts with fewer elements than this go dense, all of a bucket's
            dense parts in one allreduce (default 0: nothing goes dense).
        warmup_steps: the first this many steps use a plain dense allreduce of every
            bucket (default 0), like PowerSGD's ``start_powerSGD_iter``.
        value_dtype: dtype of sent values: None (default) keeps the compressor's
            (fp32 for an fp32 model, 16-bit for fp16/bf16), or "fp32"/"fp16"/"bf16".
            Dense parts (``min_numel``, warm-up) always travel in the gradient's dtype.
        nonfinite: ``"raise"`` (default): a NaN/Inf gradient on any rank raises
            :class:`NonFiniteGradientError` from ``backward()`` on every rank;
            ``"skip"``: every rank returns an all-zero gradient for the step and
            ``stats()["step"]["skipped"]`` / :attr:`last_step_skipped` is True.
        error_feedback: None (default) = the compressor class's ``error_feedback``;
            True/False forces it on/off.
        momentum: DGC momentum correction factor for the error feedback (default 0).
        log_every: log every this many steps (``gradsift.ddp`` logger, INFO); 0 = off.
        jsonl_path: also append each logged step to this JSON-lines file.

    Attributes:
        step: completed backward passes that synchronised (``no_sync`` passes do not
            call the hook and do not count).
        last_step_skipped: True when the last step was zeroed by ``nonfinite="skip"``.
        bucket_layouts: per bucket key (the sorted parameter numbers), the order in which
            those parameters lie in the bucket's flat gradient.
    """

    def __init__(
        self,
        process_group: Any,
        compressor: Compressor,
        *,
        granularity: str = "bucket",
        min_numel: int = 0,
        warmup_steps: int = 0,
        value_dtype: Any = None,
        nonfinite: str = "raise",
        error_feedback: bool | None = None,
        momentum: float = 0.0,
        log_every: int = 0,
        jsonl_path: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(compressor, Compressor):
            raise InvalidOptionError(
                f"compressor must be a registry name or a Compressor, got {compressor!r}"
            )
        self.process_group = process_group
        self.compressor = compressor
        self.granularity = check_choice(granularity, "granularity", GRANULARITIES)
        self.min_numel = check_int(min_numel, "min_numel", low=0)
        self.warmup_steps = check_int(warmup_steps, "warmup_steps", low=0)
        self.value_dtype = wire.parse_value_dtype(value_dtype)
        self.nonfinite = check_choice(nonfinite, "nonfinite", NONFINITE_POLICIES)
        self.delegates = callable(getattr(compressor, "ddp_hook", None))
        use_feedback = type(compressor).error_feedback if error_feedback is None else bool(error_feedback)
        self.feedback = ErrorFeedback(momentum) if use_feedback and not self.delegates else None
        self.telemetry = Telemetry(check_int(log_every, "log_every", low=0), jsonl_path)
        self.step = 0
        self.last_step_skipped = False
        self._param_index: dict[int, int] = {}
        self._numels: list[int] = []
        self.bucket_layouts: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._reset_step()

    # -- registration -------------------------------------------------------------------
    def attach(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
        """Bind to ``ddp_model``: parameter numbering (the stable tensor keys), the group."""
        params = list(ddp_model.module.parameters())
        self._param_index = {id(p): i for i, p in enumerate(params)}
        self._numels = [p.numel() for p in params]
        if self.process_group is None:
            self.process_group = ddp_model.process_group

    # -- checkpointing ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Step, residuals, compressor state, the CPU RNG state and telemetry totals."""
        return {
            "step": self.step,
            "feedback": None if self.feedback is None else self.feedback.state_dict(),
            "compressor": self.compressor.state_dict(),
            "rng_state": torch.get_rng_state(),
            "telemetry": self.telemetry.state_dict(),
            "layouts": dict(self.bucket_layouts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (also the CPU RNG, which seedless compressors draw from)."""
        if (state["feedback"] is None) != (self.feedback is None):
            raise InvalidOptionError(
                "checkpoint and hook disagree on error feedback (on in one, off in the other)"
            )
        self.step = int(state["step"])
        if self.feedback is not None:
            self.feedback.load_state_dict(state["feedback"])
        self.compressor.load_state_dict(state["compressor"])
        torch.set_rng_state(state["rng_state"])
        self.telemetry.load_state_dict(state["telemetry"])
        self.bucket_layouts = dict(state["layouts"])

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the process group and the in-flight step (like ``PowerSGDState``)."""
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_step_")}
        state["process_group"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_step()

    # -- telemetry ----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """``{"step": {...}, "total": {...}}``: bytes_sent, bytes_padded, dense_bytes,
        density, compress_ms, communicate_ms, decompress_ms, dense/compressed tensor
        counts; the step dict also has ``step`` and ``skipped``, the totals ``steps``
        and ``skipped_steps``."""
        return self.telemetry.summary()

    # -- per-step bookkeeping -----------------------------------------------------------
    def _reset_step(self) -> None:
        self._step_open = False
        self._step_keys: set[Hashable] = set()
        self._step_pending: list[tuple[torch.futures.Future[torch.Tensor], BucketRecord, list[Any]]] = []

    def _open_step(self) -> None:
        """On the first bucket of a backward, queue :meth:`_close_step` to run after every bucket."""
        if not self._step_open:
            self._step_open = True
            torch.autograd.Variable._execution_engine.queue_callback(self._close_step)

    def _close_step(self) -> None:
        """Wait for the step's buckets, apply the failure policy, record telemetry."""
        pending, step, keys = self._step_pending, self.step, self._step_keys
        self._reset_step()
        results = []
        for future, _, error in pending:
            try:
                results.append(future.wait())
            except RuntimeError as exc:
                raise comm.peer_failure(exc, self.process_group, "gradient exchange") from exc
            if error:
                raise error[0]
        nonfinite = any(record.nonfinite for _, record, _ in pending)
        if nonfinite and self.nonfinite == "raise":
            raise NonFiniteGradientError(
                f"step {step}: a gradient holds NaN or Inf on at least one rank; every rank raises "
                "(pass nonfinite='skip' to drop such steps instead)"
            )
        for result in results if nonfinite else ():
            result.zero_()
        if self.feedback is not None and keys:  # drop state of tensors no bucket holds any more
            for stale in set(self.feedback.residuals) - keys:
                self.feedback.reset(stale)
        self.last_step_skipped = nonfinite
        self.telemetry.end_step(step, [record for _, record, _ in pending], skipped=nonfinite)
        self.step += 1

    # -- keys -----------------------------------------------------------------------------
    def _parts(self, bucket: dist.GradBucket) -> list[tuple[Hashable, int, torch.Tensor, list[torch.Tensor]]]:
        """``(key, offset, flat gradient, parameters)`` per part of the bucket.

        Keys are parameter numbers (``layer``) or their sorted tuple (``bucket``), so
        state follows the parameters, not the bucket index, when DDP rebuilds its
        buckets after the first step (and when a resumed run starts with the initial
        layout): a bucket whose parameters come in a new order gets its residual
        permuted to match (:meth:`_follow_layout`).
        """
        params = bucket.parameters()
        ids = tuple(self._param_index[id(p)] for p in params)
        buffer = bucket.buffer()
        if self.granularity == "bucket":
            key = tuple(sorted(ids))
            self._follow_layout(key, ids)
            parts = [(key, 0, buffer, list(params))]
        else:
            parts, offset = [], 0
            for key, param in zip(ids, params, strict=True):
                parts.append((key, offset, buffer[offset : offset + param.numel()], [param]))
                offset += param.numel()
        self._step_keys.update(part[0] for part in parts)
        return parts

    def _follow_layout(self, key: tuple[int, ...], order: tuple[int, ...]) -> None:
        """Permute ``key``'s residual/velocity when its parameters arrive in a new order."""
        previous = self.bucket_layouts.get(key)
        self.bucket_layouts[key] = order
        if previous is None or previous == order or self.feedback is None:
            return
        numels = [self._numels[i] for i in previous]
        for table in (self.feedback.residuals, self.feedback.velocities):
            if key in table:
                chunks = dict(zip(previous, table[key].split(numels), strict=True))
                table[key] = torch.cat([chunks[i] for i in order])

    # -- compression ----------------------------------------------------------------------
    def _compress(
        self, key: Hashable, flat: torch.Tensor, params: list[torch.Tensor]
    ) -> tuple[Payload, bool]:
        """Compensate and compress one part; return ``(payload, non-finite?)``.

        A non-finite part is compressed again with NaN/Inf replaced by 0 so that the
        message keeps its layout, and its error-feedback state is dropped.
        """
        extra = {"parameters": params} if type(self.compressor).needs_parameters else {}
        compensated = flat if self.feedback is None else self.feedback.compensate(key, flat)
        try:
            payload = self.compressor.compress(compensated, key=key, **extra)
        except NonFiniteGradientError:
            if self.feedback is not None:
                self.feedback.reset(key)
            cleaned = torch.nan_to_num(compensated, nan=0.0, posinf=0.0, neginf=0.0)
            return self.compressor.compress(cleaned, key=key, **extra), True
        if self.feedback is not None:
            self.feedback.update(key, compensated, payload, self.compressor)
        return payload, False


def gradsift_hook(state: GradsiftHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook; see the module docstring for the algorithm."""
    state._open_step()
    record = BucketRecord(dense_bytes=bucket.buffer().numel() * bucket.buffer().element_size())
    record.elements = bucket.buffer().numel()
    error: list[BaseException] = []
    try:
        if state.step < state.warmup_steps or type(state.compressor).identity:
            future = _dense_bucket(state, bucket, record)
        elif state.delegates:
            future = _delegated_bucket(state, bucket, record)
        else:
            future = _compressed_bucket(state, bucket, record, error)
    except BaseException:
        state._reset_step()
        raise
    state._step_pending.append((future, record, error))
    return future


def _dense_bucket(
    state: GradsiftHookState, bucket: dist.GradBucket, record: BucketRecord
) -> torch.futures.Future:
    buffer = bucket.buffer()
    record.bytes_sent = record.bytes_padded = record.dense_bytes
    record.elements_sent, record.dense_tensors = buffer.numel(), 1
    started = time.perf_counter()
    return comm.allreduce_mean(buffer, state.process_group, in_place=True).then(
        lambda fut: _checked(fut.value(), record, started)
    )


def _delegated_bucket(
    state: GradsiftHookState, bucket: dist.GradBucket, record: BucketRecord
) -> torch.futures.Future:
    started = time.perf_counter()
    future = state.compressor.ddp_hook(state.process_group, bucket)
    hook_nbytes = getattr(state.compressor, "hook_nbytes", None)
    record.bytes_sent = record.bytes_padded = int(hook_nbytes(bucket)) if callable(hook_nbytes) else 0
    record.elements_sent = record.bytes_sent // bucket.buffer().element_size()  # in element equivalents
    record.compressed_tensors = 1
    return future.then(lambda fut: _checked(fut.value(), record, started))


def _checked(result: torch.Tensor, record: BucketRecord, started: float) -> torch.Tensor:
    """Completion of an allreduce: time it and flag a non-finite mean (same on every rank)."""
    record.communicate_ms += (time.perf_counter() - started) * 1e3
    record.nonfinite |= not all_finite(result)
    return result


def _compressed_bucket(
    state: GradsiftHookState, bucket: dist.GradBucket, record: BucketRecord, error: list[BaseException]
) -> torch.futures.Future:
    """Steps 3-5 of the module docstring for one bucket."""
    group, compressor = state.process_group, state.compressor
    buffer = bucket.buffer()
    started = time.perf_counter()
    dense, reduced, gathered = [], [], []  # (offset, tensor or wire payload) per part, by route
    local_nonfinite = False
    for key, offset, flat, params in state._parts(bucket):
        if flat.numel() < state.min_numel:
            dense.append((offset, flat))
            continue
        payload, bad = state._compress(key, flat, params)
        local_nonfinite |= bad
        sent = wire.to_wire(payload, state.value_dtype)
        (reduced if compressor.allreduce_compatible else gathered).append((offset, sent))
        record.elements_sent += sent.count
    record.compressed_tensors = len(reduced) + len(gathered)
    record.dense_tensors = len(dense)
    record.elements_sent += sum(flat.numel() for _, flat in dense)
    if gathered and state.value_dtype is not None and not local_nonfinite:
        # a down-cast may overflow: check the k sent values, not the n gradient elements
        sent_values = [p.values for _, p in gathered if p.values is not None]  # VGC sends codes only
        local_nonfinite = not all(all_finite(values) for values in sent_values)
    compressed_at = time.perf_counter()
    record.compress_ms = (compressed_at - started) * 1e3

    futures, headers = [], None
    if gathered:
        payloads = [p for _, p in gathered]
        headers = comm.gather_headers(wire.header(payloads, local_nonfinite), buffer.device, group)
        if wire.check_headers(headers, len(payloads), len(payloads[0].fields())):
            record.nonfinite = True
            if state.nonfinite == "raise":
                raise NonFiniteGradientError(
                    f"step {state.step}: a gradient holds NaN or Inf on at least one rank "
                    "(pass nonfinite='skip' to drop such steps instead)"
                )
            return _ready(torch.zeros_like(buffer))
        data = wire.concat_fields(payloads)
        field_lengths = headers.view(headers.shape[0], len(payloads), -1).sum(dim=1)
        record.bytes_sent += sum(p.nbytes for p in payloads)
        record.bytes_padded += headers.shape[1] * headers.element_size() + sum(
            int(field_lengths[:, j].max()) * t.element_size() for j, t in enumerate(data.values())
        )
        futures.append(comm.gather_fields(data, field_lengths, group))
    segments = [(offset, flat, None) for offset, flat in dense] + [(o, p.values, p) for o, p in reduced]
    by_dtype: dict[torch.dtype, list[tuple[int, torch.Tensor, Payload | None]]] = {}
    for segment in segments:
        by_dtype.setdefault(segment[1].dtype, []).append(segment)
    for group_segments in by_dtype.values():
        message = (
            torch.cat([t for _, t, _ in group_segments]) if len(group_segments) > 1 else group_segments[0][1]
        )
        if local_nonfinite:  # poison the sum so that every rank sees the flag in its result
            message = torch.full_like(message, float("nan"))
        record.bytes_sent += message.numel() * message.element_size()
        record.bytes_padded += message.numel() * message.element_size()
        futures.append(comm.allreduce_mean(message, group))
    by_dtype_list = list(by_dtype.values())

    def finish(done: torch.futures.Future) -> torch.Tensor:
        record.communicate_ms = (time.perf_counter() - compressed_at) * 1e3
        decode_started = time.perf_counter()
        result = torch.empty_like(buffer)
        try:
            values = [f.value() for f in done.value()]
            if gathered:
                _combine_gathered(values.pop(0), headers, gathered, compressor, result)
            for group_segments, mean in zip(by_dtype_list, values, strict=True):
                record.nonfinite |= not all_finite(mean)
                _combine_reduced(group_segments, mean, compressor, result)
        except GradsiftError as exc:
            error.append(exc)
            result.zero_()
        except RuntimeError as exc:
            error.append(comm.peer_failure(exc, group, "gradient exchange"))
            result.zero_()
        record.decompress_ms = (time.perf_counter() - decode_started) * 1e3
        return result

    return torch.futures.collect_all(futures).then(finish)


def _ready(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(value)
    return future


def _combine_gathered(
    gathered_fields: dict[str, list[torch.Tensor]],
    headers: torch.Tensor,
    gathered: list[tuple[int, Payload]],
    compressor: Compressor,
    result: torch.Tensor,
) -> None:
    """Decode every worker's message and write each part's mean into ``result``."""
    templates = [p for _, p in gathered]
    decoded = [
        wire.decode(row, {name: tensors[w] for name, tensors in gathered_fields.items()}, templates)
        for w, row in enumerate(headers.tolist())
    ]
    for part, (offset, template) in enumerate(gathered):
        mean = compressor.decompress([payloads[part] for payloads in decoded], template.numel)
        result[offset : offset + template.numel].copy_(mean)


def _combine_reduced(
    segments: list[tuple[int, torch.Tensor, Payload | None]],
    mean: torch.Tensor,
    compressor: Compressor,
    result: torch.Tensor,
) -> None:
    """Split an allreduced mean into its segments: dense parts as they are, payload values decoded."""
    start = 0
    for offset, sent, payload in segments:
        values = mean[start : start + sent.numel()]
        start += sent.numel()
        if payload is None:
            result[offset : offset + sent.numel()].copy_(values)
        else:
            dense = compressor.decompress([dataclasses.replace(payload, values=values)], payload.numel)
            result[offset : offset + payload.numel].copy_(dense)


def _resolve_compressor(compressor: Any, options: dict[str, Any]) -> Compressor:
    if isinstance(compressor, str):
        return get_compressor(compressor, **options)
    if options:
        raise InvalidOptionError(
            f"options {sorted(options)} are not hook options and compressor is already built; "
            f"hook options are: {', '.join(HOOK_OPTIONS)}"
        )
    return compressor


HOOK_OPTIONS = (
    "process_group",
    "granularity",
    "min_numel",
    "warmup_steps",
    "value_dtype",
    "nonfinite",
    "error_feedback",
    "momentum",
    "log_every",
    "jsonl_path",
)


def register_comm_hook(
    ddp_model: torch.nn.parallel.DistributedDataParallel, compressor: Any = "sidco-exp", **options: Any
) -> GradsiftHookState:
    """Install gradsift's hook on ``ddp_model`` and return its state.

    Args:
        ddp_model: a ``DistributedDataParallel`` model (gloo or NCCL).
        compressor: a registry name, a :class:`Compressor` instance, or a
            :class:`GradsiftHookState` to re-attach (e.g. one restored by pickle).
        options: the hook's knobs (:data:`HOOK_OPTIONS`, documented on
            :class:`GradsiftHookState`); every other keyword goes to the compressor
            (``ratio``, ``stages``, ...).

    The compressor's ``attach(ddp_model.module)`` is called once here.
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise InvalidOptionError(
            f"ddp_model must be a DistributedDataParallel model, got {type(ddp_model).__name__}"
        )
    if isinstance(compressor, GradsiftHookState):
        if options:
            raise InvalidOptionError(f"a restored hook state takes no options, got {sorted(options)}")
        state = compressor
    else:
        hook_options = {k: options.pop(k) for k in list(options) if k in HOOK_OPTIONS}
        state = GradsiftHookState(None, _resolve_compressor(compressor, options), **hook_options)
    state.attach(ddp_model)
    state.compressor.attach(ddp_model.module)
    ddp_model.register_comm_hook(state, gradsift_hook)
    return state
