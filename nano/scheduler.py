"""The scheduler: which sequences run in the next forward pass, and how many tokens each,
re-decided before every step (the order, the watermark, preemption and never-fit rejection:
docs/how-it-works.md#one-step, #admission-and-preemption). This file is the mechanism; the
choices it leaves open are the policy's, made from the class the engine is given (policy.py:
FCFS by default; nano/deadline's with --policy deadline).
"""
from collections import deque

from nano.block_manager import BlockManager
from nano.capacity import Capacity
from nano.config import EngineConfig
from nano.cost_model import CostModel
from nano.plan import Preemption, StepPlan, is_decode
from nano.policy import FCFS, LATE
from nano.sequence import Sequence, Status


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 kv_bytes_per_token: int, cost_model: CostModel, policy=FCFS):
        self.config = config
        self.block_manager = block_manager
        self.watermark_blocks = int(config.watermark * block_manager.num_blocks)
        self.capacity = Capacity(max_model_len, block_manager.block_size, block_manager.num_blocks,
                                 block_manager.num_blocks - self.watermark_blocks)
        self.now = 0.0                        # the time of the step being scheduled
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []     # in admission order (swapped back in: admitted again)
        self.swapped: deque[Sequence] = deque()
        self.held: list[Sequence] = []        # out of the batch with their blocks (hold, reserve)
        self.max_loras = 0                    # distinct adapters running at once (nano/lora)
        # it reads this scheduler live
        self.policy: FCFS = policy(self, cost_model, kv_bytes_per_token)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def next_arrival(self) -> float | None:
        """When the earliest request that has not arrived yet arrives (None: all have)."""
        future = [s.arrival_time for s in self.waiting if s.arrival_time > self.now]
        return min(future) if future else None

    # ---- one step ----------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        self.now = now
        plan = StepPlan()
        budget = self._schedule_running(plan, self.config.token_budget)
        if not plan.preempted:  # a step that had to preempt has no room to bring anyone back
            budget = self._schedule_swapped(plan, budget)
        if not self.swapped and not plan.preempted:
            self._schedule_waiting(plan, budget)
        return plan.freeze(self.block_manager.block_size)

    def _takes_another(self, plan: StepPlan, budget: int) -> bool:
        """Say whether the step takes another sequence: budget is left, and a seat under
        max_num_seqs."""
        return budget > 0 and len(plan.scheduled) < self.config.max_num_seqs

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        decodes = [s for s in self.running if is_decode(s.num_uncomputed_tokens)]
        prefills = [s for s in self.running if not is_decode(s.num_uncomputed_tokens)]
        budget = self._schedule_each(decodes, plan, budget)
        arrived = [s for s in self.waiting if s.arrival_time <= self.now]
        budget = self.policy.prefill_budget(budget, [s for s, _ in plan.scheduled],
                                            [*prefills, *self.swapped, *arrived])
        reserved = self.policy.reserved_for_admissions(budget, prefills, arrived)
        return self._schedule_each(self.policy.prefill_order(prefills), plan,
                                   budget - reserved) + reserved

    def _schedule_each(self, seqs: list[Sequence], plan: StepPlan, budget: int) -> int:
        for seq in seqs:
            if seq.status is not Status.RUNNING:  # preempted earlier in this step
                continue
            if not self._takes_another(plan, budget):
                break
            n = min(seq.num_uncomputed_tokens + len(seq.draft_token_ids), budget)
            del seq.draft_token_ids[n - 1:]  # those the budget leaves room to check
            if self._find_blocks(seq, n, plan):
                plan.scheduled.append((seq, n))
                budget -= n
        return budget

    def _find_blocks(self, seq: Sequence, n: int, plan: StepPlan) -> bool:
        """Find blocks for seq's next n tokens, preempting others if needed.
        Returns False if seq itself had to give way."""
        while self.block_manager.blocks_to_grow(seq, n) > self.block_manager.num_free_blocks:
            # built only when blocks run short: per sequence, it made scheduling O(B^2)
            scheduled = {s.seq_id for s, _ in plan.scheduled}
            candidates = [s for s in self.running if s.seq_id not in scheduled]
            if candidates == [seq] and not scheduled:
                # Alone and still out of blocks: no one can ever make room for it.
                self._finish(seq, "length", plan)
                return False
            victim = self.policy.victim(candidates)
            self._preempt(victim, plan)
            if victim is seq:
                return False
        self.block_manager.grow(seq, n)
        return True

    def _schedule_swapped(self, plan: StepPlan, budget: int) -> int:
        while self.swapped and self._takes_another(plan, budget):
            seq = self.swapped[0]
            n = min(seq.num_uncomputed_tokens, budget)
            # With nothing running the watermark protects no one: waive it, or a sequence
            # that grew past it could never come back.
            watermark = self.watermark_blocks if self.running else 0
            if not self.block_manager.can_swap_in(seq, n, watermark) or not self._lora_fits(seq):
                break
            self.swapped.popleft()
            plan.blocks_to_swap_in += self.block_manager.swap_in(seq)
            self.block_manager.grow(seq, n)
            self._start_running(seq)
            plan.scheduled.append((seq, n))
            budget -= n
        return budget

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        arrived = [s for s in self.waiting if s.arrival_time <= self.now]
        for seq in self._triage(arrived, plan):
            if not self._takes_another(plan, budget) or not self._lora_fits(seq):
                break
            error = self.capacity.never_fits(seq)
            if error:
                if seq.num_output_tokens:  # preempted by recompute and grown too long to return
                    self._finish(seq, "length", plan)
                else:
                    self._reject(seq, error, plan)
                continue
            # A cached token has no logits: a request that scores its prompt takes from the
            # cache only the tokens it holds scores for (after a recompute), none at first.
            scoring = seq.params.prompt_logprobs is not None
            hits = self.block_manager.match_prefix(
                seq.token_ids[:len(seq.prompt_logprobs)] if scoring else seq.token_ids, seq.lora)
            if not self.block_manager.can_admit(seq, hits, self.watermark_blocks):
                break  # no skipping ahead: a large request must not starve behind small ones
            self.waiting.remove(seq)
            self.block_manager.admit(seq, hits)
            seq.num_cached_tokens = len(hits) * self.block_manager.block_size
            # first admitted (not readmitted after a preemption, when
            if seq.scheduled_time is None:
                # it queued once already and the hit is its own blocks found again)
                seq.scheduled_time, seq.num_cached_prompt_tokens = self.now, seq.num_cached_tokens
            plan.admitted.append(seq)
            plan.prefix_queried += seq.num_tokens
            self._start_running(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            plan.scheduled.append((seq, n))
            budget -= n

    def _triage(self, arrived: list[Sequence], plan: StepPlan) -> list[Sequence]:
        """The policy's admission order, less the requests it gives up on as late, rejected."""
        order, late = self.policy.admission_order(arrived)
        for seq in late:
            self._reject(seq, f"{LATE} {self.policy.late_reason(seq)}", plan)
        return [s for s in order if s not in late]

    # ---- helpers -----------------------------------------------------------------------
    def _lora_fits(self, seq: Sequence) -> bool:
        """Say whether seq may run beside the running sequences: their distinct adapters stay
        within the device's max_loras slots, so that every step's fit (nano/lora's pool)."""
        running = {s.lora for s in self.running} - {None}
        return seq.lora is None or seq.lora in running or len(running) < self.max_loras

    def _start_running(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence: out of whichever queue holds it, its blocks back to the pool (full
        device blocks stay cached)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.SWAPPED:
            self.swapped.remove(seq)
            self.block_manager.free_swapped(seq)
        elif seq.status is Status.HELD:
            self.held.remove(seq)
            self.block_manager.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    # ---- sequences held outside the batch, with their blocks ------------------------------
    # Whoever computes or consumes a sequence's KV outside this engine's steps (a KV handoff
    # between engines) holds it here: not scheduled, its blocks kept and counted as used.
    def hold(self, seq: Sequence) -> None:
        """A running sequence out of the batch, its blocks kept, until finish() or resume()."""
        self.running.remove(seq)
        self.held.append(seq)
        seq.status = Status.HELD

    def reserve(self, seq: Sequence) -> str | bool:
        """Blocks for a sequence whose first num_computed_tokens tokens' KV is written into
        them from outside (the runner's write_blocks), held until resume(). Returns False
        while the watermark does not allow it (try again after a step), the reason when it
        could never fit, or True."""
        error = self.capacity.never_fits(seq)
        if error:
            return error
        if not self.block_manager.can_admit(seq, [], self.watermark_blocks):
            return False
        computed = seq.num_computed_tokens
        self.block_manager.admit(seq, [])
        seq.num_computed_tokens = computed
        self.held.append(seq)
        seq.status = Status.HELD
        return True

    def resume(self, seq: Sequence) -> None:
        """A held sequence back in the batch from the next step."""
        self.held.remove(seq)
        self._start_running(seq)

    def _finish(self, seq: Sequence, reason: str, plan: StepPlan) -> None:
        self.finish(seq, reason)
        plan.finished.append(seq)

    def _reject(self, seq: Sequence, error: str, plan: StepPlan) -> None:
        seq.error = error
        self._finish(seq, "rejected", plan)

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        mode, reason = self.policy.preemption_mode(seq)
        if mode == "swap":
            plan.blocks_to_swap_out += self.block_manager.swap_out(seq)
            seq.status = Status.SWAPPED
            self.swapped.append(seq)
        else:
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            seq.status = Status.WAITING
            self.waiting.appendleft(seq)  # first in line again: it was admitted before the rest
        plan.preempted.append(Preemption(seq, mode, reason))
