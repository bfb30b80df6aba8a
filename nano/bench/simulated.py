"""The engine on a simulated clock: time advances only by the engine's own sleeps (waiting
for an arrival) and by a fixed step-time model charged for every forward pass. The real
forward pass still runs, so the schedule, the tokens and every metric are the engine's;
only time is exact and machine-independent, which lets a schedule be replayed and a
policy's effect be told from timing noise (tests/test_deadline.py, the lab's quick runs).
"""
import numpy as np

from nano.clock import Clock
from nano.config import EngineConfig
from nano.engine import LLMEngine
from nano.policy import FCFS
from nano.telemetry.metrics import Metrics

# What every step costs on the simulated clock: a base, plus each prompt token and each decode.
STEP_BASE, PER_PREFILL_TOKEN, PER_DECODE = 0.010, 0.001, 0.002
# The default model's step on a 2-core CPU (the step-time fit of a real run, docs/perf_notes.md):
# the base 3.3x, a prompt token 2.7x and a decode 1.7x the ones above.
CPU_STEP = (0.033, 0.0027, 0.0034)


class SimulatedClock(Clock):
    """Advances only when told: by the engine's sleeps, or by the fixed step-time model."""

    def __init__(self, start: float = 0.0):
        self.t = start

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += max(seconds, 0.0)


def simulated_engine(config: EngineConfig, step: tuple[float, float, float] = (STEP_BASE, PER_PREFILL_TOKEN, PER_DECODE),
                     jitter: float = 0.0, seed: int = 0, policy=FCFS) -> LLMEngine:
    """An LLMEngine whose every step takes what the fixed model `step` (seconds: per step, per
    prompt token, per decode) says, times a lognormal factor of sigma `jitter` drawn from
    `seed` (0: exact; > 0: steps vary as on a real clock, but reproducibly), and whose
    step-time model (cost_model.py) starts from that model's coefficients; policy: its
    scheduling policy (LLMEngine's)."""
    clock, (base, per_token, per_decode) = SimulatedClock(), step
    rng = np.random.default_rng(seed)

    def timed(forward):
        def timed_forward(batch):
            decodes = batch.num_decodes
            seconds = base + per_token * (len(batch.input_ids) - decodes) + per_decode * decodes
            clock.sleep(seconds * (rng.lognormal(0.0, jitter) if jitter else 1.0))
            return forward(batch)
        return timed_forward

    engine = LLMEngine(config, clock=clock, policy=policy, wrap_forward=timed)
    Metrics.attach(engine)
    engine.cost.coef[:] = engine.cost.prior[:] = (base, per_token, per_decode, 0.0)
    return engine
