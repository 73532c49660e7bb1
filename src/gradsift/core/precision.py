"""The one dtype rule for arithmetic on gradient values: widen 16-bit floats to float32.

A compressor's statistics and scales, an error feedback's residual and velocity, a clipping
norm and DeMo's transform all run in ``working_dtype(d) = promote(d, float32)``: float32 for
fp16 and bf16 (their 8- or 11-bit mantissas lose the small terms a running sum or a fit
adds), and the values' own dtype where it is float32 or wider (float64 stays float64, so a
float64 run is not rounded through float32).
"""

from __future__ import annotations

import torch


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype arithmetic on values of ``dtype`` runs in: float32 for 16-bit floats, else ``dtype``."""
    return torch.promote_types(dtype, torch.float32)
