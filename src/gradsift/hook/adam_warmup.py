"""The end of a frozen-variance Adam method's dense warm-up, measured on the run.

The frozen methods of :mod:`gradsift.hook.adam` freeze Adam's bias-corrected second moment
``v_hat = v / (1 - beta2^t)`` when their dense warm-up ends. Without ``warmup_steps`` it ends
when ``v_hat`` has settled. After every :data:`WINDOW` optimizer steps, ``t = k WINDOW``,
each of the model's parameters ``p`` gives its total ``S_p(t) = sum_i v_hat_{p,i}(t)`` and

    rho(t) = sum_p |S_p(t) - S_p(t - WINDOW)| / sum_p S_p(t),

the relative change of the second moment over the window (the quantity 1-bit Adam's
observation is about: the variance stabilises early in training, Tang et al. 2021). It is
taken per tensor: summing a tensor's elements first averages out the per-element noise of
the squared gradients, which never settles, and keeps the drift of each layer's gradient
scale, which does. The warm-up ends after the first step ``t`` with ``rho(t) < SETTLED``
(so at the earliest after two windows: the first has nothing to compare with), and at the
latest after ``round(1 / (1 - beta2))`` steps (the largest ``beta2`` of the model's groups):
the second moment's memory, past which ``v_hat`` is an average of a fixed length whose
change over a window no longer shrinks. Neither ends it while the learning rate still rises
(a step whose largest group ``lr`` is above the previous step's): 0/1 Adam freezes the variance
at the end of the learning-rate warm-up (Lu et al. 2022), since the steps the warm-up keeps
small leave gradients whose scale is still moving, and a variance frozen before the full
rate divides every later step by it. The hook's steps from ``t`` on are compressed (the
hook counts the steps it committed, the rule the optimizer's steps since the hook took it
over: the same count when every committed step is followed by one optimizer step).

The check runs in the optimizer's step post-hook, outside backward, and reads the host
once (the totals, computed on the device); between checks it reads nothing. ``rho`` is
summed on the host with :func:`math.fsum` (exact, in any order). Every rank holds the same
``v`` -- the warm-up's gradients are the allreduced mean, and every rank's optimizer steps
the same parameters with them, which is what keeps DDP's replicas equal -- so every rank
computes the same totals and ends at the same step. The record (steps counted, the last
totals, the last step's learning rate, the end and its reason, the last ``rho``) is kept in
the optimizer's first parameter group that holds the model's parameters, under
:data:`RECORD_KEY`: it travels in
``optimizer.state_dict()``, and a resumed run ends where the uninterrupted one does.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gradsift.hook.param_groups import model_groups

#: Optimizer steps between two checks: the window of ``rho``.
WINDOW = 8
#: ``v_hat`` has settled when its relative change over a window is below this.
SETTLED = 0.05
#: The smallest frozen root an element gets, as a share of its tensor's root-mean-square root
#: (:func:`frozen_root`; docs/decisions.md has the measurement behind the value).
ROOT_FLOOR = 0.01
#: The parameter-group entry that holds the record (an optimizer checkpoint carries it).
RECORD_KEY = "gradsift_adam_warmup"
#: Why a warm-up ended: ``rho`` below :data:`SETTLED`, the memory cap, or ``warmup_steps``.
SETTLED_REASON, CAP_REASON, GIVEN_REASON = "settled", "cap", "warmup_steps"
FRESH: dict[str, Any] = {"steps": 0, "totals": None, "lr": None, "end": None, "reason": None, "change": None}


def relative_change(totals: list[float], previous: list[float]) -> float:
    """``rho = sum_p |S_p - S'_p| / sum_p S_p`` (module docstring); infinite when every
    total is zero (no second moment yet: nothing has settled) or when the two windows hold
    different parameters (a group added between them, ``add_param_group``: its moments began)."""
    whole = math.fsum(totals)
    if whole <= 0.0 or len(totals) != len(previous):
        return math.inf
    return math.fsum(abs(a - b) for a, b in zip(totals, previous, strict=True)) / whole


class SettledWarmup:
    """The measured end of the dense warm-up (module docstring), as an optimizer step post-hook.

    Args:
        optimizer: the Adam or AdamW the hook took over.
        numbers: ``id(parameter) -> number`` of the model's parameters.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, numbers: dict[int, int]) -> None:
        self.optimizer = optimizer
        self.numbers = numbers
        betas = [float(group["betas"][1]) for _, group, _ in model_groups(optimizer, numbers)]
        self.cap = max(1, round(1.0 / (1.0 - max(betas))))
        self._handle = optimizer.register_step_post_hook(self)

    def detach(self) -> None:
        """Stop counting the optimizer's steps."""
        self._handle.remove()

    @property
    def _group(self) -> dict[str, Any]:
        return next(model_groups(self.optimizer, self.numbers))[1]

    @property
    def record(self) -> dict[str, Any]:
        """The record (module docstring): ``steps``, ``totals``, ``end``, ``reason``, ``change``."""
        return self._group.get(RECORD_KEY, FRESH)

    @property
    def end(self) -> int | None:
        """The first compressed step, once decided."""
        return self.record["end"]

    def totals(self) -> list[float]:
        """``S_p`` of every model parameter in the optimizer's order (0 before its first
        step), computed on the device in float64 and read in one transfer."""
        sums = []
        for _, group, _ in model_groups(self.optimizer, self.numbers):
            beta2 = float(group["betas"][1])
            for param in group["params"]:
                if id(param) not in self.numbers:
                    continue
                state = self.optimizer.state.get(param, {})
                if "exp_avg_sq" in state:
                    correction = bias_correction(beta2, state["step"])
                    sums.append(state["exp_avg_sq"].sum(dtype=torch.float64) / correction)
                else:
                    sums.append(torch.zeros((), dtype=torch.float64, device=param.device))
        return torch.stack(sums).tolist()

    def learning_rate(self) -> float:
        """The largest ``lr`` of the groups holding the model's parameters."""
        return max(float(group["lr"]) for _, group, _ in model_groups(self.optimizer, self.numbers))

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Step post-hook: count the step; at a window's end, check ``rho``; end the warm-up
        by the cap or a settled ``rho`` unless the learning rate rose (module docstring)."""
        record = self.record
        if record["end"] is not None:
            return
        steps, rate = record["steps"] + 1, self.learning_rate()
        rising = record.get("lr") is not None and rate > record["lr"]
        update: dict[str, Any] = {"steps": steps, "lr": rate}
        settled = False
        if steps % WINDOW == 0:
            totals = self.totals()
            if record["totals"] is not None:
                update["change"] = relative_change(totals, record["totals"])
                settled = update["change"] < SETTLED
            update["totals"] = totals
        if not rising and steps >= self.cap:
            update.update(end=steps, reason=CAP_REASON)
        elif not rising and settled:
            update.update(end=steps, reason=SETTLED_REASON)
        self._group[RECORD_KEY] = {**record, **update}  # a new dict: a saved state_dict keeps its own


def bias_correction(beta: float, step: Any) -> torch.Tensor:
    """Adam's ``1 - beta^t`` for its step count ``t`` (``state["step"]``: a CPU tensor, or one on the
    parameters' device under ``capturable``/``fused``), as a 0-dim float64 tensor where ``t`` lives:
    computed by the device, never read on the host, so neither the backward (the first compressed
    step's velocity) nor the optimizer's step waits for the device. In float64, as Python's own
    ``1 - beta ** float(t)``: the same bits."""
    t = torch.as_tensor(step).double()
    return 1.0 - torch.pow(torch.full_like(t, beta), t)


def frozen_root(second_moment: torch.Tensor, correction: torch.Tensor, largest: torch.Tensor) -> torch.Tensor:
    """``sqrt(v / (1 - beta2^t))`` of a parameter at the freeze (:mod:`gradsift.hook.adam`, step 2),
    at least :data:`ROOT_FLOOR` times its tensor's root-mean-square ``sqrt(mean(v / (1 - beta2^t)))``;
    where ``v = 0``, the largest root of its tensor, and where the whole tensor is zero (the warm-up
    never moved it: a LoRA adapter's ``A`` while its ``B`` is zero), ``largest``, the model's
    (:func:`largest_root`): the smallest step the method takes anywhere, never ``m / eps``.

    Why the floor: an element whose gradient the warm-up seldom saw (a ReLU unit that rarely
    fired) freezes a root far below its tensor's, and ``1 / D`` then multiplies whatever the
    exchange delivers there -- a sign code's bucket-wide magnitude, error feedback's corrections --
    where Adam's ``v`` would have grown with the gradient. The floor bounds that gain at
    ``1 / ROOT_FLOOR`` times the tensor's typical one and keeps ``D`` a constant, so the update
    stays linear in what was sent (a clamp of ``m / D`` would not: error feedback's delayed
    elements would be shrunk). Device work only: no host read. A moment of no elements (a
    parameter of none) has the root of none."""
    if not second_moment.numel():
        return second_moment.clone()
    root = (second_moment / correction).sqrt_()
    floor = root.square().mean().sqrt_().mul_(ROOT_FLOOR)
    root = torch.maximum(torch.where(root > 0, root, root.max()), floor)
    return torch.where(root > 0, root, largest.to(root.device))


def largest_root(optimizer: torch.optim.Optimizer, numbers: dict[int, int]) -> torch.Tensor:
    """The largest ``sqrt(v / (1 - beta2^t))`` over the model's parameters (``numbers``) that have
    a second moment of one element or more, a 0-dim tensor (0 without any); device work only."""
    roots = [
        (state["exp_avg_sq"] / bias_correction(float(group["betas"][1]), state["step"])).max().sqrt()
        for _, group, _ in model_groups(optimizer, numbers)
        for state in (optimizer.state.get(p, {}) for p in group["params"])
        if "exp_avg_sq" in state and state["exp_avg_sq"].numel()
    ]
    return torch.stack([r.to(roots[0].device).double() for r in roots]).max() if roots else torch.zeros(())
