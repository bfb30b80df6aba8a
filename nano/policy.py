"""Scheduling policies (--policy): the choices scheduler.py leaves open.

The scheduler is the mechanism (queues, one token budget, blocks, preemption); each step
it asks its policy the questions FCFS's methods below answer, and sees itself only through
a SchedulerView (the time of the step, what runs, whether anything is swapped out).

  FCFS      admission in arrival order; prefill chunks in admission order; the victim is
            the most recently admitted sequence; no cap, no one is given up on.
  both      a victim gives way by swap (its KV to host memory and back) or by recompute
            (blocks freed, its tokens prefilled again), whichever the cost model prices
            lower for its length, unless --preemption forces one or swap space is full.
  Deadline  maximises goodput: requests that meet both their time-to-first-token (TTFT)
            and time-per-output-token (TPOT) targets. Which rule serves which target:
    TTFT  - admission and prefill chunks in earliest-deadline-first order (deadline =
            arrival + TTFT target). EDF is the order that meets every deadline whenever
            any order can; and with the same target for everyone it is arrival order, so
            on uniform targets it is FCFS (ordering by least slack instead starts long
            prompts first, because their prefill eats their slack, and costs the many
            short requests their TTFT).
          - admission control: walking the queue in EDF order, each request's first token
            is predicted (now + the prefill work ahead of it and its own, priced by the
            step-time model of cost_model.py). One that cannot make its deadline even so is
            moved behind all those that can (--drop-late: rejected, with the reason), and
            its work no longer counts against them: a lost cause must not make others late.
          - EDF across the line between admitted and waiting: arrivals whose deadline comes
            before every running prompt's get their tokens of the step first.
          - short steps: a request arriving mid-step waits for the step to end, so a step
            is kept to a third of the tightest TTFT target among recent arrivals.
    TPOT  - decodes go first in every step (both policies); a step is no longer than each
            decoding sequence's pace (the time to its TPOT deadline over the tokens it has
            left, planned at 90%): its slack spread evenly over its remaining steps, not
            spent on one long step that would leave every later step starved of prefill.
    both  - under memory pressure the victim is a sequence that has already missed a
            target (preempting it costs no goodput), else the one with the most slack.
Measured on nano/bench/slo_matrix.py's matrix (docs/results.md, docs/perf_notes.md): never behind FCFS on
uniform targets, 1.4-1.9x its goodput with mixed urgency or long-prompt bursts near and
above capacity, on the real clock and the simulated one.

Where throughput and deadlines pull apart (the deadline policy gives up the first for
the second):
  - Capping prefill per step for TPOT makes more, smaller steps: lower throughput.
  - The cheapest victim for throughput has the least KV to move or recompute; the
    deadline victim is a late or slack-rich one, however large.
  - A request moved back as late still runs when there is room, and counts for
    throughput, not goodput; dropping it (--drop-late) loses the work spent on it.
  - EDF starts urgent short prompts before earlier long ones, so a long prompt's first-come
    prefix blocks are less often still cached when its siblings arrive.
"""
import math
from collections import deque
from typing import TYPE_CHECKING

from nano.config import EngineConfig
from nano.cost_model import CostModel
from nano.plan import decode_context, is_decode
from nano.sequence import Sequence

LATE = "late:"  # how the reason of a request rejected by --drop-late starts

if TYPE_CHECKING:  # only for annotations: the scheduler imports this module
    from nano.scheduler import Scheduler


class SchedulerView:
    """What a policy sees of its scheduler, read as it changes during the step."""

    def __init__(self, scheduler: "Scheduler"):
        self._scheduler = scheduler

    @property
    def now(self) -> float:
        """The time of the step being scheduled."""
        return self._scheduler.now

    @property
    def running(self) -> list[Sequence]:
        """The running sequences, in admission order (not to be modified)."""
        return self._scheduler.running

    @property
    def any_swapped(self) -> bool:
        return bool(self._scheduler.swapped)

    def can_swap_out(self, seq: Sequence) -> bool:
        return self._scheduler.bm.can_swap_out(seq)


class FCFS:
    """First come, first served. Its answers are the defaults that Deadline refines."""

    def __init__(self, view: SchedulerView, cost: CostModel, config: EngineConfig, block_size: int,
                 kv_bytes_per_token: int):
        self.view, self.cost, self.config = view, cost, config
        self.block_size, self.kv_bytes_per_token = block_size, kv_bytes_per_token

    def admission_order(self, arrived: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """The arrived waiting requests in the order they are admitted: (those that can
        still make their targets, those that cannot), each in order. The scheduler serves
        the second after the first, or rejects it (--drop-late) with late_reason."""
        return arrived, []

    def late_reason(self, seq: Sequence) -> str:
        """Why a request that cannot make its targets is rejected (--drop-late)."""
        raise AssertionError("FCFS gives up on no request")

    def prefill_order(self, prefills: list[Sequence]) -> list[Sequence]:
        """Running prompts in the order they share the token budget for prefill chunks."""
        return prefills

    def prefill_budget(self, budget: int, decoding: list[Sequence]) -> int:
        """What the rest of the step (prefill chunks, swap-ins, admissions) may take of the
        budget its decodes left."""
        return budget

    def held_for_waiting(self, budget: int, prefills: list[Sequence], arrived: list[Sequence]) -> int:
        """Tokens of that budget that admissions get before the running prompts' chunks."""
        return 0

    def victim(self, candidates: list[Sequence]) -> Sequence:
        """Which running sequence gives way when a sequence finds no free block."""
        return candidates[-1]  # the most recently admitted

    def preemption_mode(self, seq: Sequence) -> tuple[str, str]:
        """How a victim gives way, and why: (swap | recompute, forced | no_swap_space |
        swap_cheaper | recompute_cheaper)."""
        if self.config.preemption == "recompute":
            return "recompute", "forced"
        if not self.view.can_swap_out(seq):
            return "recompute", "no_swap_space"
        if self.config.preemption == "swap":
            return "swap", "forced"
        swap = self.cost.swap_cost(seq.num_computed_tokens * self.kv_bytes_per_token)
        recompute = self.cost.recompute_cost(seq.num_computed_tokens)
        return ("swap", "swap_cheaper") if swap <= recompute else ("recompute", "recompute_cheaper")


class Deadline(FCFS):
    """Earliest deadline first, with admission control. Predictions depend on the time of
    the step and on the batch running in it, which it reads from its view as they change
    during the step."""

    # A request that arrives during a step waits for it to end: a step's prefill is kept to
    # STEP_SHARE_OF_TTFT of the tightest TTFT target among the last RECENT arrivals.
    STEP_SHARE_OF_TTFT = 1 / 3
    RECENT = 64
    # Steps are planned to this share of the pace TPOT targets need: predictions are not exact.
    PACE_MARGIN = 0.9

    def __init__(self, *args):
        super().__init__(*args)
        self.recent_ttft: deque[float] = deque(maxlen=self.RECENT)
        self.last_arrival = -math.inf

    def admission_order(self, arrived: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """EDF; a request whose predicted first token (after the prefill work of the running
        prompts and of the requests before it that can still make it) misses its deadline is
        moved to the late list, and its work is not counted against those after it."""
        self._note_arrivals(arrived)
        ahead = sum(s.num_uncomputed_tokens for s in self.view.running
                    if not is_decode(s.num_uncomputed_tokens))
        feasible, late = [], []
        decoding = [s for s in self.view.running if is_decode(s.num_uncomputed_tokens)]
        step = self.cost.step_time(0, len(decoding), decode_context(decoding))  # once, not per request
        for seq in sorted(arrived, key=self._ttft_deadline):
            work = ahead + seq.num_uncomputed_tokens
            resumed = seq.first_token_time is not None  # preempted by recompute: TTFT is past
            if resumed or self.view.now + self._prefill_time(work, step) <= self._ttft_deadline(seq)[0]:
                feasible.append(seq)
                ahead = work
            else:
                late.append(seq)
        return feasible, late

    def _note_arrivals(self, arrived: list[Sequence]) -> None:
        """Remember the TTFT targets of requests not seen before (for the step cap)."""
        new = sorted((s for s in arrived if s.arrival_time > self.last_arrival), key=lambda s: s.arrival_time)
        self.recent_ttft.extend(s.params.ttft_slo for s in new if s.params.ttft_slo)
        self.last_arrival = max([self.last_arrival] + [s.arrival_time for s in arrived])

    def late_reason(self, seq: Sequence) -> str:
        return (f"{LATE} cannot meet its time-to-first-token target of {1e3 * seq.params.ttft_slo:.0f} ms "
                f"behind the requests that can still meet theirs")

    def prefill_order(self, prefills: list[Sequence]) -> list[Sequence]:
        return sorted(prefills, key=self._ttft_deadline)

    def _ttft_deadline(self, seq: Sequence) -> tuple[float, float]:
        """(deadline, arrival): no TTFT target sorts last, ties in arrival order; a sequence
        that has output tokens already (preempted by recompute) first, as under FCFS."""
        target = seq.params.ttft_slo
        if seq.first_token_time is not None:
            return -math.inf, seq.arrival_time
        return (math.inf if target is None else seq.arrival_time + target), seq.arrival_time

    def _prefill_time(self, tokens: int, step: float) -> float:
        """Seconds to prefill `tokens` in steps of at most the token budget, each also
        taking `step` seconds for the decodes running now."""
        steps = max(-(-tokens // self.config.max_num_batched_tokens), 1)
        return steps * step + tokens * self.cost.coefficients.per_prefill_token

    def prefill_budget(self, budget: int, decoding: list[Sequence]) -> int:
        """How long this step may be, as prefill tokens beside its decodes: no longer than
          - the pace each decoding sequence needs to meet its TPOT target: the time left to
            its deadline over the tokens it has left (TPOT is an average, so this spreads
            any slack evenly instead of spending it on one long step); sequences already
            past saving do not count;
          - STEP_SHARE_OF_TTFT of the tightest recent TTFT target: a request arriving
            mid-step waits for the step to end before its prompt can start.
        Throughput wants the largest chunks (fewer, fuller steps); the targets want short
        steps: here the two pull apart. At least one block's worth, so that prompts always
        make progress."""
        paces = [self._pace(s) for s in decoding if s.params.tpot_slo and s.first_token_time is not None]
        limits = [self.PACE_MARGIN * p for p in paces if p > 0]
        if self.recent_ttft:
            limits.append(min(self.recent_ttft) * self.STEP_SHARE_OF_TTFT)
        per_token = self.cost.coefficients.per_prefill_token
        if not limits or per_token <= 0:
            return budget
        room = min(limits) - self.cost.step_time(0, len(decoding), decode_context(decoding))
        return min(budget, max(int(room / per_token), self.block_size))

    def _pace(self, seq: Sequence) -> float:
        """Seconds per step that still meets seq's TPOT target (<= 0: it cannot)."""
        p = seq.params
        left = p.max_tokens - seq.num_output_tokens
        deadline = seq.first_token_time + p.tpot_slo * (p.max_tokens - 1)
        return (deadline - self.view.now) / left if left > 0 else math.inf

    def held_for_waiting(self, budget: int, prefills: list[Sequence], arrived: list[Sequence]) -> int:
        """EDF across the queue line: arrived requests whose TTFT deadline comes before every
        running prompt's (and that can still make it) get their prompts' tokens first."""
        if self.view.any_swapped or not prefills:  # swapped sequences come back before any admission
            return 0
        first = min(self._ttft_deadline(s) for s in prefills)
        feasible, _ = self.admission_order(arrived)
        return min(budget, sum(s.num_uncomputed_tokens for s in feasible if self._ttft_deadline(s) < first))

    def victim(self, candidates: list[Sequence]) -> Sequence:
        """One that has missed a target already (no goodput lost), else the most slack."""
        return max(candidates, key=lambda s: (self.slack(s) < 0, self.slack(s)))

    def slack(self, seq: Sequence) -> float:
        """Seconds seq can still wait and meet its latency targets, given the work it has
        left at the step times the cost model predicts; inf when it has no target."""
        p, now, cost = seq.params, self.view.now, self.cost
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
        running = self.view.running
        decoding = [s for s in running if is_decode(s.num_uncomputed_tokens)]
        return self.cost.step_time(0, max(len(running), 1), decode_context(decoding))


def make_policy(view: SchedulerView, cost: CostModel, config: EngineConfig, block_size: int,
                kv_bytes_per_token: int) -> FCFS:
    kind = Deadline if config.policy == "deadline" else FCFS
    return kind(view, cost, config, block_size, kv_bytes_per_token)
