"""The hook's settings handshake: ranks given different settings stop at registration.

Ranks that compress with different settings do not fail cleanly on their own: a mismatch of
message sizes aborts a process inside gloo, a dense step on one rank against a compressed
one on another hangs until the group's timeout, and a different seed or value dtype trains
on with replicas drifting apart. So every frontend that registers a hook state compares,
before the first step, every setting that shapes the wire or the result
(:func:`gradsift.core.agreement.check_agreement`: one all_gather of a digest):

* gradsift's version (:func:`~gradsift.core.agreement.check_agreement` adds it);
* the compressor's registry name and every option it reports (``Compressor.options()``:
  ratio, seed, levels, ...), a sparsifier's ratio as built (``density_warmup_steps`` moves
  the compressor's own from dense to it step by step; a checkpoint made on the way names it);
* every field of :class:`~gradsift.hook.options.HookOptions` (granularity, warmup_steps,
  value_dtype, exchange, nonfinite, ...: new fields are compared without a change here),
  except :data:`PER_RANK`;
* what registration resolved from them: the exchange, whether error feedback runs, the
  momentum and weight decay taken from the optimizer, the residual decay, the Adam takeover.

:data:`PER_RANK` lists the options that may differ between ranks: they shape neither the
messages nor the parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from gradsift.core.agreement import check_agreement, setting_text
from gradsift.hook.state import GradsiftHookState

#: The setting that names the weight decay the hook took from the optimizer, per parameter number.
TAKEN_DECAY = "weight decay taken from the optimizer"
#: Hook options that may differ between ranks, and why.
PER_RANK: Mapping[str, str] = {
    "log_every": "how often this rank logs its own telemetry",
    "jsonl_path": "where this rank writes its own telemetry",
}


def hook_settings(state: GradsiftHookState) -> dict[str, str]:
    """``name -> text`` of every setting of ``state`` the ranks must share (module docstring)."""
    settings = {"compressor": setting_text(state.compressor.name)}
    options = state.compressor.options()
    if "ratio" in options and state.target_ratio is not None:  # the density warm-up moves the ratio
        options["ratio"] = state.target_ratio
    for name, value in options.items():
        settings[f"compressor option {name}"] = setting_text(value)
    for field in dataclasses.fields(state.options):
        if field.name not in PER_RANK:
            settings[field.name] = setting_text(getattr(state.options, field.name))
    feedback = state.feedback
    settings["exchange (resolved)"] = setting_text(state.exchange.name)
    settings["error feedback (resolved)"] = setting_text(feedback is not None)
    settings["momentum (resolved)"] = setting_text(None if feedback is None else feedback.momentum)
    settings["residual decay (resolved)"] = setting_text(None if feedback is None else feedback.decay)
    settings[TAKEN_DECAY] = setting_text(sorted(state.weight_decay.items()))
    settings["adam takeover"] = setting_text(None if state.adam is None else type(state.adam).__name__)
    return settings


def check_hook_settings(
    state: GradsiftHookState, where: str, extra: Mapping[str, Any] | None = None, group: Any = None
) -> None:
    """Collective over ``group`` (default: the state's process group): raise
    :class:`~gradsift.core.errors.SettingsMismatchError` on every rank unless every rank holds
    the same :func:`hook_settings` (and ``extra`` settings of the frontend, by name)."""
    settings = hook_settings(state)
    for name, value in (extra or {}).items():
        settings[name] = setting_text(value)
    check_agreement(settings, state.process_group if group is None else group, where)
