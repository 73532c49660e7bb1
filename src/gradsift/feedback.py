"""Error feedback: what a worker did not send is added to its next gradient.

Per tensor ``key`` the worker keeps a residual ``r`` (zeros at first). Each step:

1. ``compensate``: ``c = g + r``. With DGC's *momentum correction* (``momentum = m > 0``)
   the worker instead keeps a velocity ``u`` and accumulates it:
   ``u <- m*u + g``, ``c = r + u`` -- the optimizer then must run *without* momentum.
2. the compressor encodes ``c``; ``s`` is the dense tensor its payload stands for.
3. ``update``: ``r <- c - s``. For a sparsifier this is ``c`` with the sent positions
   set to zero, so ``c == s + r`` holds bit for bit (every element is in exactly one
   of the two). With momentum correction the velocity is masked too
   (``u[sent] = 0``, DGC's momentum factor masking), unless ``momentum_masking=False``.

State lives in the instance, one entry per key, and round-trips through
``state_dict()`` / ``load_state_dict()``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from gradsift.compressors.base import Compressor, Payload
from gradsift.errors import InvalidOptionError
from gradsift.validation import check_real


class ErrorFeedback:
    """Residual (and optional DGC velocity) per tensor key.

    Args:
        momentum: DGC momentum-correction factor ``m`` in [0, 1); 0 disables it.
        momentum_masking: zero the velocity where elements were sent (DGC).
    """

    def __init__(self, momentum: float = 0.0, momentum_masking: bool = True) -> None:
        self.momentum = check_real(momentum, "momentum", low=0.0, high=1.0, high_open=True)
        self.momentum_masking = bool(momentum_masking)
        self.residuals: dict[Hashable, torch.Tensor] = {}
        self.velocities: dict[Hashable, torch.Tensor] = {}

    def compensate(self, key: Hashable, gradient: torch.Tensor) -> torch.Tensor:
        """Return the compensated gradient ``c`` (a new tensor; ``gradient`` is not modified)."""
        flat = gradient.reshape(-1)
        if self.momentum > 0:
            velocity = self.velocities.get(key)
            velocity = flat.clone() if velocity is None else velocity.mul_(self.momentum).add_(flat)
            self.velocities[key] = velocity
            flat = velocity
        residual = self.residuals.get(key)
        if residual is None:
            return flat.clone()
        if residual.shape != flat.shape or residual.dtype != flat.dtype:
            raise InvalidOptionError(
                f"tensor {key!r} changed from {tuple(residual.shape)}/{residual.dtype} to "
                f"{tuple(flat.shape)}/{flat.dtype}; call reset({key!r}) when a bucket is rebuilt"
            )
        return residual + flat

    def update(
        self, key: Hashable, compensated: torch.Tensor, payload: Payload, compressor: Compressor
    ) -> None:
        """Keep what was not sent: ``r <- c - s`` (exactly ``c`` with sent positions zeroed for sparsifiers)."""
        if payload.indices is not None:
            residual = compensated  # compensate() returned a fresh tensor: reuse its memory
            residual.index_fill_(0, payload.indices, 0)
            if self.momentum > 0 and self.momentum_masking:
                self.velocities[key].index_fill_(0, payload.indices, 0)
        else:
            residual = compensated - compressor.sent_dense(payload).to(compensated.dtype)
        self.residuals[key] = residual

    def reset(self, key: Hashable | None = None) -> None:
        """Forget the state of one key, or of every key."""
        if key is None:
            self.residuals.clear()
            self.velocities.clear()
        else:
            self.residuals.pop(key, None)
            self.velocities.pop(key, None)

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
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}
        self.velocities = {k: v.clone() for k, v in state["velocities"].items()}
