"""Per-sample second moments of gradients, computed during the ordinary backward pass.

Notation: a minibatch of ``B`` samples; autograd's gradient of a parameter element is
``G = sum_z a_z``, where ``a_z`` is sample ``z``'s contribution *as autograd sees it*:
``a_z = g_z / B`` for a mean-reduced loss (``g_z`` the per-sample loss gradient) and
``a_z = g_z`` for a summed loss. The hooks compute ``Q = sum_z a_z^2`` without forming
any ``a_z`` and, from it, the variance of ``G`` itself (1/B convention, clamped at 0)::

    s = clamp(Q - G^2 / B, min=0)  =  B * ((1/B) sum_z a_z^2 - (G/B)^2)

For a mean loss this is ``(1/B) * ((1/B) sum_z g_z^2 - g^2)``, the variance of the
minibatch mean gradient; for a summed loss it is ``B^2`` times that, i.e. always the
variance of the gradient tensor autograd actually produced. So the loss reduction needs
no option: ``Q`` and ``G`` carry the same factor. (The biased 1/B form is used, not
1/(B-1): with ``B = 1`` it gives 0 instead of dividing by zero.)

Rules, per call of a supported module (input ``x``, output gradient ``d``, batch dim 0):

* ``nn.Linear``: weight ``Q = (d*d)^T (x*x)`` over the rows of ``x`` flattened to
  ``(-1, in)`` -- exact when every row is one sample (2-D input); with extra leading
  dims (sequences) the cross-position terms are dropped, as for convolutions.
  Bias: ``Q = sum_z (sum_p d_{z,p})^2`` -- exact for any leading shape.
* ``nn.Conv1d/2d/3d``: weight ``Q ~= sum_z sum_p d_{z,p}^2 x_{z,p+k}^2`` -- the ordinary
  weight-gradient convolution applied to ``x*x`` and ``d*d`` (drops the cross-position
  terms of the square of ``sum_p``). Bias: exact, ``sum_z (sum_p d_{z,p})^2``.
* A module called several times in one forward (a recurrent cell built from Linear
  layers) adds the rule of every call: ``sum_t`` of the per-step ``Q`` -- the same
  cross-term approximation, across time steps.

Parameters of any other module (BatchNorm, Embedding, LayerNorm, ...) get no ``Q``:
:meth:`VarianceTracker.unsupported_parameters` lists them, and VGC treats their variance
as 0 (they are sent whenever non-zero, i.e. dense).

Ordering: the hooks are tensor hooks on each module *output*; autograd runs them when
that output's gradient is complete, before the module's backward node computes the
weight gradient, and a parameter's gradient is accumulated (which is what makes a DDP
bucket ready) only after every use of it has run. So ``Q`` is complete before any
communication hook can read it.

Opt-in exact path for small models: ``VarianceTracker(model, method="exact")`` installs
no hooks; call :meth:`VarianceTracker.record_exact` each step, which uses
``torch.func.vmap(grad(...))`` (``B * |theta|`` memory) for every parameter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.grad import conv1d_weight, conv2d_weight, conv3d_weight

from gradsift.core.bucket_order import flat_like, shaped_like
from gradsift.core.errors import InvalidTensorError
from gradsift.core.validation import check_choice

_CONV_WEIGHT_GRAD = {
    nn.Conv1d: conv1d_weight,
    nn.Conv2d: conv2d_weight,
    nn.Conv3d: conv3d_weight,
}
SUPPORTED_MODULES = (nn.Linear, *_CONV_WEIGHT_GRAD)
METHODS = ("hooks", "exact")
CONV_RULES = ("approx", "exact")
REDUCTIONS = ("mean", "sum")


@dataclass
class _Moment:
    """Running ``Q`` of one parameter, the samples it covers and the last forward pass counted."""

    second_moment: torch.Tensor
    batch: int
    forward_pass: int


def linear_second_moments(
    module: nn.Linear,
    x: torch.Tensor,
    d: torch.Tensor,
    previous: Callable[[torch.Tensor], torch.Tensor | None] = lambda p: None,
) -> dict[torch.Tensor, torch.Tensor]:
    """``Q`` of a Linear call: weight ``(d*d)^T (x*x)`` over all rows, bias ``sum_z (sum_p d_zp)^2``.

    ``previous(weight)`` is the running weight ``Q`` to add into in place (one fused
    ``addmm_`` per call of a recurrent cell instead of a product and a sum).
    """
    moments: dict[torch.Tensor, torch.Tensor] = {}
    if module.weight.requires_grad:
        rows_x = x.reshape(-1, x.shape[-1])
        rows_d = d.reshape(-1, d.shape[-1])
        running = previous(module.weight)
        squared_d, squared_x = (rows_d * rows_d).t(), rows_x * rows_x
        moments[module.weight] = (
            squared_d @ squared_x if running is None else running.addmm_(squared_d, squared_x)
        )
    if module.bias is not None and module.bias.requires_grad:
        per_sample = d.reshape(_batch_size(x), -1, d.shape[-1]).sum(1) if x.dim() > 2 else d
        moments[module.bias] = (per_sample * per_sample).reshape(-1, d.shape[-1]).sum(0)
    return moments


def conv_second_moments(
    module: nn.modules.conv._ConvNd, x: torch.Tensor, d: torch.Tensor, *, exact: bool = False
) -> dict[torch.Tensor, torch.Tensor]:
    """``Q`` of a convolution call; exact bias.

    Weight: the weight-gradient convolution of ``x*x`` and ``d*d`` (cross-position terms
    dropped), or with ``exact`` the per-sample weight gradients (``vmap`` of the same
    convolution, ``B x |W|`` transient memory for this layer only) squared and summed.
    """
    moments: dict[torch.Tensor, torch.Tensor] = {}
    if module.weight.requires_grad:
        padding: str | tuple[int, ...] | int = module.padding
        if isinstance(padding, str) or module.padding_mode != "zeros":
            mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
            x = nn.functional.pad(x, module._reversed_padding_repeated_twice, mode=mode)
            padding = 0
        weight_grad = _CONV_WEIGHT_GRAD[type(module)]
        args = (module.weight.shape, module.stride, padding, module.dilation, module.groups)
        if exact:
            per_sample = vmap(lambda xz, dz: weight_grad(xz[None], args[0], dz[None], *args[1:]))(x, d)
            moments[module.weight] = (per_sample * per_sample).sum(0)
        else:
            moments[module.weight] = weight_grad(x * x, args[0], d * d, *args[1:])
    if module.bias is not None and module.bias.requires_grad:
        per_sample = d.sum(dim=tuple(range(2, d.dim())))
        moments[module.bias] = (per_sample * per_sample).sum(0)
    return moments


def _batch_size(x: torch.Tensor) -> int:
    return x.shape[0] if x.dim() > 1 else 1


class VarianceTracker:
    """Collects ``Q = sum_z a_z^2`` per parameter and turns it into the variance ``s``.

    Args:
        module: the model (for DDP, ``ddp_model.module``).
        method: ``"hooks"`` (default; cheap rules above, installed now) or ``"exact"``
            (no hooks; call :meth:`record_exact` each step).
        conv_rule: convolution weights with ``"approx"`` (cross-position terms dropped)
            or ``"exact"`` (per-sample weight gradients of one layer at a time).
    """

    def __init__(self, module: nn.Module, *, method: str = "hooks", conv_rule: str = "approx") -> None:
        self.method = check_choice(method, "method", METHODS)
        self.conv_rule = check_choice(conv_rule, "conv_rule", CONV_RULES)
        self.module = module
        self._moments: dict[torch.Tensor, _Moment] = {}
        self._forward_pass = 0
        self._handles = []
        if self.method == "hooks":
            self._handles.append(module.register_forward_pre_hook(self._count_forward_pass))
            for child in module.modules():
                if type(child) in SUPPORTED_MODULES:
                    self._handles.append(child.register_forward_hook(self._watch_output))

    # -- hooks -----------------------------------------------------------------
    def _count_forward_pass(self, module: nn.Module, args: tuple) -> None:
        self._forward_pass += 1

    def _watch_output(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not (torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad):
            return
        if torch._C._functorch.peek_interpreter_stack() is not None:
            return  # inside a torch.func transform (e.g. an exact per-sample reference): not a training pass
        x = args[0].detach()
        forward_pass = self._forward_pass
        layer: nn.Linear | nn.modules.conv._ConvNd
        rule: Callable[[torch.Tensor, torch.Tensor], dict[torch.Tensor, torch.Tensor]]
        if isinstance(module, nn.Linear):
            layer = module
            rule = functools.partial(linear_second_moments, layer, previous=self.second_moment)
        else:
            # A convolution: this hook is registered on SUPPORTED_MODULES only.
            layer = cast(nn.modules.conv._ConvNd, module)
            rule = functools.partial(conv_second_moments, layer, exact=self.conv_rule == "exact")

        def on_output_grad(d: torch.Tensor) -> None:
            # In the parameters' dtype: under autocast x and d may be fp16 (and a scaled d
            # squared overflows fp16), while the moments add up next to fp32 gradients.
            dtype = layer.weight.dtype
            with torch.no_grad():
                for param, moment in rule(x.to(dtype), d.to(dtype)).items():
                    self._add(param, moment, _batch_size(x), forward_pass)

        output.register_hook(on_output_grad)

    def _add(self, param: torch.Tensor, moment: torch.Tensor, batch: int, forward_pass: int) -> None:
        entry = self._moments.get(param)
        if entry is None:
            self._moments[param] = _Moment(moment, batch, forward_pass)
            return
        if moment is not entry.second_moment:  # not already added in place by the rule
            entry.second_moment += moment
        if entry.forward_pass != forward_pass:  # a new minibatch (gradient accumulation)
            entry.batch += batch
            entry.forward_pass = forward_pass

    # -- exact path --------------------------------------------------------------
    def record_exact(
        self,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        inputs: torch.Tensor,
        targets: torch.Tensor,
        *,
        reduction: str = "mean",
    ) -> None:
        """Record exact ``Q`` for every trainable parameter via ``torch.func``.

        ``loss_fn(output, target)`` is the loss of one sample (called with a batch
        of one); ``reduction`` is how the training loss combines samples, which sets
        ``a_z = g_z / B`` (``"mean"``) or ``g_z`` (``"sum"``).
        """
        check_choice(reduction, "reduction", REDUCTIONS)
        self._forward_pass += 1
        for param, (moment, batch) in self._exact_moments(loss_fn, inputs, targets, reduction).items():
            self._add(param, moment, batch, self._forward_pass)

    def _exact_moments(self, loss_fn, inputs, targets, reduction):
        names = {name: p for name, p in self.module.named_parameters() if p.requires_grad}
        params = {name: p.detach() for name, p in names.items()}
        buffers = dict(self.module.named_buffers())

        def sample_loss(weights, x, y):
            out = functional_call(self.module, (weights, buffers), (x.unsqueeze(0),))
            return loss_fn(out, y.unsqueeze(0))

        per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, inputs, targets)
        batch = inputs.shape[0]
        factor = 1.0 / batch**2 if reduction == "mean" else 1.0
        return {names[n]: ((g * g).sum(0) * factor, batch) for n, g in per_sample.items()}

    # -- results -----------------------------------------------------------------
    def second_moment(self, param: torch.Tensor) -> torch.Tensor | None:
        """``Q`` collected for ``param`` since it was last taken (None if none)."""
        entry = self._moments.get(param)
        return None if entry is None else entry.second_moment

    def variance(self, param: nn.Parameter, gradient: torch.Tensor | None = None) -> torch.Tensor:
        """``s = clamp(Q - G^2/B, 0)`` for ``param`` (``G`` defaults to ``param.grad``); 0 without ``Q``."""
        gradient = param.grad if gradient is None else gradient
        if gradient is None:
            raise InvalidTensorError("variance: param.grad is None; run a backward pass or pass gradient")
        return shaped_like(self.take_variance([param], flat_like(gradient, param), forget=False), param)

    def take_variance(
        self, parameters: Iterable[nn.Parameter], gradient: torch.Tensor, *, forget: bool = True
    ) -> torch.Tensor:
        """Flat ``s`` for ``gradient`` = the parameters' gradients concatenated in order.

        Parameters without ``Q`` (unsupported layers, or no backward since the last
        take) get ``s = 0``. With ``forget`` (default), the moments are consumed.
        """
        parameters = list(parameters)
        entries = [self._moments.pop(p, None) if forget else self._moments.get(p) for p in parameters]
        batches = {entry.batch for entry in entries if entry is not None}
        if not batches:
            return gradient.new_zeros(gradient.shape)
        pieces = [
            gradient.new_zeros(p.numel())
            if entry is None
            else flat_like(entry.second_moment, p).to(gradient.dtype)
            for p, entry in zip(parameters, entries, strict=True)
        ]
        second_moment = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        # Where Q = 0 (no moment) the clamp makes s = 0 whatever B is; so one B suffices
        # unless the parameters of one bucket saw different batch sizes.
        if len(batches) > 1:
            inverse = torch.cat(
                [
                    gradient.new_full((p.numel(),), 1.0 / (e.batch if e else 1))
                    for p, e in zip(parameters, entries, strict=True)
                ]
            )
            return (second_moment - gradient * gradient * inverse).clamp_(min=0)
        return torch.addcmul(second_moment, gradient, gradient, value=-1.0 / batches.pop()).clamp_(min=0)

    def unsupported_parameters(self) -> list[str]:
        """Names of trainable parameters the hooks do not cover (they go dense in VGC)."""
        if self.method == "exact":
            return []
        covered = {
            id(p) for m in self.module.modules() if type(m) in SUPPORTED_MODULES for p in m.parameters()
        }
        return [n for n, p in self.module.named_parameters() if p.requires_grad and id(p) not in covered]

    def clear(self) -> None:
        """Forget every collected moment."""
        self._moments.clear()

    def remove(self) -> None:
        """Uninstall the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
