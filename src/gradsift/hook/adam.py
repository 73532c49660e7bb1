"""Compressed training with Adam and AdamW: error feedback on the first moment, the second frozen.

Why plain error feedback breaks Adam: a sparsifier sends a coordinate about once every
``1/density`` steps, carrying the sum of the skipped gradients; Adam divides that sum by
``sqrt(v)`` like any single gradient, so the coordinate takes one ordinary step instead
of ``1/density`` of them, and training slows by about the density.

What ``register_comm_hook(ddp, compressor, optimizer=adam)`` does instead (after 1-bit
Adam, Tang et al. 2021, with DGC's momentum correction for the first moment):

1. **Warm-up** -- the first steps are stock DDP + the optimizer as built: dense allreduce
   of the gradients, Adam's own ``exp_avg`` ``m`` and ``exp_avg_sq`` ``v``. It lasts
   ``warmup_steps`` steps where given, else until ``v`` has settled, measured on the run
   (:mod:`gradsift.hook.adam_warmup`).
2. **Freeze** ``v`` -- from then on the optimizer never steps the model's parameters
   again, so their ``exp_avg_sq`` and ``step`` stay as the warm-up left them; the
   preconditioner ``D = sqrt(v / (1 - beta2^t)) + eps`` is constant (at least a hundredth of its
   tensor's root-mean-square root, :data:`~gradsift.hook.adam_warmup.ROOT_FLOOR`; where ``v = 0``,
   the largest root of its tensor, or of the model where the tensor never moved: never
   ``m / eps``), and the update ``m / D`` is linear in ``m``. A parameter without any second moment (frozen through
   the warm-up, unfrozen since) is refused at its first compressed step (:data:`NO_SECOND_MOMENT`);
   ``auto`` steps it as a tensor that never moved and leaves the method.
3. **Compressed steps** -- each worker keeps a velocity ``u <- beta1 u + g`` (started from
   the warm-up's ``m / ((1 - beta1)(1 - beta1^t))``, Adam's bias-corrected first moment
   in velocity units), sends ``u + r`` through the compressor with error feedback
   (residual ``r``; momentum factor masking as in DGC), and the exchange's mean ``s``
   stands for ``sum_k u_k / W``. The hook hands DDP ``(1 - beta1) s`` -- Adam's first moment,
   at a gradient's scale, so ``clip_grad_norm_`` and ``GradScaler`` see what they expect --
   and the optimizer's step becomes ``theta <- theta (1 - lr wd) - lr m / D`` (AdamW's
   decoupled decay; Adam's L2 decay ``wd theta`` is added to ``g`` before the velocity).
   Because ``m / D`` is linear in what was sent, error feedback's delayed coordinates are
   delayed, not shrunk: DGC's argument for SGD momentum carries over.

``adam="onebit"`` is 1-bit Adam's own momentum instead of step 3's: every worker's first moment
restarts each step from the exchanged one, ``m_k = beta1 m + (1 - beta1) g_k`` with ``m`` the
mean that was delivered (after the server stage, when ``server_feedback=True``) -- in
velocity units ``u_k = beta1 s + g_k`` -- rather than running on its own
(:class:`OneBitAdamStep`). ``register_comm_hook(ddp, "onebit", optimizer=adamw,
adam="onebit", server_feedback=True)`` is then 1-bit Adam as Tang et al. write it: the
compressor ``(||x||_2 / sqrt(d)) sign(x)``, error feedback on the worker and on the server.

The optimizer step is taken over by a step pre-hook (:class:`FrozenVarianceStep`) that
applies the update above to the model's parameters and clears their ``.grad``, so the
optimizer skips them; learning-rate schedulers, ``GradScaler.step`` (which calls the
optimizer's step only when the gradients are finite) and parameters outside the model
work as usual. Nothing is kept outside the optimizer's own state and the hook's state
store, so ``optimizer.state_dict()`` plus the hook's ``state_dict()`` resume bit for bit.

Supported: ``torch.optim.Adam`` and ``AdamW`` without ``amsgrad`` and ``maximize``. Others
(LAMB, Adafactor, Lion, ...) are refused: their updates are not linear in a first moment
once a statistic is frozen, or they keep no first moment at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gradsift.core.bucket_order import flat_like, shaped_like
from gradsift.core.errors import InvalidOptionError
from gradsift.core.precision import working_dtype
from gradsift.hook.adam_warmup import GIVEN_REASON, SettledWarmup, bias_correction, frozen_root, largest_root
from gradsift.hook.feedback import VELOCITY
from gradsift.hook.param_groups import model_groups

ADAM_FAMILY = (torch.optim.Adam, torch.optim.AdamW)
#: Share of a run's steps that Adam runs dense before its second moment is frozen, where a
#: caller knows the run's length and gives no ``warmup_steps`` (``gradsift train``, the
#: Hugging Face callback; docs/adam.md has the measurement behind it).
WARMUP_FRACTION = 0.1

#: The fixed dense warm-up ``compressor="auto"`` gives the 1-bit Adam method it switches to
#: when no ``warmup_steps`` is given (``register_comm_hook(..., optimizer=adam)`` itself
#: measures its warm-up: :mod:`gradsift.hook.adam_warmup`).
ONE_LINE_WARMUP_STEPS = 64


def default_warmup_steps(steps: int) -> int:
    """The dense warm-up of a run of ``steps``: ``WARMUP_FRACTION`` of them, at least 1."""
    return max(1, round(WARMUP_FRACTION * steps))


NO_SECOND_MOMENT = (
    "a parameter reached a compressed Adam step without a second moment: it had no gradient during "
    "the dense warm-up (frozen then and unfrozen since, or unused until now); set requires_grad before "
    "the warm-up ends (warmup_steps), or exclude it from the DDP model"
)


def _refuse(problem: str) -> None:
    raise InvalidOptionError(problem)


def is_adam(optimizer: object) -> bool:
    """Whether ``optimizer`` is one of the Adam family the hook can take over."""
    return isinstance(optimizer, ADAM_FAMILY)


def check_adam(optimizer: torch.optim.Optimizer, numbers: dict[int, int]) -> float:
    """The one ``beta1`` of the groups holding the model's parameters; refuses what the
    frozen-variance step does not implement."""
    betas = set()
    for index, group, _ in model_groups(optimizer, numbers):
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise InvalidOptionError(
                    f"optimizer param group {index}: {flag}=True is not supported by gradsift's compressed Adam"
                )
        betas.add(float(group["betas"][0]))
    if len(betas) > 1:
        raise InvalidOptionError(f"the model's parameter groups use different beta1 {sorted(betas)}: use one")
    if not betas:
        raise InvalidOptionError("the optimizer holds none of the model's parameters")
    return betas.pop()


def l2_decay(optimizer: torch.optim.Optimizer, numbers: dict[int, int]) -> dict[int, float]:
    """Adam's (not AdamW's) L2 weight decay per parameter number: added to the gradient
    before the velocity in compressed steps, as Adam adds it before its moments."""
    if isinstance(optimizer, torch.optim.AdamW):
        return {}
    decay: dict[int, float] = {}
    for _, group, mine in model_groups(optimizer, numbers):
        if group.get("weight_decay", 0.0):
            decay.update(dict.fromkeys(mine, float(group["weight_decay"])))
    return decay


class AdamStep:
    """What both methods share: the optimizer's step of a compressed step, as a step pre-hook.

    The hook sets :attr:`pending` when it committed a compressed step; the optimizer's next step
    then applies ``theta <- theta (1 - lr wd) - lr direction`` (AdamW's decoupled decay; Adam's
    L2 decay went into the gradient) and clears ``.grad``, so the optimizer's own step skips them.

    Args:
        optimizer: the Adam or AdamW the user built.
        numbers: ``id(parameter) -> number`` of the model's parameters.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, numbers: dict[int, int]) -> None:
        self.optimizer = optimizer
        self.numbers = numbers
        self.beta1 = check_adam(optimizer, numbers)
        self.decoupled = isinstance(optimizer, torch.optim.AdamW)
        #: Set by the hook when a compressed step was committed: the next optimizer step is ours.
        self.pending = False
        #: Told what the step cannot honour: raises (a named method; under ``auto`` the takeover's
        #: checks record it instead, :class:`~gradsift.hook.taken_over.TakenOverChecks`).
        self.found = _refuse
        self._handle = optimizer.register_step_pre_hook(self)

    def detach(self) -> None:
        """Stop taking over the optimizer's steps."""
        self._handle.remove()

    def stats(self) -> dict[str, Any]:
        """What the method reports in the hook's ``stats()`` (by default nothing)."""
        return {}

    def compressing(self, step: int) -> bool:
        """Whether hook step ``step`` (0-based) is a compressed one."""
        del step
        return True

    def moment_scale(self, step: int) -> float:
        """What hook step ``step``'s exchanged mean is multiplied by before it becomes ``.grad``."""
        return 1.0

    def initial_velocity(self, params: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The velocity a part starts with (None: the error feedback's own start)."""
        del params
        return None

    def exchanged(self, store: Any, key: Any, mean: torch.Tensor) -> None:
        """What the method keeps of part ``key``'s exchanged ``mean`` (velocity units, before
        the hook scales it): by default nothing."""
        del store, key, mean

    def direction(self, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """What the step subtracts, times lr, from ``param`` (its ``.grad`` transformed)."""
        assert param.grad is not None
        return param.grad

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Step pre-hook (see the class docstring)."""
        if not self.pending:
            return
        self.pending = False
        with torch.no_grad():
            for group in optimizer.param_groups:
                lr, decay = float(group["lr"]), float(group["weight_decay"])
                for param in group["params"]:
                    if id(param) not in self.numbers or param.grad is None:
                        continue
                    if self.decoupled and decay:
                        param.mul_(1.0 - lr * decay)
                    param.sub_(self.direction(param, group).to(param.dtype), alpha=lr)
                    param.grad = None


class FrozenVarianceStep(AdamStep):
    """1-bit Adam's method (module docstring): a dense warm-up, then ``v`` frozen, the first
    moment as a momentum-corrected velocity with error feedback; direction ``m / D``.

    Args:
        warmup_steps: dense steps before the variance is frozen (>= 1); None: until the
            second moment has settled (:class:`~gradsift.hook.adam_warmup.SettledWarmup`).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, numbers: dict[int, int], warmup_steps: int | None
    ) -> None:
        if warmup_steps is not None and warmup_steps < 1:
            raise InvalidOptionError(
                "compressed Adam with a frozen second moment (adam='frozen-variance' or 'onebit') needs a dense warm-up that gives the second "
                "moment its values: pass warmup_steps >= 1, or leave it unset to end the warm-up when the second moment has settled"
            )
        super().__init__(optimizer, numbers)
        self.warmup_steps = warmup_steps
        self.settled = None if warmup_steps is not None else SettledWarmup(optimizer, numbers)
        self._preconditioners: dict[int, torch.Tensor] = {}

    def detach(self) -> None:
        super().detach()
        if self.settled is not None:
            self.settled.detach()

    @property
    def warmup_end(self) -> int | None:
        """The first compressed step: ``warmup_steps``, or the measured end (None: not yet)."""
        return self.warmup_steps if self.settled is None else self.settled.end

    def compressing(self, step: int) -> bool:
        end = self.warmup_end
        return end is not None and step >= end

    def stats(self) -> dict[str, Any]:
        """``{"adam_warmup": {...}}``: the first compressed step ``end`` (None: still dense),
        ``reason`` (``"settled"``, ``"cap"`` or ``"warmup_steps"``), the optimizer ``steps``
        counted, the last relative change ``change`` and the ``cap``."""
        if self.settled is None:
            return {"adam_warmup": {"end": self.warmup_steps, "reason": GIVEN_REASON}}
        record = self.settled.record
        fields = {k: record[k] for k in ("end", "reason", "steps", "change")}
        return {"adam_warmup": {**fields, "cap": self.settled.cap}}

    def moment_scale(self, step: int) -> float:
        """The exchange's mean is in velocity units: Adam's first moment is ``1 - beta1`` of it."""
        return 1.0 - self.beta1

    def direction(self, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        assert param.grad is not None
        return param.grad / self._preconditioner(param, group)

    def _preconditioner(self, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """``D`` of the module docstring, of the warm-up's last step (cached: it is frozen)."""
        cached = self._preconditioners.get(id(param))
        if cached is None:
            state = self.optimizer.state.get(param, {})
            if not self._preconditioners:  # the first of a freeze: the model's largest root, once
                self._largest = largest_root(self.optimizer, self.numbers)
            if "exp_avg_sq" not in state:  # found: refused, or (auto) stepped as a tensor never moved
                self.found(NO_SECOND_MOMENT)
                root = torch.zeros_like(param).add_(self._largest.to(param.device))
                return self._preconditioners.setdefault(id(param), root.add_(float(group["eps"])))
            correction = bias_correction(float(group["betas"][1]), state["step"])
            root = frozen_root(state["exp_avg_sq"], correction, self._largest).to(state["exp_avg_sq"].dtype)
            cached = self._preconditioners[id(param)] = root.add_(float(group["eps"]))
        return cached

    def renew_second_moment(self, estimate: dict[int, torch.Tensor], elapsed: int) -> None:
        """Adam's bias-corrected second moment moved ``e = elapsed`` steps on, each as if it saw
        ``estimate`` (flat, per parameter number) where positive: ``v <- beta2^e v + (1 - beta2^e)
        estimate`` (:mod:`gradsift.hook.variance_refresh`), in ``exp_avg_sq`` at its frozen ``t``."""
        with torch.no_grad():
            for _, group, _ in model_groups(self.optimizer, self.numbers):
                beta2 = float(group["betas"][1])
                for param in group["params"]:
                    state = self.optimizer.state.get(param, {})
                    new = estimate.get(self.numbers.get(id(param), -1))
                    if new is not None and "exp_avg_sq" in state:
                        new = shaped_like(new, param) * bias_correction(beta2, state["step"])
                        moved = torch.lerp(state["exp_avg_sq"], new, 1.0 - beta2**elapsed)
                        state["exp_avg_sq"].copy_(torch.where(new > 0, moved, state["exp_avg_sq"]))
        self._preconditioners.clear()

    def give_back(
        self, velocity: dict[int, torch.Tensor], residual: dict[int, torch.Tensor], steps: int
    ) -> None:
        """The inverse of the takeover, when the exchange goes back to a dense one after ``steps``
        compressed steps (``velocity`` and ``residual``: the workers' means, per parameter number).

        The optimizer steps the parameters again, each with Adam's state at ``t = t_0 + steps``:
        ``m = (1 - beta1)(1 - beta1^t) u``, so its bias-corrected first moment is the method's
        ``(1 - beta1) u``; ``v = v_0 (1 - beta2^t) / (1 - beta2^t_0)``, so its bias-corrected
        second moment is the frozen one. What was never sent is applied once,
        ``x <- x - lr (1 - beta1) r / D``, as the method would have applied it on its way out.
        """
        self.detach()
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                beta1, beta2 = (float(b) for b in group["betas"])
                for param in group["params"]:
                    number, state = self.numbers.get(id(param)), self.optimizer.state.get(param, {})
                    if number is None or "exp_avg_sq" not in state:
                        continue
                    if number in residual:
                        flush = shaped_like(residual[number], param) * (1.0 - beta1)
                        param.sub_(
                            (flush / self._preconditioner(param, group)).to(param.dtype), alpha=group["lr"]
                        )
                    start = state["step"]
                    now = start + steps  # where the step count lives: no host read
                    if number in velocity:
                        moment = shaped_like(velocity[number], param) * (
                            (1.0 - beta1) * bias_correction(beta1, now)
                        )
                        state["exp_avg"].copy_(moment)
                    state["exp_avg_sq"].mul_(bias_correction(beta2, now) / bias_correction(beta2, start))
                    state["step"] = now
        self._preconditioners.clear()

    def initial_velocity(self, params: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The warm-up's bias-corrected first moment ``m / (1 - beta1^t)`` in velocity units
        (``/ (1 - beta1)``), flattened in ``params``' order (zeros for a parameter Adam never
        stepped), in float32 or the parameters' dtype where wider (the velocity's dtype,
        :meth:`~gradsift.hook.feedback.ErrorFeedback.compensate`); None without any."""
        pieces, found = [], False
        for param in params:
            state, wide = self.optimizer.state.get(param, {}), working_dtype(param.dtype)
            if "exp_avg" in state:
                found = True
                correction = (1.0 - self.beta1) * bias_correction(self.beta1, state["step"])
                pieces.append((flat_like(state["exp_avg"], param) / correction).to(wide))
            else:
                pieces.append(torch.zeros(param.numel(), dtype=wide, device=param.device))
        return torch.cat(pieces) if found else None


class OneBitAdamStep(FrozenVarianceStep):
    """1-bit Adam's momentum (Tang et al. 2021; module docstring): the frozen-variance method
    whose velocity is, after every exchange, the delivered mean ``s`` (the same on every rank),
    so the next step compensates ``u_k = beta1 s + g_k`` -- 1-bit Adam's
    ``m_k = beta1 m + (1 - beta1) g_k`` over ``1 - beta1`` -- instead of the worker's own
    ``u_k <- beta1 u_k + g_k``. What compression left out of ``s`` waits in the residuals."""

    def exchanged(self, store: Any, key: Any, mean: torch.Tensor) -> None:
        """The velocity of ``key`` becomes ``mean`` (a copy in the velocity's dtype; put new, so a
        dropped step rolls it back)."""
        velocity = store.get(VELOCITY, key)
        dtype = working_dtype(mean.dtype) if velocity is None else velocity.dtype
        store.put(VELOCITY, key, mean.to(dtype, copy=True))


#: The methods ``optimizer=`` offers for the Adam family (the hook option ``adam``).
METHODS = ("frozen-variance", "update", "onebit", "zero-one")
#: Those that freeze the second moment after a dense warm-up (which they cannot do without).
FROZEN_METHODS = ("frozen-variance", "onebit", "zero-one")
