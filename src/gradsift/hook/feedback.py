"""Error feedback: what a worker did not send is added to its next gradient.

Per tensor ``key`` the worker keeps a residual ``r`` (zeros at first). Each step:

1. ``compensate``: ``c = g + r`` (``c = g + beta r`` with a residual ``decay`` ``beta < 1``). With DGC's *momentum correction* (``momentum = m > 0``)
   the worker instead keeps a velocity ``u`` and accumulates it:
   ``u <- m*u + g``, ``c = r + u`` -- the optimizer then must run *without* momentum
   (the DDP hook's ``optimizer=`` option arranges that).
2. the compressor encodes ``c`` and the exchange delivers it; ``s`` is the dense tensor
   that this worker's contribution stands for.
3. ``update``: ``r <- c - s``. For a sparse contribution this is ``c`` with the sent
   values subtracted at the sent positions (``index_add_`` of ``-v``): zero there when
   they were sent at full precision, the rounding error when they travelled as
   fp16/bf16 -- so ``c == s + r`` holds bit for bit. A fixed-capacity payload's padding
   (index 0, value 0) subtracts nothing. With momentum correction the velocity is
   masked too (``u[sent] = 0``, DGC's momentum factor masking), unless
   ``momentum_masking=False``.

   *Kept lazily* (momentum correction, a sparse payload, ``update`` without ``c``): the
   caller drops ``c`` once its payload is encoded, and the new residual is made when the
   store's transaction commits, in place in the old one: ``r += u; r[sent] -= v;
   u[sent] = 0`` -- the float operations that made ``c = r + u`` and then ``c - s``, on the
   same operands in the same order, so the same bits. A step then holds the old velocity
   beside the new one, not the old residual beside the new, and ``c`` only while its part
   is encoded; a rolled-back step never runs the change, so ``r`` stays as it was.

   *Kept in the result* (the same, on an exchange that writes its means only once the
   step's flag is known, :attr:`~gradsift.exchanges.base.Exchange.defers_mean`, and once
   ``u`` and ``r`` are stored): ``u' = m u + g`` is written over the bucket's gradient
   instead of a new tensor, ``c = r + u'`` is a new tensor that lives while its part is
   encoded, and at the step's close, before the mean is written over ``u'``, the commit
   runs in place with every write conditioned on the step's flag ``dropped``:
   ``u <- u'``, ``r <- r + u'`` (the kernel that made ``c``), then ``r[sent] -= v``,
   ``u[sent] = 0`` for a sparse payload, or ``r <- c - s`` with ``s`` the payload decoded
   for a code (:meth:`~ErrorFeedback.commit_in_result`). A dropped step leaves both as
   they were, with no host read on a device; a kept one has the bits of the paths above.
   The step then holds nothing parameter-sized beside the stored state but the ``c`` of
   the part being encoded (and, at the close, a code's decoded payload).

Residuals and velocities are kept in float32 at least: a bf16/fp16 gradient is widened
before it is accumulated (``value_dtype`` may still send bf16), so that small updates do
not round away over the steps they wait. Under mixed precision they are kept *unscaled*
(the hook hands ``compensate`` the gradient divided by the loss scale), so a change of
the scale between steps leaves them right.

State lives in a :class:`gradsift.core.store.TensorStore` (tables ``"residual"`` and
``"velocity"``): the instance's own, or one shared with the DDP hook, which makes every
step a transaction and follows DDP's bucket rebuilds. ``compensate`` and ``update`` put
new tensors and never modify a stored one before the commit (the residual kept lazily
changes at the commit, :meth:`~gradsift.core.store.TensorStore.on_commit`),
so a rolled-back step costs nothing.

1-bit Adam's *server* error feedback (the hook option ``server_feedback``) is
:func:`server_stage`: a second residual, table ``"server_residual"``, on the exchange's
mean instead of the worker's input.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.distributed as dist

from gradsift.compressors.base import Compressor, in_use
from gradsift.compressors.kernels import zero_at
from gradsift.core.collectives import blocking, collective_device
from gradsift.core.errors import InvalidOptionError
from gradsift.core.finite import host_value
from gradsift.core.payload import Payload
from gradsift.core.precision import working_dtype
from gradsift.core.readout import Readout
from gradsift.core.store import TensorStore
from gradsift.core.validation import check_real

RESIDUAL, VELOCITY, SERVER_RESIDUAL = "residual", "velocity", "server_residual"


def server_stage(
    store: TensorStore, key: Hashable, mean: torch.Tensor, compressor: Compressor, readout: Readout
) -> None:
    """1-bit Adam's server stage on one part, in place: ``mean`` (``s``, the exchange's mean over
    the workers) becomes ``c = C(s + e)`` and the server residual ``e`` (zeros at first) becomes
    ``s + e - c``, so ``s + e_old == c + e_new`` up to the rounding of the sum.

    ``C`` is ``compressor``'s own encode and decode (for ``onebit``, ``(||x||_2 / sqrt(n)) sign(x)``
    over the part). Every rank holds the same ``s`` and runs this with the same ``e`` (a
    :attr:`~gradsift.compressors.base.Compressor.server_stage` compressor on a
    :attr:`~gradsift.exchanges.base.Exchange.replicated` exchange), so every rank gets the
    same ``c`` without sending a byte; the residual is float32 at least, as the worker's, and
    put new (a dropped step rolls it back).
    """
    flat = mean.float() if mean.dtype in (torch.float16, torch.bfloat16) else mean
    residual = store.get(SERVER_RESIDUAL, key)
    ErrorFeedback._check_like(key, residual, flat)
    target = flat.clone() if residual is None else residual + flat
    payload = compressor.encode(target, key=key, capacity=None, readout=readout)
    sent = compressor.sent_dense(payload).to(target.dtype)
    mean.copy_(sent)
    store.put(SERVER_RESIDUAL, key, target.sub_(sent))


class ErrorFeedback:
    """Residual (and optional DGC velocity) per tensor key.

    Args:
        momentum: DGC momentum-correction factor ``m`` in [0, 1); 0 disables it.
        momentum_masking: zero the velocity where elements were sent (DGC).
        store: where the state lives; None = a store of this instance's own.
        decay: the residual's factor ``beta`` in ``c = g + beta r`` (default 1, plain error
            feedback; SparseLoCo's outer steps use ``beta < 1``).
    """

    def __init__(
        self,
        momentum: float = 0.0,
        momentum_masking: bool = True,
        store: TensorStore | None = None,
        decay: float = 1.0,
    ) -> None:
        self.momentum = check_real(momentum, "momentum", low=0.0, high=1.0, high_open=True)
        self.momentum_masking = bool(momentum_masking)
        self.store = TensorStore() if store is None else store
        self.decay = check_real(decay, "residual_decay", low=0.0, high=1.0)

    @property
    def residuals(self) -> dict[Hashable, torch.Tensor]:
        """The residual per key (a snapshot dict)."""
        return self.store.table(RESIDUAL)

    @property
    def velocities(self) -> dict[Hashable, torch.Tensor]:
        """The DGC velocity per key (a snapshot dict; empty without momentum correction)."""
        return self.store.table(VELOCITY)

    def seed_velocity(self, start: dict[int, torch.Tensor], numels: dict[int, int]) -> None:
        """Start parameter ``i``'s velocity at ``start[i]`` (SGD's momentum buffer, when the
        hook takes momentum over from an optimizer that already stepped): stored under the
        parameter's own key, which the store cuts into the key of whichever part holds the
        parameter at its first step (:meth:`~gradsift.core.store.TensorStore.follow`), which
        drops the per-parameter key once its state lies in the part's."""
        for number, tensor in start.items():
            self.store.follow(number, (number,), numels)
            self.store.put(VELOCITY, number, tensor.reshape(-1).to(working_dtype(tensor.dtype), copy=True))

    def workers_mean(
        self, numels: dict[int, int], group: Any
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """The velocity and the residual per parameter number, each the mean over the workers
        of ``group`` (one allreduce of both: twice the model's ``numels``, a collective every
        rank makes); parameters without one are left out."""
        tables = [self.store.per_parameter(table) for table in (VELOCITY, RESIDUAL)]
        order = sorted(numels)
        device = collective_device(group)
        flat = torch.cat(
            [
                table[n].reshape(-1).to(device, torch.float32)
                if n in table
                else torch.zeros(numels[n], device=device)
                for table in tables
                for n in order
            ]
        )
        blocking("hand-back allreduce", group, lambda: dist.all_reduce(flat, group=group, async_op=True))
        chunks = flat.div_(dist.get_world_size(group)).split([numels[n] for n in order] * 2)
        velocity, residual = (
            {
                n: chunk
                for n, chunk in zip(order, chunks[k * len(order) : (k + 1) * len(order)], strict=True)
                if n in table
            }
            for k, table in enumerate(tables)
        )
        return velocity, residual

    def compensate(
        self, key: Hashable, gradient: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Return the compensated gradient ``c``: a new tensor (float32 or wider), or ``out``
        with ``c`` written into it -- a flat tensor of ``c``'s dtype that the caller no longer
        needs, which may be ``gradient``'s own memory (read before ``c`` is written); else
        ``gradient`` is not modified."""
        flat = gradient.reshape(-1)
        if flat.dtype in (torch.float16, torch.bfloat16):
            flat = flat.float()
        if self.momentum > 0:
            velocity = self.store.get(VELOCITY, key)
            self._check_like(key, velocity, flat)
            velocity = flat.clone() if velocity is None else torch.add(flat, velocity, alpha=self.momentum)
            self.store.put(VELOCITY, key, velocity)
            flat = velocity
        residual = self.store.get(RESIDUAL, key)
        self._check_like(key, residual, flat)
        return self._accumulated(residual, flat, out)

    def _accumulated(
        self, residual: torch.Tensor | None, flat: torch.Tensor, out: torch.Tensor | None
    ) -> torch.Tensor:
        """``r + flat`` (``flat + beta r`` with a ``decay`` below 1; a copy of ``flat`` without a
        residual), into ``out`` when given: one kernel whatever ``out`` is, so the same bits."""
        if residual is None:
            return flat.clone() if out is None else out.copy_(flat)
        if self.decay == 1.0:
            return torch.add(residual, flat, out=out)
        return torch.add(flat, residual, alpha=self.decay, out=out)

    def holds(self, key: Hashable, gradient: torch.Tensor) -> bool:
        """Whether ``key``'s velocity and residual are both stored with ``gradient``'s size and
        dtype (what :meth:`compensate_in_result` updates in place; a bf16 or fp16 gradient's
        state is float32, so never)."""
        stored = [self.store.get(table, key) for table in (VELOCITY, RESIDUAL)]
        return self.momentum > 0 and all(
            t is not None and t.numel() == gradient.numel() and t.dtype == gradient.dtype for t in stored
        )

    def compensate_in_result(
        self, key: Hashable, gradient: torch.Tensor, result: torch.Tensor
    ) -> torch.Tensor:
        """``c = r + u'`` as a new tensor, with the new velocity ``u' = m u + g`` written into
        ``result`` (the part's own gradient memory, which may be ``gradient``) and the stored
        velocity and residual left as they are until :meth:`commit_in_result` (module
        docstring, step 3, kept in the result; :meth:`holds` must be true)."""
        velocity, residual = self.store.get(VELOCITY, key), self.store.get(RESIDUAL, key)
        assert velocity is not None and residual is not None  # holds(key, gradient)
        new_velocity = torch.add(gradient.reshape(-1), velocity, alpha=self.momentum, out=result)
        return self._accumulated(residual, new_velocity, None)

    def commit_in_result(
        self,
        key: Hashable,
        result: torch.Tensor,
        sent: Payload,
        dropped: torch.Tensor | None,
        compressor: Compressor,
    ) -> None:
        """The step's close, before the mean is written over ``result`` (which holds ``u'``):
        unless ``dropped``, ``u <- u'`` and ``r <- r + u'``, then ``r[sent] -= v``, ``u[sent] = 0``
        for a sparse payload, or ``r <- r - s`` with ``s = compressor.sent_dense(sent)`` for
        another (the kernels that made ``c - s``), in place in the stored tensors (None: kept).
        On a GPU each write is a ``torch.where`` on the flag, so nothing waits for the device
        (``result`` then ends holding ``r + u'``, or ``c - s``); in CPU memory the flag is read
        at once (there is no device to wait for) and a dropped step writes nothing.
        """
        velocity, residual = self.store.get(VELOCITY, key), self.store.get(RESIDUAL, key)
        assert velocity is not None and residual is not None  # compensate_in_result's
        held = None if dropped is None else host_value(dropped)
        if held:
            return
        if held is not None:
            dropped = None
        sparse = sent.indices is not None and sent.codes is None
        if dropped is None:  # kept: straight into the stored tensors
            velocity.copy_(result)
            kept = self._accumulated(residual, result, residual)
        else:  # ``result`` is the scratch the gated writes read from
            torch.where(dropped, velocity, result, out=velocity)
            kept = self._accumulated(residual, result, result)
        if not sparse:  # the residual as the kept path makes it: ``c - s``
            kept.sub_(compressor.sent_dense(sent).to(kept.dtype))
        if dropped is not None:
            torch.where(dropped, residual, kept, out=residual)
        if sparse:
            self._subtract_sent(residual, velocity, sent, dropped)

    def keeps_lazily(self, compressor: Compressor) -> bool:
        """Whether :meth:`update` can keep ``compressor``'s residual without the compensated
        gradient (module docstring, step 3): with momentum correction (``c = r + u``, ``u``
        stored) and a sparse payload (what was sent is its values at its positions)."""
        return self.momentum > 0 and compressor.sparse

    def update(
        self,
        key: Hashable,
        compensated: torch.Tensor | None,
        sent: Payload | torch.Tensor,
        compressor: Compressor | None = None,
    ) -> None:
        """Keep what was not sent: ``r <- c - s``.

        ``sent`` is what this worker's contribution stands for: a payload with
        ``indices`` and ``values`` (``compensated``, which is consumed, keeps ``c - v``
        at those positions), another payload -- codes at positions included (decoded
        with ``compressor.sent_dense``) -- or a dense tensor. ``compensated`` None: the
        residual is kept lazily (module docstring, step 3; :meth:`keeps_lazily`), made from
        the stored residual and velocity and ``sent`` when the store's transaction commits.
        """
        sparse = (
            sent if isinstance(sent, Payload) and sent.indices is not None and sent.codes is None else None
        )
        if compensated is None:
            if sparse is None or self.momentum == 0:
                raise InvalidOptionError(
                    "update() without the compensated gradient needs momentum correction and a sparse payload"
                )
            self._keep_lazily(key, sparse)
            return
        residual = compensated  # compensate() returned a fresh tensor: its memory becomes the residual
        if sparse is not None:
            self._subtract_sent(residual, self.store.get(VELOCITY, key), sparse)
        elif isinstance(sent, torch.Tensor):
            residual.sub_(sent.reshape(-1).to(residual.dtype))
        else:
            if compressor is None:
                raise InvalidOptionError("update() needs the compressor to decode a payload without indices")
            residual.sub_(compressor.sent_dense(sent).to(residual.dtype))
        self.store.put(RESIDUAL, key, residual)

    def _keep_lazily(self, key: Hashable, sent: Payload) -> None:
        """At the store's commit: ``r <- r + u`` in the stored residual (a copy of ``u`` without
        one), then :meth:`_subtract_sent`, with this step's velocity ``u`` -- the operands
        :meth:`compensate` added, whatever replaces the velocity before the commit."""
        residual, velocity = self.store.get(RESIDUAL, key), self.store.get(VELOCITY, key)
        assert velocity is not None  # compensate() put it this step

        def keep() -> None:
            kept = self._accumulated(residual, velocity, residual)
            self._subtract_sent(kept, velocity, sent)
            self.store.put(RESIDUAL, key, kept)

        self.store.on_commit(keep)

    def _subtract_sent(
        self,
        residual: torch.Tensor,
        velocity: torch.Tensor | None,
        sent: Payload,
        dropped: torch.Tensor | None = None,
    ) -> None:
        """``residual[i] -= v`` at the sparse payload's positions (``= 0`` for positions only:
        everything there was sent); with momentum masking, ``velocity[i] = 0`` there (the
        velocity :meth:`compensate` put this step, or the stored one at
        :meth:`commit_in_result`: ours to modify). Nothing changes where ``dropped`` holds
        (``x - 0`` is ``x``, bit for bit)."""
        indices = sent.indices
        assert indices is not None
        used = in_use(indices.numel(), sent.length, indices.device)
        if dropped is not None:
            used = ~dropped if used is None else used & ~dropped
        if sent.values is None:
            zero_at(residual, indices, used)
        else:
            values = sent.values.to(residual.dtype)
            residual.index_add_(
                0, indices, values if dropped is None else torch.where(dropped, 0, values), alpha=-1
            )
        if velocity is not None and self.momentum > 0 and self.momentum_masking:
            zero_at(velocity, indices, used)

    def reset(self, key: Hashable | None = None) -> None:
        """Forget the state of one key, or of every key."""
        tables = (RESIDUAL, VELOCITY)
        keys = {k for table in tables for k in self.store.table(table)} if key is None else {key}
        for stale in keys:
            self.store.discard(stale, tables)

    def state_dict(self) -> dict[str, Any]:
        """Residuals and velocities by key (tensors are cloned)."""
        return {
            "momentum": self.momentum,
            "residuals": {k: v.clone() for k, v in self.residuals.items()},
            "velocities": {k: v.clone() for k, v in self.velocities.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if float(state.get("momentum", self.momentum)) != self.momentum:
            raise InvalidOptionError(
                f"checkpoint was made with momentum={state['momentum']}, this feedback has {self.momentum}"
            )
        self.reset()
        for table, name in ((RESIDUAL, "residuals"), (VELOCITY, "velocities")):
            for key, tensor in state[name].items():
                self.store.put(table, key, tensor.clone())

    @staticmethod
    def _check_like(key: Hashable, stored: torch.Tensor | None, flat: torch.Tensor) -> None:
        if stored is not None and (stored.shape != flat.shape or stored.dtype != flat.dtype):
            raise InvalidOptionError(
                f"tensor {key!r} changed from {tuple(stored.shape)}/{stored.dtype} to "
                f"{tuple(flat.shape)}/{flat.dtype}; call reset({key!r}) when a bucket is rebuilt"
            )
