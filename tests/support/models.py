"""The models, batches and samples the tests train and compare.

:func:`make_model` builds every small MLP of the suite; its defaults are the model of the
DDP problem most hook tests share (:data:`IN` -> :data:`HIDDEN` -> :data:`OUT`, trained by
:func:`train` on :func:`batch`, compared by :func:`flat_params`). :func:`hook_state` and
:func:`same` compare what a step must leave as it was; :func:`laplace` draws the
heavy-tailed gradients the compressor tests select from.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsift

IN, HIDDEN, OUT, BATCH = 12, 16, 3, 8
# numels in parameter order: 192, 16, 48, 3 -> 259 in one bucket
NUMELS = [HIDDEN * IN, HIDDEN, OUT * HIDDEN, OUT]


def make_model(
    widths: Sequence[int] = (IN, HIDDEN, OUT), *, seed: int = 1234, bias: bool = True
) -> torch.nn.Module:
    """Linear layers ``widths[i] -> widths[i + 1]`` with a Tanh between two, initialised after
    ``torch.manual_seed(seed)``: one layer is a bare ``Linear``, more a ``Sequential``."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for fan_in, fan_out in pairwise(widths):
        if layers:
            layers.append(torch.nn.Tanh())
        layers.append(torch.nn.Linear(fan_in, fan_out, bias=bias))
    return layers[0] if len(layers) == 1 else torch.nn.Sequential(*layers)


# -- the shared DDP problem ---------------------------------------------------------------------
def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, OUT, generator=gen)


def loss_of(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    """The tests' loss: mean squared error on worker ``rank``'s batch of ``step``."""
    x, y = batch(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def flat_gradients(model: torch.nn.Module, rank: int, step: int) -> list[torch.Tensor]:
    """Each parameter's flat gradient of :func:`loss_of` (the model's gradients zeroed first)."""
    model.zero_grad()
    loss_of(model, rank, step).backward()
    return [p.grad.detach().reshape(-1).clone() for p in model.parameters()]


def train(model: DDP, rank: int, steps: range, lr: float = 0.1, micro: int = 1) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in steps:
        opt.zero_grad()
        for m in range(micro):
            x, y = batch(rank, step * micro + m)
            if m < micro - 1:
                with model.no_sync():
                    torch.nn.functional.mse_loss(model(x), y).backward()
            else:
                torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def hooked(compressor, **options) -> tuple[DDP, gradsift.hook.state.GradsiftHookState]:
    model = DDP(make_model())
    return model, gradsift.register_comm_hook(model, compressor, **options)


# -- what a dropped step must leave as it was ---------------------------------------------------
def hook_state(state) -> dict:
    """Everything a dropped step must leave as it was (telemetry totals do count the step)."""
    saved = state.state_dict()
    del saved["telemetry"]
    return saved


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


# -- samples --------------------------------------------------------------------------------------
def laplace(n: int, seed: int, dtype: torch.dtype = torch.float32, *, by: str) -> torch.Tensor:
    """``n`` standard Laplace samples, reproducible from ``seed``, drawn ``by`` one of two
    recipes that give different numbers for one seed (a test file keeps the recipe its
    expectations were written against): ``"inverse_cdf"`` maps float64 uniforms through the
    inverse CDF; ``"signed_exponential"`` gives float64 exponentials random signs."""
    generator = torch.Generator().manual_seed(seed)
    if by == "inverse_cdf":
        uniform = torch.rand(n, generator=generator, dtype=torch.float64) - 0.5
        return (-torch.sign(uniform) * torch.log1p(-2 * uniform.abs())).to(dtype)
    if by == "signed_exponential":
        x = torch.empty(n, dtype=torch.float64).exponential_(generator=generator)
        return (x * (torch.randint(0, 2, (n,), generator=generator) * 2 - 1)).to(dtype)
    raise ValueError(f"laplace(by={by!r}): expected 'inverse_cdf' or 'signed_exponential'")
