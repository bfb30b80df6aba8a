"""Time as the engine sees it. Tests swap in a simulated clock to replay a schedule exactly."""
import time


class Clock:
    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(seconds, 0.0))


class SimulatedClock(Clock):
    """Advances only when told: by the engine's sleeps, or by a fixed step-time model."""

    def __init__(self, start: float = 0.0):
        self.t = start

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += max(seconds, 0.0)
