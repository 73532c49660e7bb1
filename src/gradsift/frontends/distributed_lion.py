"""Distributed Lion (Liu et al. 2024): every worker's Lion update sent in one bit per element.

``optimizer = gradsift.DistributedLion(model.parameters(), lr=1e-4)`` for a model that is
*not* wrapped in DDP (or that runs its backward inside ``ddp.no_sync()``): each worker's
gradients stay its own, and the step is the exchange. Every :meth:`DistributedLion.step`,
for every parameter ``theta`` of a group with ``lr``, ``betas = (beta1, beta2)`` and
``weight_decay``, worker ``k`` of ``W`` (gradient ``g_k``, its own momentum ``m_k``):

1. Lion's update direction: ``u_k = sign(beta1 m_k + (1 - beta1) g_k)``, every element one of
   two values so that it fits one bit (bit 1 for ``+1``, bit 0 for ``-1``): ``sign(0)`` is
   ``+1`` where ``k + t`` is even (``t`` the step count) and ``-1`` where it is odd, so an
   element no worker moves (a parameter without a gradient, an embedding row never seen: a
   zero direction everywhere) sums to 0 over an even number of workers and to ``+1``, ``-1``
   in turn over an odd one, where one sign for all would step it by ``lr`` every step;
2. the message: the bits of every parameter in order, packed eight to a byte
   (:func:`gradsift.compressors.bitpack.pack`), then one byte, 1 when some gradient of this
   worker holds a NaN or an Inf (:func:`gradsift.core.finite.nonfinite`), else 0;
3. one all-gather of every worker's message, and the aggregate, with ``S = sum_k u_k``
   (``2 n_+ - W`` for ``n_+`` workers sending ``+1``):
   ``aggregate="vote"`` (default): ``U = sign(S)``, a tie (even ``W``) giving 0;
   ``aggregate="average"``: ``U = S / W``, in ``[-1, 1]``;
4. the momentum: ``m_k = beta2 m_k + (1 - beta2) g_k``;
5. the step, with Lion's decoupled weight decay: ``theta = theta - lr (U + weight_decay theta)``,
   computed as ``theta (1 - lr weight_decay) - lr U``.

Non-finite gradients: when any worker's flag is set, every rank skips the step alike -- no
parameter and no momentum moves, ``stats()["step"]["skipped"]`` is True and the total's
``skipped_steps`` counts it -- and logs a warning naming the ranks; the next step goes on
from the state before. Reading the flags is the step's one host read.

Bytes: a worker sends ``ceil(n / 8) + 1`` bytes per step for ``n`` elements, one bit per
element from the first step (no dense warm-up), against the ``4 n`` of an fp32 gradient,
and receives ``(W-1)`` such messages (an all-gather's: the bytes received grow with
``W``). Every rank adds the same integers, so the ranks hold the same parameters bit for
bit; every rank starts from rank 0's parameters (one broadcast each at construction), and
ranks built with other settings stop there (:class:`~gradsift.core.errors.SettingsMismatchError`).
A worker that dies makes the others raise :class:`~gradsift.core.errors.PeerFailureError`
within the process group's timeout. Every parameter with ``requires_grad`` takes part in
every step (a missing ``.grad`` counts as zero), so the messages of all workers have one
layout. ``state_dict()`` holds every parameter's momentum, the groups, the step count and
the byte totals: a run resumes bit for bit.

Settings: Lion's (Chen et al. 2023) ``betas = (0.9, 0.99)``; its learning rate is typically
three to ten times below AdamW's and its weight decay three to ten times above (so that
``lr weight_decay``, the decay per step, stays AdamW's): the defaults ``lr = 1e-4`` (a tenth
of ``torch.optim.AdamW``'s default) and ``weight_decay = 0`` (as torch's optimizers) are a
start, not a tuned setting.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradsift.compressors.bitpack import pack, packed_nbytes, unpack
from gradsift.core.agreement import setting_text
from gradsift.core.errors import InvalidOptionError, InvalidTensorError
from gradsift.core.exchanging import ExchangingOptimizer, parse_options
from gradsift.core.finite import nonfinite
from gradsift.core.telemetry import BucketRecord
from gradsift.core.validation import check_choice, check_real

logger = logging.getLogger(__name__)

#: How the workers' signs make the step: their majority (a tie gives 0) or their mean.
AGGREGATES = ("vote", "average")


@dataclass(frozen=True)
class LionOptions:
    """Distributed Lion's settings shared by every parameter group.

    Attributes:
        aggregate: ``"vote"`` (default: ``sign(sum_k u_k)``, a tie giving 0) or ``"average"``
            (``mean_k u_k``).
    """

    aggregate: str = "vote"

    def __post_init__(self) -> None:
        check_choice(self.aggregate, "aggregate", AGGREGATES)

    @classmethod
    def parse(cls, options: dict[str, Any]) -> LionOptions:
        """The settings from keyword ``options``; an unknown name raises, listing the known ones."""
        return parse_options(cls, options, "DistributedLion")

    def describe(self) -> dict[str, Any]:
        """The settings as plain JSON types."""
        return asdict(self)


def check_betas(betas: object) -> tuple[float, float]:
    """``betas`` as two numbers in ``[0, 1)``: Lion's ``(beta1, beta2)``."""
    if not isinstance(betas, Sequence) or isinstance(betas, str) or len(betas) != 2:
        raise InvalidOptionError(f"betas must be two numbers (beta1, beta2), got {betas!r}")
    beta1, beta2 = (check_real(beta, "betas", low=0.0, high=1.0, high_open=True) for beta in betas)
    return beta1, beta2


class DistributedLion(ExchangingOptimizer, method="DistributedLion", key="lion"):
    """Distributed Lion's optimizer (see the module docstring); ``lr``, ``betas`` and
    ``weight_decay`` per parameter group, the settings of :class:`LionOptions` for all
    (``aggregate='vote'``). ``process_group``: the workers (default: the world when
    ``torch.distributed`` is initialised, else this process alone, which needs no
    collective). The parameters, the agreement, the all-gather, the telemetry and the
    checkpoint are :class:`gradsift.core.exchanging.ExchangingOptimizer`'s.

    Example::

        optimizer = gradsift.DistributedLion(model.parameters(), lr=1e-4, weight_decay=1.0)
        loss.backward(); optimizer.step(); optimizer.stats()["step"]["bytes_received"]
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        process_group: Any = None,
        **options: Any,
    ) -> None:
        self.options = LionOptions.parse(options)
        defaults = {"lr": lr, "betas": check_betas(betas), "weight_decay": weight_decay}
        super().__init__(params, defaults, process_group)
        self.message_bytes = packed_nbytes(self.numel, 1) + 1  # the bits, then the non-finite flag
        self.elements_sent = [p.numel() for p in self.params]
        self.start()  # collective: the ranks agree and take rank 0's parameters

    def settings(self) -> dict[str, str]:
        """What every rank's Distributed Lion must share: its options, the groups and the
        parameters' layout."""
        options = {name: setting_text(value) for name, value in self.options.describe().items()}
        return {**options, **super().settings()}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group while the optimizer is built (its ``betas`` checked too)."""
        if "betas" in param_group:
            param_group["betas"] = check_betas(param_group["betas"])
        super().add_param_group(param_group)

    # -- the step -----------------------------------------------------------------------------
    def exchange(self, record: BucketRecord, device: torch.device) -> bool:
        """One Distributed Lion step on every parameter (steps 1-5 of the module docstring),
        or, skipped, none on any rank when a worker's gradient is not finite."""
        groups = {p: g for g in self.param_groups for p in g["params"]}
        with record.timed("compress_ms", device):
            grads = self._gradients()
            message = self._message(grads, groups)
        with record.timed("communicate_ms", device):
            rows = self.gather(message)
        with record.timed("decompress_ms", device):
            flags = torch.stack([row[-1] for row in rows]).tolist()  # the step's one host read
            flagged = [rank for rank, flag in enumerate(flags) if flag]
            if flagged:
                logger.warning(
                    "DistributedLion step %d skipped: rank(s) %s had a NaN or Inf gradient; no parameter "
                    "and no momentum moved, on any rank",
                    self.steps,
                    flagged,
                )
            else:
                self._update(grads, groups, self._sum_of_signs([row[:-1] for row in rows]))
        return bool(flagged)

    def _gradients(self) -> list[torch.Tensor]:
        """Every parameter's gradient (zeros for one without ``.grad``)."""
        grads = []
        for param in self.params:
            grad = param.grad
            if grad is not None and grad.is_sparse:
                raise InvalidTensorError("DistributedLion does not take sparse gradients")
            grads.append(torch.zeros_like(param) if grad is None else grad)
        return grads

    def _momentum(self, param: torch.Tensor) -> torch.Tensor:
        """The parameter's momentum; zeros (not yet kept) before its first step."""
        momentum = self.state[param].get("momentum")
        return torch.zeros_like(param, memory_format=torch.preserve_format) if momentum is None else momentum

    def _message(self, grads: list[torch.Tensor], groups: dict[torch.Tensor, Any]) -> torch.Tensor:
        """This worker's message: the bits of ``u_k = +1`` of every parameter (``sign(0)`` by the
        parity of rank and step, step 1 of the module docstring), packed, then its non-finite flag."""
        rank = dist.get_rank(self.process_group) if dist.is_initialized() else 0
        zero_up = (rank + self.steps) % 2 == 0
        bits = []
        for param, grad in zip(self.params, grads, strict=True):
            beta1 = groups[param]["betas"][0]
            direction = torch.mul(self._momentum(param), beta1).add_(grad, alpha=1 - beta1).reshape(-1)
            bits.append(direction >= 0 if zero_up else direction > 0)
        flag = nonfinite(*grads).to(torch.uint8).reshape(1)
        return torch.cat([pack(torch.cat(bits).to(torch.uint8), 1), flag])

    def _sum_of_signs(self, bits: list[torch.Tensor]) -> torch.Tensor:
        """``S = sum_k u_k`` per element (int64), from every worker's packed bits (rank order):
        ``2 n_+ - W``, with ``n_+`` the count of set bits."""
        ones = unpack(bits[0], 1, self.numel).to(torch.int64)
        for row in bits[1:]:
            ones += unpack(row, 1, self.numel)
        return ones.mul_(2).sub_(self.world)

    def _update(
        self, grads: list[torch.Tensor], groups: dict[torch.Tensor, Any], total: torch.Tensor
    ) -> None:
        """The aggregate ``U`` from ``S`` (a vote or the mean), the momentum, and the step with
        decoupled weight decay, parameter by parameter."""
        start = 0
        for param, grad in zip(self.params, grads, strict=True):
            group = groups[param]
            own = total[start : start + param.numel()].view(param.shape).to(param.dtype)
            start += param.numel()
            step = own.sign_() if self.options.aggregate == "vote" else own.div_(self.world)
            beta2 = group["betas"][1]
            self.state[param]["momentum"] = self._momentum(param).mul_(beta2).add_(grad, alpha=1 - beta2)
            if group["weight_decay"]:
                param.mul_(1.0 - group["lr"] * group["weight_decay"])
            param.add_(step, alpha=-group["lr"])
