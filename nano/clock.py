"""Time as the engine sees it: a clock passed in (LLMEngine(config, clock)), so that tests can
swap in a simulated one and replay a schedule exactly."""
import time


class Clock:
    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(seconds, 0.0))
