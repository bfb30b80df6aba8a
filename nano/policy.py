"""The scheduling policy: the choices scheduler.py leaves open, FCFS's answers. FCFS is the
interface another policy subclasses, chosen where the engine is built, as nano/deadline's is
(docs/how-it-works.md#how-a-policy-plugs-in).
"""
import math
from collections import deque
from typing import Protocol

from nano.block_manager import BlockManager
from nano.config import STEP_TARGET, TOKEN_BUDGET, EngineConfig
from nano.cost_model import CostModel
from nano.plan import decode_context
from nano.sequence import Sequence

LATE = "late:"  # how the reason of a request rejected as late (admission_order) starts


class SchedulerView(Protocol):
    """What a policy reads of its scheduler (scheduler.Scheduler), live as it changes during
    the step; a policy modifies none of it."""
    config: EngineConfig
    block_manager: BlockManager
    now: float                   # the time of the step being scheduled
    running: list[Sequence]      # in admission order
    swapped: deque[Sequence]


class FCFS:
    """First come, first served: admission and prefill chunks in arrival order, the victim
    the most recently admitted sequence, each step's prefill up to the token budget
    (step_tokens), no request given up on."""

    def __init__(self, view: SchedulerView, cost: CostModel, kv_bytes_per_token: int):
        self.view, self.cost, self.config = view, cost, view.config
        self.block_size, self.kv_bytes_per_token = view.block_manager.block_size, kv_bytes_per_token

    def admission_order(self, arrived: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """(the arrived waiting requests in the order they are admitted, those of them the
        scheduler rejects instead as late, with late_reason)."""
        return arrived, []

    def late_reason(self, seq: Sequence) -> str:
        """Why a request is rejected as late (the scheduler puts LATE before it)."""
        raise AssertionError("FCFS gives up on no request")

    def prefill_order(self, prefills: list[Sequence]) -> list[Sequence]:
        """Running prompts in the order they share the token budget for prefill chunks."""
        return prefills

    def prefill_budget(self, budget: int, decoding: list[Sequence], prompts: list[Sequence]) -> int:
        """What the rest of the step (prefill chunks, swap-ins, admissions) may take of the
        budget its decodes left, the prompts it could carry being `prompts`."""
        if not prompts:  # nothing to budget for: the cost model is not asked, nor fitted
            return budget
        return min(budget, self.step_tokens(
            self.cost.step_time(0, len(decoding), decode_context(decoding))))

    def step_tokens(self, decode_time: float) -> int:
        """The prefill tokens one step carries beside decodes taking `decode_time`: the token
        budget, by default what keeps the step near STEP_TARGET
        (docs/how-it-works.md#admission-and-preemption)."""
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

    def reserved_for_admissions(self, budget: int, prefills: list[Sequence],
                                arrived: list[Sequence]) -> int:
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
        if not self.view.block_manager.can_swap_out(seq):
            return "recompute", "no_swap_space"
        if self.config.preemption == "swap":
            return "swap", "forced"
        swap = self.cost.swap_cost(seq.num_computed_tokens * self.kv_bytes_per_token)
        recompute = self.cost.recompute_cost(seq.num_computed_tokens)
        return ("swap", "swap_cheaper") if swap <= recompute else ("recompute", "recompute_cheaper")
