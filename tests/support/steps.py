"""What the tests' training loops and refusal checks share."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from gradsift.core.errors import InvalidOptionError, PeerFailureError


def backward_and_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, scaler: Any = None) -> None:
    """``loss.backward(); optimizer.step()``, or through ``scaler`` (scale, step, update) when given."""
    if scaler is None:
        loss.backward()
        optimizer.step()
        return
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def refusal_messages(cases: dict[str, Callable[[], Any]]) -> dict[str, str]:
    """Per case, the text of the :class:`InvalidOptionError` it raises, or ``"no error"``."""
    messages = {}
    for name, case in cases.items():
        try:
            case()
        except InvalidOptionError as error:
            messages[name] = str(error)
        else:
            messages[name] = "no error"
    return messages


def train_with_restart(
    fresh: Callable[[], tuple[Any, Any, Any]],
    steps: int,
    loss_at: Callable[[Any, int], torch.Tensor],
    resume_at: int | None = None,
    after_step: Callable[[int, Any], None] | None = None,
) -> Any:
    """The user's loop over ``(model, optimizer, hook state) = fresh()``: per step zero the
    gradients, ``loss_at(model, step).backward()``, clip the norm to 1, step; at ``resume_at``
    first save the three state dicts and go on in fresh objects loaded from them (a checkpoint
    and a restart). ``after_step(step, state)`` after each step; returns the last model."""
    model, optimizer, state = fresh()
    for step in range(steps):
        if step == resume_at:
            saved = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "hook": state.state_dict(),
            }
            model, optimizer, state = fresh()
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            state.load_state_dict(saved["hook"])
        optimizer.zero_grad()
        loss_at(model, step).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if after_step is not None:
            after_step(step, state)
    return model


def train_until_peer_failure(
    model: Any,
    optimizer: torch.optim.Optimizer,
    loss_at: Callable[[Any, int], torch.Tensor],
    steps: Iterable[int],
) -> dict[str, Any]:
    """Train over ``steps`` (zero the gradients, ``loss_at(model, step).backward()``, step) until
    a :class:`PeerFailureError`: ``{"error": its text, "seconds": how long after the first of
    these steps it came}``, or ``{"error": None}`` when none came."""
    started = time.monotonic()
    try:
        for step in steps:
            optimizer.zero_grad()
            loss_at(model, step).backward()
            optimizer.step()
    except PeerFailureError as error:
        return {"error": str(error), "seconds": time.monotonic() - started}
    return {"error": None}


def assert_the_survivor_raised(result: dict[str, Any], within_s: float = 20.0) -> None:
    """What :func:`train_until_peer_failure` returned on a rank whose peer died: the peer's end
    named, within ``within_s`` seconds."""
    assert result["error"] is not None and "a peer process is gone" in result["error"], result
    assert result["seconds"] < within_s, result


def assert_every_resume_is_the_whole_run(runs: list[dict[str, Any]]) -> None:
    """Per rank, each run restarted at a step (``result["resumed"][step]``) ends with the same
    parameters, to the bit, as the run without a restart (``result["whole"]``)."""
    for result in runs:
        for at, resumed in result["resumed"].items():
            assert torch.equal(resumed, result["whole"]), at
