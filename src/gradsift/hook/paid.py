"""What the running method's route cost its own steps, from its telemetry: the other side of
``compressor="auto"``'s probes (:func:`gradsift.hook.choice.choose`).

A probe routes the kept buckets one after another after the step, every rank at once
(:mod:`gradsift.hook.probes`), so it counts a route's whole time. A step pays less: the
communication that the rest of backward hides, and, on shared cores, the time a rank waits
on its peers while another rank's backward runs. The hook's telemetry times the part a step
pays, per bucket: encoding, the wait for the collectives that backward did not hide, and
decoding (``compress_ms + communicate_ms + decompress_ms``,
:mod:`gradsift.core.telemetry`). :class:`PaidRoute` takes the mean of that sum per step
between two marks of the running method's telemetry totals.

Stock DDP's lean allreduce (``auto``'s dense steps under the default ``nonfinite``) times
nothing, so there is no paid route to read: the caller passes no telemetry and gets None.
"""

from gradsift.core.telemetry import Telemetry

#: The telemetry's phases a step pays for its route (milliseconds, summed over buckets).
ROUTE_PHASES = ("compress_ms", "communicate_ms", "decompress_ms")


class PaidRoute:
    """The running method's route as its steps paid it, between marks of its telemetry totals."""

    def __init__(self) -> None:
        self._mark: tuple[float, int] | None = None

    @staticmethod
    def _totals(telemetry: Telemetry | None) -> tuple[float, int] | None:
        if telemetry is None:
            return None
        total = telemetry.summary()["total"]
        return sum(total[phase] for phase in ROUTE_PHASES), total["steps"]

    def mark(self, telemetry: Telemetry | None) -> None:
        """Start counting from ``telemetry``'s totals now (None: a route not timed)."""
        self._mark = self._totals(telemetry)

    def since_mark(self, telemetry: Telemetry | None) -> float | None:
        """Seconds of route per step since the mark (None: no mark, a route not timed, or
        no step since), and a new mark at now."""
        now, then = self._totals(telemetry), self._mark
        self._mark = now
        if now is None or then is None or now[1] <= then[1]:
            return None
        return (now[0] - then[0]) / (now[1] - then[1]) / 1e3
