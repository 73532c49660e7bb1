"""signSGD and EF-signSGD: one bit per element plus the scale ``||g||_1 / n``."""

from __future__ import annotations

import torch

from gradsift.compressors.quantization import Quantizer, compute_dtype


class SignSGD(Quantizer):
    """``signsgd`` (Bernstein et al. 2018): send ``sign(g_i)`` as one bit and ``||g||_1 / n``.

    The worker's contribution is ``(||g||_1 / n) sign(g)`` (``sign(0) = +1``: one bit has
    no zero); the aggregate is the mean of the workers' contributions (not the
    paper's majority vote, which would discard the scales). Biased and, without error
    feedback, not guaranteed to converge (Karimireddy et al. 2019): ``efsignsgd`` fixes that.
    """

    name = "signsgd"
    code_bits = 1

    def quantize(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        l1 = torch.linalg.vector_norm(flat, ord=1, dtype=compute_dtype(flat.dtype)).reshape(1)
        return (flat < 0).to(torch.uint8), l1 / flat.numel()

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        signs = (1 - 2 * codes).to(dtype)  # 0 -> +1, 1 -> -1
        return signs.mul_(scales.to(dtype))


class EFSignSGD(SignSGD):
    """``efsignsgd`` (Karimireddy et al. 2019): signSGD with error feedback.

    Same payload; the DDP hook wraps it with :class:`gradsift.hook.feedback.ErrorFeedback`,
    so each worker sends ``(||p||_1 / n) sign(p)`` of ``p = g + e`` and keeps
    ``e <- p - (||p||_1 / n) sign(p)``.
    """

    name = "efsignsgd"
    error_feedback = True
