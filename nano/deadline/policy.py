"""The deadline policy (--policy deadline): FCFS's answers (nano/policy.py) refined for
goodput, the requests that meet both their time-to-first-token (TTFT) and time-per-output-
token (TPOT) targets: earliest-deadline-first admission and prefill, admission control priced
by the step-time model (cost_model.py), a step cut short only where that buys a target, and
late sequences preempted first. Which rule serves which target, and why each:
docs/deadline-policy.md.
"""
import math
from collections import deque

from nano.cost_model import CostModel
from nano.plan import decode_context, is_decode
from nano.policy import FCFS, SchedulerView
from nano.sequence import Sequence


class Deadline(FCFS):
    """Earliest deadline first, with admission control. Predictions depend on the time of
    the step and on the batch running in it, which it reads from its view as they change
    during the step."""

    RECENT = 64        # arrivals whose TTFT targets a step cap protects
    STEP_SHARE_OF_TTFT = 1 / 3  # of an urgent arrival's target: its own prefill (and others') fit the rest
    MARGIN = 0.9       # a capped step is planned to this share of what it must stay within
    PACE_WEIGHT = 0.2  # of the newest gap between two decoding steps in the pace

    def __init__(self, view: SchedulerView, cost: CostModel, kv_bytes_per_token: int, drop_late: bool = False):
        super().__init__(view, cost, kv_bytes_per_token)
        self.drop_late = drop_late            # reject late requests instead of admitting them behind
        self.recent_ttft: deque[float] = deque(maxlen=self.RECENT)
        self.last_arrival = -math.inf
        self.pace = 0.0                       # seconds between steps while sequences decode (averaged)
        self.last_step: float | None = None   # when the previous step with decodes was scheduled

    def admission_order(self, arrived: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        order, late = self._edf(arrived)
        return order, late if self.drop_late else []

    def _edf(self, arrived: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """(arrived in EDF order, the late ones): a request whose predicted first token (after
        the prefill work of the running prompts and of the requests before it that can still
        make it) misses its deadline is late. Late ones keep their place until one after them
        makes its deadline only without their work ahead of it; then they move behind it."""
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
        return (f"cannot meet its time-to-first-token target of {1e3 * seq.params.ttft_slo:.0f} ms "
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
        cap buys something (docs/deadline-policy.md: "short steps", TPOT), priced by the
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

    def reserved_for_admissions(self, budget: int, prefills: list[Sequence], arrived: list[Sequence]) -> int:
        """EDF across the queue line: arrived requests whose TTFT deadline comes before every
        running prompt's (and that can still make it) get their prompts' tokens first."""
        if self.view.swapped or not prefills:  # swapped sequences come back before any admission
            return 0
        first = min(self._ttft_deadline(s) for s in prefills)
        order, late = self._edf(arrived)
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
