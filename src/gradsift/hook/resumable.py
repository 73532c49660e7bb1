"""What a checkpoint's hook state must share with the hook that loads it.

A hook state holds one method's state: its residuals and tables in the store, its counters
and generators. Another method would load it without an error wherever the names happen to
fit (top-k's residual into EF-signSGD's, VGC's tables into the store of ``none``) and go on
from state that is not its own. :func:`check_resumable` refuses that, and a checkpoint made
with error feedback on where the hook has it off (or the other way), another momentum, or
another ``server_feedback``. The options of one method may change across a resume (a new
ratio, say); the documented helpers (:mod:`gradsift.integrations.checkpoint`) check every
setting on top.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradsift.core.errors import InvalidOptionError


def check_resumable(
    saved: Mapping[str, Any], method: str, momentum: float | None, server_feedback: bool
) -> None:
    """Raise :class:`InvalidOptionError` unless ``saved`` (a hook's ``state_dict()``) was made by
    the compressor ``method`` (a checkpoint older than the name is not checked for it), with
    error feedback of ``momentum`` (None: without error feedback) and ``server_feedback``."""
    made = saved.get("method")
    if made is not None and made != method:
        raise InvalidOptionError(
            f"the checkpoint's hook state was made by compressor {made!r}, and this hook runs {method!r}: "
            f"its state (residuals, counters) belongs to {made!r}; register the hook with {made!r} to resume"
        )
    if (saved["feedback"] is None) != (momentum is None):
        raise InvalidOptionError(
            "checkpoint and hook disagree on error feedback (on in one, off in the other)"
        )
    if momentum is not None and float(saved["feedback"]["momentum"]) != momentum:
        raise InvalidOptionError(
            f"checkpoint was made with momentum={saved['feedback']['momentum']}, this hook has {momentum}"
        )
    if bool(saved.get("server_feedback", False)) != server_feedback:
        raise InvalidOptionError(
            "checkpoint and hook disagree on server_feedback (on in one, off in the other): the "
            "server residual would be dropped or start from zero"
        )
