"""When ``compressor="auto"`` measures again: the step time has drifted from what its choice
was made on (:mod:`gradsift.hook.auto`).

After the choice runs, the step time is the host clock between consecutive optimizer steps,
in windows of :data:`WINDOW` steps; at a window's end every rank takes the window's median
and the ranks agree on the largest (one small collective per window, outside backward), so
every rank sees the same numbers. A window *drifts* when its median ``m`` is off the
expected step ``e`` (the running method's predicted step, then the last re-measure's window)
by more than :data:`DRIFT`: ``|m / e - 1| > DRIFT``. Hysteresis: a re-measure is due after
:data:`PERSIST` drifting windows in a row (a window back in the band resets the count), and
the re-measure itself switches only to a method predicted :data:`~gradsift.hook.choice.MARGIN`
faster than the running one, so noise of a window or two, and near ties, change nothing.

The first window after a choice that runs *faster* than predicted (``m < (1 - DRIFT) e``)
becomes the expected step instead of a drifting window: the choice beat its prediction, and
what it was compared with -- the measured step, and the other candidates, predicted with
the same compute term (:func:`~gradsift.hook.choice.choose`) -- is not made better by that,
so a re-measure would choose the same. A first window that runs slower counts as drifting: the prediction
may have ranked the candidates wrong.

On CUDA the host clock between optimizer steps is not synchronised with the device: the
host runs at most one step ahead (each step's one host read waits for the step before), so
a window's median is the device's step time within a step's jitter.
"""

import statistics

#: Optimizer steps per window.
WINDOW = 50
#: A window drifts when its median is off the expected step by more than this fraction.
DRIFT = 0.2
#: Drifting windows in a row before a re-measure is due.
PERSIST = 2


class DriftWatch:
    """The step-time windows of the running choice and the drift rule (module docstring).

    Attributes:
        expected: the step time (seconds) the choice was made on.
        last: the agreed median of the last full window (seconds), None before one ends.
        strikes: drifting windows in a row.
    """

    def __init__(self, expected: float) -> None:
        self.expected = expected
        self.last: float | None = None
        self.strikes = 0
        self._times: list[float] = []

    def tick(self, now: float) -> float | None:
        """One optimizer step's end at host time ``now``; the window's median step time
        (seconds, this rank's) when the step ends a window of :data:`WINDOW` steps, else None."""
        self._times.append(now)
        if len(self._times) <= WINDOW:
            return None
        median = statistics.median(b - a for a, b in zip(self._times, self._times[1:], strict=False))
        self._times = [now]
        return median

    def due(self, agreed: float) -> bool:
        """Count the window of agreed median ``agreed``: True when :data:`PERSIST` windows in
        a row drifted (the count then starts over)."""
        first, self.last = self.last is None, agreed  # the choice's first window (module docstring)
        if first and agreed < (1.0 - DRIFT) * self.expected:
            self.expected = agreed  # faster than predicted: the choice stands
            return False
        drifted = abs(agreed / self.expected - 1.0) > DRIFT
        self.strikes = self.strikes + 1 if drifted else 0
        if self.strikes < PERSIST:
            return False
        self.strikes = 0
        return True

    def stats(self) -> dict[str, float | int | None]:
        """The expected step and the last window's median (ms), and the strikes counted."""
        return {
            "expected_ms": 1e3 * self.expected,
            "window_ms": None if self.last is None else 1e3 * self.last,
            "strikes": self.strikes,
        }
