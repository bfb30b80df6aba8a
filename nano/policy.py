"""Scheduling policies (--policy): the choices scheduler.py leaves open.

The scheduler is the mechanism (queues, one token budget, blocks, preemption); each step
it asks its policy the questions FCFS's methods below answer, through a SchedulerView.

  FCFS      admission in arrival order; prefill chunks in admission order; the victim is
            the most recently admitted sequence; no cap, no one is given up on.
  both      a victim gives way by swap (its KV to host memory and back) or by recompute
            (blocks freed, its tokens prefilled again), whichever the cost model prices
            lower for its length, unless --preemption forces one or swap space is full.
  Deadline  maximises goodput: requests that meet both their time-to-first-token (TTFT)
            and time-per-output-token (TPOT) targets, by earliest-deadline-first admission
            and prefill, admission control priced by the step-time model (cost_model.py),
            a step cut short only where that buys a target, and late sequences preempted
            first. Which rule serves which target, and why each: docs/deadline-policy.md.
Measured on nano/bench/slo_matrix.py's matrix (docs/results.md), and what it trades for
deadlines: docs/deadline-policy.md.
"""
import math
from collections import deque
from typing import TYPE_CHECKING

from nano.config import STEP_TARGET, TOKEN_BUDGET, EngineConfig
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
        """(the arrived waiting requests in the order they are admitted, those of them that
        cannot make their targets). The scheduler rejects the second (--drop-late) with
        late_reason, or admits them in their place in the order."""
        return arrived, []

    def late_reason(self, seq: Sequence) -> str:
        """Why a request that cannot make its targets is rejected (--drop-late)."""
        raise AssertionError("FCFS gives up on no request")

    def prefill_order(self, prefills: list[Sequence]) -> list[Sequence]:
        """Running prompts in the order they share the token budget for prefill chunks."""
        return prefills

    def prefill_budget(self, budget: int, decoding: list[Sequence], prompts: list[Sequence]) -> int:
        """What the rest of the step (prefill chunks, swap-ins, admissions) may take of the
        budget its decodes left, the prompts it could carry being `prompts`."""
        return min(budget, self.step_tokens(self.cost.step_time(0, len(decoding), decode_context(decoding))))

    def step_tokens(self, decode_time: float) -> int:
        """The prefill tokens one step carries beside decodes taking `decode_time`: the token
        budget, or by default what keeps the step near STEP_TARGET, priced by the step-time
        model: a step's length is every running stream's gap between two tokens, and on a busy
        machine the model learns the slower steps and the steps get fewer tokens."""
        if self.config.max_num_batched_tokens:
            return self.config.max_num_batched_tokens
        return min(TOKEN_BUDGET, self._tokens_within(STEP_TARGET, decode_time))

    def _tokens_within(self, limit: float, decode_time: float) -> int:
        """The prefill tokens a step can carry beside its decodes and stay within `limit`
        seconds; at least one block's worth, so that prompts always make progress."""
        per_token = self.cost.coefficients.per_prefill_token
        if limit == math.inf or per_token <= 0:
            return 1 << 30
        return max(int((limit - decode_time) / per_token), self.block_size)

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

    RECENT = 64        # arrivals whose TTFT targets a step cap protects
    STEP_SHARE_OF_TTFT = 1 / 3  # of an urgent arrival's target: its own prefill (and others') fit the rest
    MARGIN = 0.9       # a capped step is planned to this share of what it must stay within
    PACE_WEIGHT = 0.2  # of the newest gap between two decoding steps in the pace

    def __init__(self, *args):
        super().__init__(*args)
        self.recent_ttft: deque[float] = deque(maxlen=self.RECENT)
        self.last_arrival = -math.inf
        self.pace = 0.0                       # seconds between steps while sequences decode (averaged)
        self.last_step: float | None = None   # when the previous step with decodes was scheduled

    def admission_order(self, arrived: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """EDF; a request whose predicted first token (after the prefill work of the running
        prompts and of the requests before it that can still make it) misses its deadline is
        late. Late ones keep their place until one after them makes its deadline only
        without their work ahead of it; then they move behind it."""
        self._note_arrivals(arrived)
        decoding = [s for s in self.view.running if is_decode(s.num_uncomputed_tokens)]
        step = self.cost.step_time(0, len(decoding), decode_context(decoding))  # once, not per request

        def makes_it(seq: Sequence, work: int) -> bool:
            return self.view.now + self._prefill_time(work, step) <= self._ttft_deadline(seq)[0]

        ahead = sum(s.num_uncomputed_tokens for s in self.view.running if not is_decode(s.num_uncomputed_tokens))
        order, late, in_place, moved = [], [], [], []  # in_place: late, not moved behind anyone yet
        for seq in sorted(arrived, key=self._ttft_deadline):
            work = ahead + seq.num_uncomputed_tokens
            if seq.first_token_time is None and not makes_it(seq, work):  # resumed: its TTFT is past
                late.append(seq)
                in_place.append(seq)
            else:
                if in_place and not makes_it(seq, work + sum(s.num_uncomputed_tokens for s in in_place)):
                    order, moved, in_place = [s for s in order if s not in in_place], moved + in_place, []
                ahead = work
            order.append(seq)
        return order + moved, late

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

    def _prefill_time(self, tokens: int, step: float, per_step: int | None = None) -> float:
        """Seconds to prefill `tokens` in steps of at most per_step tokens (the token budget),
        each also taking `step` seconds for the decodes running now."""
        steps = max(-(-tokens // (per_step or self.step_tokens(step))), 1)
        return steps * step + tokens * self.cost.coefficients.per_prefill_token

    def prefill_budget(self, budget: int, decoding: list[Sequence], prompts: list[Sequence]) -> int:
        """All the prefill the step can carry (throughput wants fewer, fuller steps) unless a
        cap buys something (the module's "short steps" and TPOT rules), priced by the
        step-time model for this step and by the recent pace of steps for the ones after it."""
        self._note_pace(decoding)
        self._note_arrivals(prompts)
        budget = super().prefill_budget(budget, decoding, prompts)
        if self.cost.coefficients.per_prefill_token <= 0:
            return budget
        step = self.cost.step_time(0, len(decoding), decode_context(decoding))
        work = min(budget, sum(s.num_uncomputed_tokens for s in prompts))
        last = max((self._ttft_deadline(s)[0] for s in prompts), default=-math.inf)
        return min(self._tokens_within(self._ttft_room(last), step), self._tpot_cap(budget, work, step, decoding, prompts))

    def _tpot_cap(self, budget: int, work: int, step: float, decoding: list[Sequence],
                  prompts: list[Sequence]) -> int:
        """The step's prefill tokens that keep the most requests on target: all of them, or
        a cut that keeps more decodes on their TPOT target than it makes prompts miss their
        first token. The cuts tried are those that would let one decoding sequence finish on
        time while every one of its remaining steps carries such a chunk."""
        best, gain = budget, 0
        for cap in sorted({self._pace_cap(s, step) for s in decoding} - {None}, reverse=True):
            if cap < work:
                g = self._decodes_saved(cap, work, step, decoding) - \
                    self._first_tokens_lost(cap, budget, step, prompts)
                best, gain = (cap, g) if g > gain else (best, gain)
        return best

    def _first_tokens_lost(self, capped: int, budget: int, step: float, prompts: list[Sequence]) -> int:
        """How many prompts steps of `capped` prefill tokens instead of `budget` would make
        miss the TTFT deadline they make otherwise (the prompts' work in EDF order)."""
        lost, work = 0, 0
        for seq in sorted((s for s in prompts if s.first_token_time is None), key=self._ttft_deadline):
            work += seq.num_uncomputed_tokens
            deadline = self._ttft_deadline(seq)[0] - self.view.now
            lost += self._prefill_time(work, step, budget) <= deadline < self._prefill_time(work, step, capped)
        return lost

    def _note_pace(self, decoding: list[Sequence]) -> None:
        """The time between this step and the previous one, if both decode, into the pace."""
        now = self.view.now
        if decoding and self.last_step is not None:
            gap = now - self.last_step
            self.pace = gap if not self.pace else (1 - self.PACE_WEIGHT) * self.pace + self.PACE_WEIGHT * gap
        self.last_step = now if decoding else None

    def _tpot_left(self, seq: Sequence) -> tuple[int, float] | None:
        """(tokens seq has still to generate, seconds left for them on its TPOT target), or
        None if it has no target or no first token yet."""
        p = seq.params
        if not p.tpot_slo or seq.first_token_time is None:
            return None
        return (p.max_tokens - seq.num_output_tokens,
                seq.first_token_time + p.tpot_slo * (p.max_tokens - 1) - self.view.now)

    def _pace_cap(self, seq: Sequence, step: float) -> int | None:
        """The prefill tokens a step may carry for seq to finish on time with a chunk that
        size in each of its remaining steps (None: no target, or no cut can save it)."""
        left = self._tpot_left(seq)
        if left is None or left[1] < left[0] * step:
            return None
        return self._tokens_within(self.MARGIN * left[1] / left[0], step)

    def _decodes_saved(self, cap: int, work: int, step: float, decoding: list[Sequence]) -> int:
        """Decoding sequences that steps of `cap` prefill tokens keep on their TPOT target and
        one step of all `work` tokens would make miss, later steps at the recent pace. The
        deferred tokens still run: a sequence still decoding when they do pays for them."""
        per_token, pace, chunks = self.cost.coefficients.per_prefill_token, max(self.pace, step), -(-work // cap)
        saved = 0
        for left, time_left in filter(None, map(self._tpot_left, decoding)):
            whole = step + work * per_token + (left - 1) * pace
            cut = min(left, chunks) * (step + cap * per_token) + max(left - chunks, 0) * pace
            saved += cut <= self.MARGIN * time_left and whole > time_left
        return saved

    def _ttft_room(self, last_deadline: float) -> float:
        """The cap an urgent arrival needs (inf if none): one like a recent request whose
        TTFT deadline, arriving now, comes before that of a prompt the step carries
        (last_deadline the latest of theirs), so that EDF would have served it first."""
        urgent = [t for t in self.recent_ttft if self.view.now + t < last_deadline]
        return self.STEP_SHARE_OF_TTFT * min(urgent, default=math.inf)

    def held_for_waiting(self, budget: int, prefills: list[Sequence], arrived: list[Sequence]) -> int:
        """EDF across the queue line: arrived requests whose TTFT deadline comes before every
        running prompt's (and that can still make it) get their prompts' tokens first."""
        if self.view.any_swapped or not prefills:  # swapped sequences come back before any admission
            return 0
        first = min(self._ttft_deadline(s) for s in prefills)
        order, late = self.admission_order(arrived)
        return min(budget, sum(s.num_uncomputed_tokens for s in order
                               if s not in late and self._ttft_deadline(s) < first))

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
