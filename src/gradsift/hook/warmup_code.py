"""A frozen-variance Adam method's warm-up in a code, instead of stock DDP's fp32 allreduce.

The warm-up gives Adam its moments from the mean gradient (:mod:`gradsift.hook.adam`, step 1),
so every coordinate has to arrive every step: the code is a deterministic quantizer (every
coordinate in fewer bits; ``blockquant``'s 4-bit codes by default), never a sparsifier. Per
part, plain error feedback on the gradient, in the worker's residual table:

    c = g / s + r,     sent = Q(c),     r <- c - sent,     mean = s * (sum_k sent_k) / W

with ``s`` the loss scale (1 without a scaler); the optimizer steps on ``mean`` as built,
its own weight decay included (the hook adds none). At the first compressed step the
method's error feedback starts from the same residual: what the code has not delivered yet
is gradient mass, which enters the velocity ``c = r + u`` like any gradient.

Bytes: a warm-up of ``w`` steps in ``b``-bit codes, then ``n - w`` steps of a ``q``-bit
method, sends ``(w b + (n - w) q) / (32 n)`` of fp32's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gradsift.compressors.base import Compressor
from gradsift.compressors.quantization import Quantizer
from gradsift.compressors.registry import available_compressors, compressor_class, get_compressor
from gradsift.core.errors import InvalidOptionError
from gradsift.core.store import TensorStore
from gradsift.exchanges import AUTO
from gradsift.exchanges.base import Codec, Exchange
from gradsift.exchanges.choice import resolve_exchange
from gradsift.hook.adam import AdamStep, FrozenVarianceStep
from gradsift.hook.feedback import ErrorFeedback
from gradsift.hook.variance_refresh import refuse_unsupported

if TYPE_CHECKING:
    from gradsift.hook.options import HookOptions

#: Why the code must be a deterministic quantizer.
NOT_A_CODE = (
    "warmup_compressor= codes the dense warm-up of a frozen-variance Adam method, which gives "
    "Adam's second moment its values: every coordinate must arrive every step, the same on "
    "every rank after a resume, so it takes a deterministic quantizer ({able}); got {name!r}"
)

#: Why the option is refused without a frozen-variance Adam method.
NEEDS_FROZEN_ADAM = (
    "warmup_compressor= codes the dense warm-up of a frozen-variance Adam method "
    "(optimizer= an Adam or AdamW, found or given, with adam='frozen-variance' or 'onebit'); "
    "this hook runs {running}: drop warmup_compressor=, or pass the Adam optimizer"
)


def refuse_without_frozen_adam(adam: AdamStep | None, compressor: Compressor, options: HookOptions) -> None:
    """Raise :data:`NEEDS_FROZEN_ADAM` where ``options`` code a warm-up without a frozen-variance
    method, and what :func:`~gradsift.hook.variance_refresh.refuse_unsupported` raises."""
    refuse_unsupported(adam, options.variance_refresh)
    if options.warmup_compressor is not None and not isinstance(adam, FrozenVarianceStep):
        running = f"{compressor.name!r} without an Adam optimizer" if adam is None else "adam='update'"
        raise InvalidOptionError(NEEDS_FROZEN_ADAM.format(running=running))


def is_code(kind: type) -> bool:
    """Whether compressors of class ``kind`` may code a warm-up: quantizers (every coordinate)
    whose encode is deterministic and stateless (:attr:`Compressor.server_stage`)."""
    return issubclass(kind, Quantizer) and kind.server_stage


@dataclass
class CodedWarmup:
    """The warm-up's code, its exchange and its plain error feedback, on the hook's store (so
    a checkpoint holds the residuals, a dropped step rolls them back, and the code sees the
    bucket's parameters in number order after a resume as before it)."""

    compressor: Compressor
    exchange: Exchange
    codec: Codec
    feedback: ErrorFeedback

    @property
    def route(self) -> tuple[Exchange, Codec]:
        """How the warm-up's gradients travel: the code's exchange and codec."""
        return self.exchange, self.codec

    @classmethod
    def build(cls, code: str | Compressor, store: TensorStore, exchange: str = AUTO) -> CodedWarmup:
        """The warm-up for ``code`` (a registry name with its default options, or an instance),
        its residuals in ``store``, travelling by the hook's ``exchange`` (``"auto"``: the
        code's own); refused unless :func:`is_code`."""
        compressor = get_compressor(code) if isinstance(code, str) else code
        if not isinstance(compressor, Compressor) or not is_code(type(compressor)):
            able = ", ".join(n for n in available_compressors() if is_code(compressor_class(n)))
            raise InvalidOptionError(NOT_A_CODE.format(able=able, name=getattr(compressor, "name", code)))
        compressor.bind_store(store)  # codes in the parameters' order, whatever DDP's layout
        feedback = ErrorFeedback(0.0, False, store)
        return cls(compressor, resolve_exchange(compressor, exchange), Codec(compressor), feedback)
