"""The host's share of a decode step: the real step with the forward pass replaced by a no-op.

    python tests/bench_host.py [--batch 1 64 256] [--steps 200] [--repeats 3] [--json out.json]

Each batch size runs B sequences in steady decode (16-token random prompts, ignore_eos, greedy,
max_tokens past the run) through `LLMEngine.step`, on the CPU, with the forward pass a no-op
given through the engine's `wrap_forward` seam: it returns a fixed (R, V) float32 logits array,
R the step's logits rows. The model is a tiny random one (tests/reference.py: 2 layers, hidden
64), which sets nothing here but V and the KV pool: V is --vocab (512 by default), so that the
sampler runs its real code on real arrays while its op (an argmax over (B, V)), which a GPU runs
as a kernel, stays a small part; --vocab 49152 gives the default model's. Nothing in nano is
edited: each phase is timed by a wrapper around the method that does it, with
time.perf_counter_ns, and per step the median over --steps steps is kept, then the median over
--repeats runs. Phases: schedule (Scheduler.schedule less StepPlan.freeze), pack (StepPlan.freeze
and ModelRunner.prepare), forward (the no-op), sample (Sampler.sample), postprocess
(LLMEngine._postprocess), observe (LLMEngine._observe: the cost model's fit and the observers),
other (the rest of step()). docs/perf_notes.md records what it printed.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import numpy as np  # noqa: E402

from nano.config import EngineConfig  # noqa: E402
from nano.engine import LLMEngine  # noqa: E402
from nano.plan import StepPlan  # noqa: E402
from nano.sequence import SamplingParams  # noqa: E402
from reference import make_random_model  # noqa: E402

FREEZE = StepPlan.freeze
PHASES = ("schedule", "pack", "forward", "sample", "postprocess", "observe", "other")
PROMPT_LEN = 16
CLOCKS = ("wall", "cpu")


class PhaseTimer:
    """Nanoseconds spent in each phase of the current step, added up by the wrappers: wall
    time (time.perf_counter_ns) and this thread's CPU time (time.thread_time_ns), which leaves
    out the time other processes held the core."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.wall, self.cpu = dict.fromkeys(PHASES, 0), dict.fromkeys(PHASES, 0)

    def wrap(self, phase: str, inner, less: str | None = None):
        """Return inner timed into `phase`; the time its nested `less` phase took is taken out."""
        def timed(*args, **kwargs):
            nested = (self.wall[less], self.cpu[less]) if less else (0, 0)
            wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
            out = inner(*args, **kwargs)
            cpu, wall = time.thread_time_ns() - cpu, time.perf_counter_ns() - wall
            if less:
                wall, cpu = wall - (self.wall[less] - nested[0]), cpu - (self.cpu[less] - nested[1])
            self.wall[phase] += wall
            self.cpu[phase] += cpu
            return out
        return timed


def no_op_forward(vocab: int, max_rows: int):
    """A forward pass of the right shapes that computes nothing: logits (R, V), R the step's
    logits rows, views of one fixed random array."""
    logits = np.random.default_rng(0).standard_normal((max_rows, vocab), dtype=np.float32)

    def forward(inputs):
        return logits[:len(inputs.logits_indices)]
    return lambda real_forward: forward


def build_engine(model_dir: Path, batch: int, vocab: int, max_len: int) -> tuple:
    """An engine with the no-op forward and every phase wrapped, and its timer."""
    blocks = batch * -(-max_len // 16) + 64
    config = EngineConfig(model=str(model_dir), device="cpu", num_blocks=blocks,
                          max_num_seqs=max(batch, 1), max_model_len=max_len, swap_space=0)
    engine = LLMEngine(config, wrap_forward=no_op_forward(vocab, max(batch, PROMPT_LEN * batch)))
    timer = PhaseTimer()
    engine.forward = timer.wrap("forward", engine.forward)
    engine.sampler.sample = timer.wrap("sample", engine.sampler.sample)
    engine._postprocess = timer.wrap("postprocess", engine._postprocess)
    engine._observe = timer.wrap("observe", engine._observe)
    engine.runner.prepare = timer.wrap("pack", engine.runner.prepare)
    StepPlan.freeze = timer.wrap("pack", FREEZE)  # called inside Scheduler.schedule
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule, less="pack")
    return engine, timer


def run(model_dir: Path, batch: int, steps: int, vocab: int) -> dict:
    """Median microseconds per step, whole and per phase, wall and CPU, over `steps` decode
    steps of B sequences."""
    warm = 32
    engine, timer = build_engine(model_dir, batch, vocab, PROMPT_LEN + warm + steps + 8)
    rng = np.random.default_rng(batch)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=warm + steps + 4)
    for _ in range(batch):
        engine.add_request(rng.integers(10, vocab, PROMPT_LEN).tolist(), params)
    for _ in range(warm):  # the prefill, then decode steps until every sequence decodes
        engine.step()
    figures = {clock: {p: [] for p in ("total", *PHASES)} for clock in CLOCKS}
    for _ in range(steps):
        timer.reset()
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        engine.step()
        cpu, wall = time.thread_time_ns() - cpu, time.perf_counter_ns() - wall
        for clock, total, split in (("wall", wall, timer.wall), ("cpu", cpu, timer.cpu)):
            split["other"] = total - sum(split.values())
            figures[clock]["total"].append(total)
            for p in PHASES:
                figures[clock][p].append(split[p])
    assert len(engine.scheduler.running) == batch, "not in steady decode"
    return {clock: {p: statistics.median(v) / 1e3 for p, v in split.items()}
            for clock, split in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    model_dir = make_random_model(Path(tempfile.mkdtemp()) / "tiny", vocab=args.vocab,
                                  max_pos=PROMPT_LEN + 64 + args.steps)
    results = {clock: {} for clock in CLOCKS}
    for batch in args.batch:
        runs = [run(model_dir, batch, args.steps, args.vocab) for _ in range(args.repeats)]
        for clock in CLOCKS:
            results[clock][batch] = {p: round(statistics.median(r[clock][p] for r in runs), 1)
                                     for p in ("total", *PHASES)}
            results[clock][batch]["runs"] = [round(r[clock]["total"], 1) for r in runs]
    for clock in CLOCKS:
        print(f"us per decode step, {clock} time (median of {args.steps} steps, median of "
              f"{args.repeats} runs), V = {args.vocab}")
        print(f"{'B':>5} {'total':>8} " + " ".join(f"{p:>11}" for p in PHASES) + "  runs")
        for batch, r in results[clock].items():
            print(f"{batch:>5} {r['total']:>8.1f} " + " ".join(f"{r[p]:>11.1f}" for p in PHASES)
                  + f"  {r['runs']}")
    report = {"vocab": args.vocab, "steps": args.steps, "repeats": args.repeats,
              "load": os.getloadavg(), "us_per_step": results}
    print(json.dumps(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
