"""A circuit breaker per tool: stop calling a server that no longer accepts connections, and probe it
again after a cool-down (Nygard, *Release It!*, 2nd ed., ch. 5 "Circuit Breaker").

States: ``closed`` (calls go through) → ``open`` after ``failures`` consecutive calls that could not connect
(calls are refused at once) → ``half_open`` once ``cooldown_s`` has passed (one probe call goes through, the
others are still refused) → ``closed`` when the probe reaches the server, or ``open`` again when it cannot.
Only connection failures count; a timeout is neither a failure nor a success (the server accepted the
connection), and any answer, even an HTTP error, shows that the server is there.
"""

from __future__ import annotations

import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
#: What :meth:`Circuit.record` reports: the circuit opened (it was closed), opened again after a failed
#: probe, or closed after a probe reached the server.
OPENED, REOPENED, RECOVERED = "opened", "reopened", "recovered"


class Circuit:
    """The circuit of one tool.

    Args:
        failures: consecutive connection failures that open the circuit (>= 1).
        cooldown_s: seconds an open circuit refuses calls before a probe may go through.
        clock: monotonic seconds (a parameter for tests).
    """

    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if failures < 1 or cooldown_s < 0:
            raise ValueError(f"circuit needs failures >= 1 and cooldown_s >= 0, got {failures}, {cooldown_s}")
        self.failures, self.cooldown_s, self._clock = failures, cooldown_s, clock
        self.state = CLOSED
        self.consecutive = 0
        self.opened_at: float | None = None  # when the current outage began (first opening)
        self._retry_at = 0.0
        self._probing = False

    def admit(self) -> str | None:
        """Whether a call may go out now: ``"call"``, ``"probe"`` (the one call of ``half_open``), or None."""
        if self.state == CLOSED:
            return "call"
        if self.state == OPEN and self._clock() >= self._retry_at:
            self.state = HALF_OPEN
        if self.state == HALF_OPEN and not self._probing:
            self._probing = True
            return "probe"
        return None

    def retry_in_s(self) -> float:
        """Seconds until the next probe may go out (0 when one may go now or is in flight)."""
        return max(0.0, self._retry_at - self._clock()) if self.state == OPEN else 0.0

    def record(self, outcome: str, probe: bool = False) -> str | None:
        """Record how an admitted call ended: ``"connect"`` (could not connect), ``"neutral"`` (timed out or
        was cancelled) or ``"answered"`` (the server answered, whatever it said); ``probe``: it was admitted
        as the probe.

        Returns:
            :data:`OPENED`, :data:`REOPENED` or :data:`RECOVERED` when the state changed that way, else None.
        """
        if probe:
            self._probing = False
        if outcome == "answered":
            self.consecutive = 0
            if self.state != CLOSED:
                self.state, self.opened_at = CLOSED, None
                return RECOVERED
            return None
        if outcome != "connect":
            return None
        self.consecutive += 1
        if (probe and self.state == HALF_OPEN) or (self.state == CLOSED and self.consecutive >= self.failures):
            first = self.state == CLOSED
            self.state, self._retry_at = OPEN, self._clock() + self.cooldown_s
            if first:
                self.opened_at = self._clock()
                return OPENED
            return REOPENED
        return None
