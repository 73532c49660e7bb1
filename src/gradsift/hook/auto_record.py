"""What ``compressor="auto"`` reports and checkpoints: :class:`AutoRecord`, the read-outs of
:class:`~gradsift.hook.auto.AutoHookState` (the deciding is :mod:`gradsift.hook.auto`'s).

``stats()`` and ``state_dict()`` are the running method's with an ``"auto"`` entry: the choice,
the step it was made at, the predicted and measured times and the methods left; a checkpoint
also carries when a pending switch takes effect, so a resumed run continues the chosen method
bit for bit. The running method's attributes (``step``, ``compressor``, ...) read through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gradsift.core.errors import InvalidOptionError
from gradsift.hook import choice
from gradsift.hook.drift import DriftWatch
from gradsift.hook.state import GradsiftHookState


def _running(name: str) -> Any:
    """A read-only attribute of ``auto``'s state that reads the running method's state."""
    return property(lambda self: getattr(self.current, name), doc=f"The running method's ``{name}``.")


class AutoRecord:
    """The read-outs and checkpoints of :class:`~gradsift.hook.auto.AutoHookState` (module docstring)."""

    dense: GradsiftHookState
    current: GradsiftHookState
    choice: str
    decided_at: int | None
    switch_at: int | None
    pending: str | None
    switched_at: int | None
    predicted_ms: dict[str, float]
    measured_ms: dict[str, float]
    left: dict[str, str]
    remeasures: int
    watch: DriftWatch | None
    _switch: Callable[[str, int], None]

    @property
    def measured_on(self) -> str:
        """The method the measuring steps run: the found family's :data:`~gradsift.hook.choice.START`."""
        return choice.START[choice.family(self.dense.optimizer, self.dense.layout.numbers)]

    def stats(self) -> dict[str, Any]:
        """The running method's :meth:`~GradsiftHookState.stats` with ``"auto"``: the choice,
        the step it was made at, the predicted step times, the measured parts (ms) and the
        methods left, with why."""
        stats = self.current.stats()
        drift = None if self.watch is None else self.watch.stats()
        stats["auto"] = {**self._record(), "measured_on": self.measured_on, "remeasures": self.remeasures}
        stats["auto"]["drift"] = drift
        return stats

    def _record(self) -> dict[str, Any]:
        """What :meth:`stats` and :meth:`state_dict` both report."""
        return {
            "choice": self.choice,
            "running": self.current.compressor.name,
            "decided_at": self.decided_at,
            "predicted_ms": dict(self.predicted_ms),
            "measured_ms": dict(self.measured_ms),
            "left": dict(self.left),
        }

    def state_dict(self) -> dict[str, Any]:
        """The running method's :meth:`~GradsiftHookState.state_dict` with ``"auto"``: the
        choice, when it takes effect, and what it was made from."""
        switches = {"switch_at": self.switch_at, "pending": self.pending, "switched_at": self.switched_at}
        return {**self.current.state_dict(), "auto": {**self._record(), **switches}}

    def prepare_load(self, entry: dict[str, Any]) -> GradsiftHookState:
        """The method state that loads ``entry`` (a :meth:`state_dict`): the optimizer found,
        and the method the saving run was running switched to."""
        if "auto" not in entry:
            raise InvalidOptionError(
                "this hook state was saved by a hook registered with a named compressor, not with "
                "compressor='auto': register the hook with the compressor the saving run named to "
                "resume it (auto's choice is not in it)"
            )
        self.dense.prepare_load(entry)
        auto = entry["auto"]
        if auto["running"] != self.current.compressor.name:
            self._switch(auto["running"], auto["switched_at"])
        return self.current

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: the choice, and the running method with its state."""
        self.prepare_load(state)
        auto = state["auto"]
        self.choice, self.decided_at, self.switch_at = auto["choice"], auto["decided_at"], auto["switch_at"]
        self.pending, self.switched_at = auto["pending"], auto["switched_at"]
        self.predicted_ms, self.measured_ms = dict(auto["predicted_ms"]), dict(auto["measured_ms"])
        self.left = dict(auto.get("left", {}))  # an older checkpoint has none
        self.current.load_state_dict({key: value for key, value in state.items() if key != "auto"})

    step = _running("step")
    last_step_skipped = _running("last_step_skipped")
    compressor = _running("compressor")
    options = _running("options")
    exchange = _running("exchange")
    feedback = _running("feedback")
    adam = _running("adam")
    weight_decay = _running("weight_decay")
    layout = _running("layout")
    target_ratio = _running("target_ratio")
    telemetry = _running("telemetry")
    process_group = _running("process_group")
