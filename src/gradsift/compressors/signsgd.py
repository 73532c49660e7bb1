"""signSGD, EF-signSGD and 1-bit Adam's compressor: one bit per element plus one scale
(``||g||_1 / n`` for the first two, ``||g||_2 / sqrt(n)`` for 1-bit Adam's)."""

from __future__ import annotations

import math

import torch

from gradsift.compressors.quantization import Quantizer
from gradsift.core.precision import working_dtype


class SignSGD(Quantizer):
    """``signsgd`` (Bernstein et al. 2018): send ``sign(g_i)`` as one bit and ``||g||_1 / n``.

    The worker's contribution is ``(||g||_1 / n) sign(g)`` (``sign(0) = +1``: one bit has
    no zero); the aggregate is the mean of the workers' contributions (not the
    paper's majority vote, which would discard the scales). Biased and, without error
    feedback, not guaranteed to converge (Karimireddy et al. 2019): ``efsignsgd`` fixes that.
    """

    name = "signsgd"
    code_bits = 1
    server_stage = True  # deterministic, stateless, the same on every rank
    exchanges = ("allgather", "two-stage")

    def quantize(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (flat < 0).view(torch.uint8), self.scale(flat)  # the mask's bytes are its 0 and 1 codes

    def scale(self, flat: torch.Tensor) -> torch.Tensor:
        """The one scale of the non-empty ``flat`` (shape ``[1]``): ``||g||_1 / n``."""
        l1 = torch.linalg.vector_norm(flat, ord=1, dtype=working_dtype(flat.dtype)).reshape(1)
        return l1 / flat.numel()

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        signs = codes.to(dtype).mul_(-2).add_(1)  # 0 -> +1, 1 -> -1
        return signs.mul_(scales.to(dtype))


class EFSignSGD(SignSGD):
    """``efsignsgd`` (Karimireddy et al. 2019): signSGD with error feedback.

    Same payload; the DDP hook wraps it with :class:`gradsift.hook.feedback.ErrorFeedback`,
    so each worker sends ``(||p||_1 / n) sign(p)`` of ``p = g + e`` and keeps
    ``e <- p - (||p||_1 / n) sign(p)``.
    """

    name = "efsignsgd"
    error_feedback = True


class OneBit(EFSignSGD):
    """``onebit``: 1-bit Adam's compressor (Tang et al. 2021), ``C(x) = (||x||_2 / sqrt(n)) sign(x)``.

    The payload of ``signsgd`` with another scale: the root mean square of ``x`` instead of
    its mean magnitude (``||x||_1 / n <= ||x||_2 / sqrt(n)``, equal when every ``|x_i|`` is
    the same), so ``||C(x)||_2 = ||x||_2``. With error feedback on the worker, as
    ``efsignsgd``; the hook option ``server_feedback=True`` adds 1-bit Adam's second
    residual after the average (:func:`gradsift.hook.feedback.server_stage`).
    """

    name = "onebit"

    def scale(self, flat: torch.Tensor) -> torch.Tensor:
        """``||x||_2 / sqrt(n)`` (shape ``[1]``)."""
        l2 = torch.linalg.vector_norm(flat, ord=2, dtype=working_dtype(flat.dtype)).reshape(1)
        return l2 / math.sqrt(flat.numel())
