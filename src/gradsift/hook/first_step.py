"""What the hook checks at the first optimizer step that updates its model's parameters.

Two mistakes of a user moving from stock DDP leave training silently worse, and the
hook cannot see either from inside backward:

* **A momentum optimizer not passed as ``optimizer=``.** With error feedback, the hook
  sends each residual once it is large; an optimizer's own momentum (SGD's ``momentum``,
  Adam's ``beta1``) then re-applies every stale update it already holds (DGC's momentum
  correction, :mod:`gradsift.hook.recipe`). Warned once, naming the optimizer.
* **A ``torch.amp.GradScaler`` not passed as ``scaler=``.** The hook then works on
  gradients scaled by ``s``: weight decay taken from the optimizer is added to
  ``s g``, thresholds and residuals live at the scale of the moment. Refused at the
  first step with :class:`InvalidOptionError`.
* **Clipping after the exchange under SGD's momentum correction** (``clip_grad_norm_`` or
  ``clip_grad_value_`` between backward and the step). The hook hands SGD, its momentum taken
  over, the mean of the velocity it sent -- ``u <- m u + g`` accumulated until sent --, so a
  threshold meant for the gradient ``g`` acts on the update instead, from about
  ``1 / (1 - m)`` times ``g``'s size up (more for what waited to be sent). Seen as the
  delivered gradient scaled by one factor ``c < 1`` that is not a power of two (a scaler's
  ``unscale_`` is one), once two such factors differ other than by a power of two (a clip's
  factor follows the norm, while a script's constant rescale -- dividing by its accumulation
  steps -- is linear, so exact, and stays put), or as the delivered gradient clamped to
  ``[-c, c]`` with an element cut (:func:`_clamped_at`). Refused (``clip_norm=`` is DGC's
  clipping of ``g`` before the velocity); under ``auto``
  (:attr:`FirstOptimizerStep.refuse` False) only recorded, and ``auto`` runs
  without the takeover. Watched for the first :data:`CLIPPING_CHECKS` steps: a clipping
  threshold binds there once the velocity has grown.

PyTorch's global optimizer step pre-hook
(``torch.optim.optimizer.register_optimizer_step_pre_hook``) sees every optimizer's
step. At the close of a hooked step the hook keeps a copy of the first
:data:`REFERENCE_ELEMENTS` elements it delivered for the first parameter of its first
bucket (a device copy, no host read). When an optimizer holding that parameter steps,
its gradient is compared with the copy on the host (outside backward): equal -- the
gradient is what the hook delivered; ``g = d / 2^k`` exactly for every element, ``k !=
0`` -- a loss scaler's ``unscale_`` ran between backward and the step, which (2^k scales,
exact in floating point) no clipping or other rule produces except by coincidence;
anything else -- the user changed the gradient some other way, not our business. The
comparison is computed on the device and read with one host read per check
(:func:`_scaled_by`). A reference with no finite non-zero element says nothing and waits
for the next step, at most :data:`UNDECIDED_CHECKS` checks: after that the scaler check
gives up (a gradient that stays zero is no scaled gradient to refuse), so the watch costs
a bounded number of host reads whatever the gradients. Once decided, the hook's watcher
leaves the one process-wide optimizer hook (:mod:`gradsift.hook.before_step`).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from gradsift.compressors.registry import available_compressors, compressor_class
from gradsift.core.bucket_order import flat_like
from gradsift.core.errors import InvalidOptionError
from gradsift.hook import recipe
from gradsift.hook.adam import ADAM_FAMILY
from gradsift.hook.before_step import BEFORE_STEP

#: Elements of the delivered gradient kept for the comparison.
REFERENCE_ELEMENTS = 4096
#: Checks whose reference said nothing (no finite non-zero element) before the scaler check
#: gives up: each costs one host read.
UNDECIDED_CHECKS = 8
#: Optimizer steps under SGD's momentum correction watched for clipping (one host read each).
CLIPPING_CHECKS = 200


class FirstOptimizerStep:
    """The first-step checks of one hook (module docstring).

    Args:
        hooked: the hooked module's parameters.
        given: the optimizer passed as ``optimizer=`` (None: none).
        check_momentum: the hook runs error feedback (an unpassed momentum optimizer harms it).
        check_scaler: the hook's result depends on the gradient's scale and no ``scaler=``
            was given.
        check_clipping: SGD's momentum is taken over (momentum correction).
    """

    def __init__(
        self,
        hooked: list[torch.nn.Parameter],
        given: Any,
        check_momentum: bool,
        check_scaler: bool,
        check_clipping: bool = False,
    ) -> None:
        self.hooked = {id(p) for p in hooked}
        self.given = given
        self.check_momentum = check_momentum
        self.check_scaler = check_scaler
        self.clipping_checks = CLIPPING_CHECKS if check_clipping else 0
        #: Clipping found is refused (a named method); False: recorded in :attr:`found` (``auto``),
        #: as :class:`~gradsift.hook.taken_over.TakenOverChecks` does, with what was seen.
        self.refuse = True
        self.found: str | None = None
        #: The first factor below 1 seen (a script's own constant rescale, or a clip's).
        self.rescaled: float | None = None
        self.candidate: tuple[torch.Tensor, torch.Tensor] | None = None
        self.reference: tuple[torch.Tensor, torch.Tensor] | None = None
        self.undecided = 0
        if self.watching:
            BEFORE_STEP.add(self)

    @classmethod
    def of(cls, state: Any, optimizer: Any) -> FirstOptimizerStep:
        """The checks of hook ``state`` (a :class:`~gradsift.hook.state.GradsiftHookState`)
        stepped by ``optimizer`` (None: none found yet), keeping the clipping policy of the
        checks it replaces."""
        checks = cls(
            state.hooked,
            optimizer,
            check_momentum=state.feedback is not None and state.compressor.momentum_correction,
            check_scaler=state.options.scaler is None and not state.compressor.identity,
            check_clipping=state.taken_over is not None and state.adam is None,
        )
        if state.first_step is not None:
            checks.refuse = state.first_step.refuse
        return checks

    @property
    def watching(self) -> bool:
        return self.check_momentum or self.check_scaler or self.clipping_checks > 0

    def offer(self, param: torch.Tensor, result: torch.Tensor) -> None:
        """The step's first bucket: ``result`` starts with ``param``'s delivered gradient
        (called only while :attr:`watching`)."""
        if self.candidate is None:
            self.candidate = (param, result)

    def keep(self) -> None:
        """At the step's close, results final: copy the reference (on the device)."""
        if self.candidate is not None:
            param, result = self.candidate
            size = min(REFERENCE_ELEMENTS, param.numel(), result.numel())
            self.reference = (param, result[:size].detach().clone())
            self.candidate = None

    def close(self) -> None:
        """Stop watching."""
        self.check_momentum = self.check_scaler = False
        self.clipping_checks = 0
        self.candidate = self.reference = None
        BEFORE_STEP.remove(self)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The checks, when ``optimizer`` steps the hooked parameters (module docstring)."""
        if not self.watching:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not any(id(p) in self.hooked for p in params):
            return
        if self.check_momentum and self.reference is not None:  # the hook has exchanged: found by then
            self.check_momentum = False
            momentum = None if _same_optimizer(optimizer, self.given) else _momentum_of(optimizer)
            if momentum is not None:
                warnings.warn(
                    f"gradsift: {type(optimizer).__name__} ({momentum}) steps the hooked model's parameters "
                    "but was not passed to register_comm_hook(..., optimizer=...); on top of error feedback "
                    "its momentum re-applies updates the residuals already hold (DGC's momentum correction, "
                    f"docs/decisions.md) and training can diverge: {_remedy(optimizer)}",
                    stacklevel=4,
                )
        if self.clipping_checks and self.reference is not None:
            self._check_clipping(optimizer, params)
        if self.check_scaler and self.reference is not None:
            param, delivered = self.reference
            if any(p is param for p in params) and param.grad is not None:
                decided = _scaled_by(flat_like(param.grad, param)[: delivered.numel()], delivered)
                self.reference = None  # one check per delivered reference
                self.undecided += decided is None
                if decided is not None or self.undecided >= UNDECIDED_CHECKS:
                    self.check_scaler = False
                    if decided:  # a power of two other than 1 (None: gave up, 0: not a scaler)
                        self.close()
                        raise InvalidOptionError(
                            f"the gradients {type(optimizer).__name__} steps are the hook's divided by "
                            f"2^{decided}: a torch.amp.GradScaler unscaled them, but the hook was registered "
                            "without scaler=, so its weight decay, clipping, thresholds and residuals worked "
                            "on scaled gradients; pass register_comm_hook(..., scaler=scaler)"
                        )
        if not self.watching:
            self.close()

    def _check_clipping(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
        """The clipping check of one step (module docstring); the reference stays for the scaler's."""
        param, delivered = self.reference  # type: ignore[misc]
        if not any(p is param for p in params) or param.grad is None:
            return
        self.clipping_checks -= 1
        gradient = flat_like(param.grad, param)[: delivered.numel()]
        factor = _uniform_factor(gradient, delivered)
        if factor is None:
            bound = _clamped_at(gradient, delivered)
            if bound is None:
                return
            how = f"are the hook's clamped to +-{bound:.3g}: clipping after backward (clip_grad_value_)"
        elif factor >= 1.0 or _power_of_two(factor):
            return
        elif self.rescaled is None or _power_of_two(factor / self.rescaled):
            self.rescaled = factor  # one factor so far: a constant rescale, or a clip's first
            return
        else:
            how = (
                f"are the hook's times {factor:.3g}, not a power of two (a scaler's unscale_ is one): "
                "clipping after backward (clip_grad_norm_)"
            )
        seen = (
            f"the gradients {type(optimizer).__name__} steps {how} acts on the velocity momentum correction "
            "sends, not on the gradient, so training slows or stalls"
        )
        self.clipping_checks, self.found = 0, seen
        if not self.refuse:
            warnings.warn(f"gradsift: {seen}; auto runs stock DDP's allreduce from here", stacklevel=5)
            return
        self.close()
        raise InvalidOptionError(
            f"{seen}; drop it (a trainer's gradient_clip_val or max_grad_norm too) and pass clip_norm=C "
            "to register_comm_hook or to gradsift's trainer callback (DGC's clipping of each gradient "
            "before the velocity), or optimizer=False to keep SGD's momentum and clip as with stock DDP"
        )


def _same_optimizer(optimizer: torch.optim.Optimizer, given: Any) -> bool:
    """``optimizer`` is the one passed, or the one a wrapper passed in its place wraps
    (Accelerate's ``AcceleratedOptimizer`` steps the inner optimizer, whose param groups
    are the wrapper's)."""
    return given is not None and (
        optimizer is given or optimizer.param_groups is getattr(given, "param_groups", None)
    )


def _remedy(optimizer: torch.optim.Optimizer) -> str:
    """What to do about an unpassed momentum optimizer: pass it, where the hook can take it over
    (:data:`~gradsift.hook.recipe.SUPPORTED_OPTIMIZERS`); else a compressor without error feedback."""
    if isinstance(recipe.unwrapped(optimizer), (torch.optim.SGD, *ADAM_FAMILY)):
        return "pass optimizer="
    plain = [n for n in available_compressors() if not compressor_class(n).error_feedback]
    return (
        f"the hook takes over only {recipe.SUPPORTED_OPTIMIZERS}; use a compressor without error "
        f"feedback ({', '.join(plain)}) or an optimizer without momentum"
    )


def _momentum_of(optimizer: torch.optim.Optimizer) -> str | None:
    """The optimizer's momentum setting, or None when it has none."""
    for group in optimizer.param_groups:
        if group.get("momentum", 0):
            return f"momentum={group['momentum']}"
        if "betas" in group and group["betas"][0]:
            return f"betas={tuple(group['betas'])}"
    return None


def _power_of_two(factor: float) -> bool:
    """Whether ``factor`` is a power of two, to a hundred-thousandth of an octave (what a scaler's
    ``unscale_`` multiplies by, or two such factors' ratio)."""
    octaves = math.log2(factor)
    return abs(octaves - round(octaves)) < 1e-5


def _tolerance(expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per element of the float64 ``expected``, four units in the last place of ``dtype``."""
    finfo = torch.finfo(dtype)
    return 4 * finfo.eps * expected.abs() + finfo.tiny


def _matches(gradient: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Per element, ``gradient`` equals ``expected`` within :func:`_tolerance` (on the device)."""
    return (gradient.double() - expected).abs() <= _tolerance(expected, gradient.dtype)


def _uniform_factor(gradient: torch.Tensor, delivered: torch.Tensor) -> float | None:
    """``c`` when ``gradient == c * delivered`` for one ``c`` (each element within four units in
    the last place of ``gradient``'s dtype); None otherwise, or when ``delivered`` has no finite
    non-zero element. ``c`` is read at the largest ``|d_j|``; every test runs on the device, the
    verdict comes back in one host read."""
    largest = delivered.abs().argmax()
    top, seen = delivered[largest].double(), gradient[largest].double()
    factor = seen / top
    uniform = (top != 0) & torch.isfinite(factor) & _matches(gradient, delivered.double() * factor).all()
    verdict = torch.stack([uniform.double(), factor]).tolist()  # the host read
    return verdict[1] if verdict[0] else None


def _clamped_at(gradient: torch.Tensor, delivered: torch.Tensor) -> float | None:
    """``c`` when ``gradient`` is ``delivered`` (times a power of two, a scaler's) clamped to
    ``[-c, c]`` with at least one element cut (``c = max |gradient|``), or every non-zero element
    at ``+-c`` with its delivered sign where the delivered magnitudes differed; None otherwise.
    Zeros (what was not sent) stay zeros. The scale is read at the largest element left inside
    the bound; every test runs on the device, the verdict comes back in one host read."""
    sent = delivered != 0
    bound = gradient.abs().max().double()
    inside = sent & (gradient.abs().double() < bound)
    largest = torch.where(inside, delivered.abs(), torch.zeros_like(delivered)).argmax()
    scale = gradient[largest].double() / delivered[largest].double()
    expected = delivered.double() * scale
    tolerance = _tolerance(expected, gradient.dtype)
    kept = torch.where(inside, _matches(gradient, expected), expected.abs() >= bound - tolerance)
    zeros = (gradient[~sent] == 0).all()
    cut = (expected.abs() > bound + tolerance).any()
    partly = inside.any() & torch.isfinite(scale) & (scale > 0) & (kept | ~sent).all() & cut & zeros
    magnitudes = torch.where(sent, delivered.abs(), delivered.abs().max())
    signs = (torch.sign(gradient) == torch.sign(delivered)).all()
    differed = magnitudes.min() * (1 + 1e-3) < delivered.abs().max()
    wholly = sent.any() & ~inside.any() & (bound > 0) & signs & differed & zeros
    verdict = torch.stack([partly.double(), wholly.double(), scale, bound]).tolist()  # the host read
    if verdict[1] or (verdict[0] and _power_of_two(verdict[2])):
        return verdict[3]
    return None


def _scaled_by(gradient: torch.Tensor, delivered: torch.Tensor) -> int | None:
    """``k != 0`` when ``gradient == delivered / 2^k`` exactly; ``0`` when equal or related
    otherwise (not a scaler's doing); None when the reference says nothing (no non-zero
    finite element).

    At the largest ``|d_j|`` of ``delivered``: ``k = log2(d_j / g_j)`` must be an integer (a
    positive ratio) and ``ldexp(g, k) == d`` must hold for every element (multiplying by
    ``2^k`` is exact, so a scaler's ``unscale_`` passes and nothing else does but by
    coincidence). Every test runs on the device; the verdict comes back in one host read.
    """
    largest = delivered.abs().argmax()
    top, seen = delivered[largest].double(), gradient[largest].double()
    informative = (top != 0) & torch.isfinite(top)
    ratio = top / seen
    exponent = torch.log2(ratio.abs())
    k = torch.round(exponent)
    related = (seen != 0) & torch.isfinite(seen) & (exponent == k) & (ratio > 0)
    k = torch.where(related, k, torch.zeros_like(k))
    exact = torch.eq(torch.ldexp(gradient, k.to(gradient.dtype)), delivered).all()
    verdict = torch.stack([informative.double(), (related & exact).double(), k]).tolist()  # the host read
    if not verdict[0]:
        return None
    return int(verdict[2]) if verdict[1] else 0
