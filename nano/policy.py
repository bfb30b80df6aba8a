"""Scheduling policies (--policy): the choices scheduler.py leaves open.

The scheduler is the mechanism (queues, one token budget, blocks, preemption); each step
it asks its policy the questions of the Policy interface below.

  FCFS      admission in arrival order; prefill chunks in admission order; the victim is
            the most recently admitted sequence; no cap, no rejection.
  Deadline  every request may carry latency targets (time to first token, time per output
            token). Its slack is the time it can still afford to wait: deadline - now -
            the work it has left, priced by the step-time model that cost_model.py fits
            online. Admission and the prefill budget go to the least slack first; the
            victim is the running sequence with the most slack; a step carries no more
            prefill tokens than the tightest slack of the sequences decoding in it can
            absorb (time per output token is an average); a waiting request whose slack is
            already negative can no longer make its target and is moved behind those that
            still can (or rejected, with --drop-late), so it does not make others late too.

Where throughput and deadlines pull apart (the deadline policy gives up the first for
the second):
  - FCFS keeps the batch full of whatever came first; slack order may start a short urgent
    prompt while a long one waits, so long prompts see worse TTFT and the first-come
    prefix blocks are less often still cached when their siblings arrive.
  - The cheapest victim to preempt for throughput is the one with the least KV to move or
    recompute; the deadline victim is the one with the most slack, however large it is.
  - Dropping a late request wastes nothing more, but the work already spent on it is lost;
    keeping it (moved back) finishes it late and counts for throughput, not for goodput.
  - Decodes go first under both policies: one token each keeps TPOT, but it takes budget
    from prefill chunks that may be nearer their TTFT deadline.
"""
import math
from typing import TYPE_CHECKING, Protocol

from nano.plan import decode_context, is_decode
from nano.sequence import Sequence

if TYPE_CHECKING:  # only for annotations: the scheduler imports this module
    from nano.scheduler import Scheduler


class Policy(Protocol):
    def late_error(self, seq: Sequence) -> str | None:
        """Why an arrived request is rejected before admission (--drop-late), or None."""

    def admission_order(self, arrived: list[Sequence]) -> list[Sequence]:
        """The arrived waiting requests in the order they are admitted."""

    def prefill_order(self, prefills: list[Sequence]) -> list[Sequence]:
        """Running prompts in the order they share the token budget for prefill chunks."""

    def prefill_budget(self, budget: int, decoding: list[Sequence]) -> int:
        """What the rest of the step (prefill chunks, swap-ins, admissions) may take of the
        budget its decodes left."""

    def victim(self, candidates: list[Sequence]) -> Sequence:
        """Which running sequence gives way when a sequence finds no free block."""


class FCFS:
    """First come, first served."""

    def late_error(self, seq: Sequence) -> str | None:
        return None

    def admission_order(self, arrived: list[Sequence]) -> list[Sequence]:
        return arrived

    def prefill_order(self, prefills: list[Sequence]) -> list[Sequence]:
        return prefills

    def prefill_budget(self, budget: int, decoding: list[Sequence]) -> int:
        return budget

    def victim(self, candidates: list[Sequence]) -> Sequence:
        return candidates[-1]  # the scheduler keeps running sequences in admission order


class Deadline:
    """Least slack first. Slack depends on the time of the step and on the batch decoding in
    it, so this policy reads both from its scheduler as they change during the step."""

    def __init__(self, scheduler: "Scheduler"):
        self.sched = scheduler

    def late_error(self, seq: Sequence) -> str | None:
        if self.sched.config.drop_late and seq.first_token_time is None and self.slack(seq) < 0:
            return f"cannot meet its time-to-first-token target of {1e3 * seq.params.ttft_slo:.0f} ms"
        return None

    def admission_order(self, arrived: list[Sequence]) -> list[Sequence]:
        return sorted(arrived, key=self._urgency)

    def _urgency(self, seq: Sequence) -> tuple[bool, float]:
        """Least slack first, but those already late behind those that can still make it."""
        slack = self.slack(seq)
        return slack < 0, slack

    def prefill_order(self, prefills: list[Sequence]) -> list[Sequence]:
        return sorted(prefills, key=self.slack)

    def prefill_budget(self, budget: int, decoding: list[Sequence]) -> int:
        """A decoding sequence's TPOT target is an average, so a long step is fine while it
        has slack; the step may add as much prefill as the tightest slack among the sequences
        decoding in it can absorb (priced per token by the cost model); sequences already
        past saving do not count. Throughput wants the largest chunks (fewer, fuller steps);
        TPOT wants short steps: here the two pull apart. At least one block's worth, so that
        prompts always make progress."""
        slacks = [self.slack(s) for s in decoding if s.params.tpot_slo and s.first_token_time is not None]
        slacks = [x for x in slacks if x >= 0]  # already late: short steps would not save it
        per_token = self.sched.cost.coef[1]
        if not slacks or per_token <= 0:
            return budget
        return min(budget, max(int(min(slacks) / per_token), self.sched.bm.block_size))

    def victim(self, candidates: list[Sequence]) -> Sequence:
        return max(candidates, key=self.slack)

    def slack(self, seq: Sequence) -> float:
        """Seconds seq can still wait and meet its latency targets, given the work it has
        left at the step times the cost model predicts; inf when it has no target."""
        p, now, cost = seq.params, self.sched.now, self.sched.cost
        prefill = seq.num_uncomputed_tokens - (seq.first_token_time is not None)
        prefill_time = cost.step_time(prefill, 0, 0) if prefill > 0 else 0.0
        if seq.first_token_time is None:
            if p.ttft_slo is None:
                return math.inf
            return seq.arrival_time + p.ttft_slo - now - prefill_time
        if p.tpot_slo is None:
            return math.inf
        remaining = p.max_tokens - seq.num_output_tokens
        deadline = seq.first_token_time + p.tpot_slo * (p.max_tokens - 1)
        return deadline - now - prefill_time - remaining * self._decode_step_time()

    def _decode_step_time(self) -> float:
        """A decode step of the batch running now (at least this sequence)."""
        running = self.sched.running
        decoding = [s for s in running if is_decode(s.num_uncomputed_tokens)]
        return self.sched.cost.step_time(0, max(len(running), 1), decode_context(decoding))


def make_policy(scheduler: "Scheduler") -> Policy:
    return Deadline(scheduler) if scheduler.config.policy == "deadline" else FCFS()
