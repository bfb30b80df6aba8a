"""One step's plan: what the scheduler decided for the step (SchedulerOutput), which the
runner, the engine, the metrics and the TP broadcast all read."""
from dataclasses import dataclass, field

from nano.sequence import Sequence


@dataclass
class Preemption:
    seq: Sequence
    mode: str          # swap | recompute
    reason: str        # why this mode: forced | swap_cheaper | recompute_cheaper | no_swap_space


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host, device)
    preempted: list[Preemption] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # newly given blocks from the waiting queue
    finished: list[Sequence] = field(default_factory=list)  # ended by the scheduler (rejected, or out of KV)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)
