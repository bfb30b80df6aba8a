"""What an experiment is (Experiment), the size it runs at (Size), and the two helpers every
experiment builds on: `engine` (a warmed-up LLMEngine with the size's model and the knobs
being varied) and `serve` (requests in, the engine stepped until they have all finished).

An experiment's `run` returns rows, one JSON-able dict per measured point; `plot` draws them
onto a matplotlib Figure; `check` says whether the claim's direction holds on them (None)
or, in one line, what failed. nano/lab/driver.py prints, writes and checks them."""
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from nano.cli.offline import warm_up
from nano.config import EngineConfig
from nano.engine import LLMEngine
from nano.lab import tiny
from nano.policy import FCFS
from nano.sequence import SamplingParams, Sequence
from nano.telemetry.metrics import Metrics


@dataclass(frozen=True)
class Size:
    quick: bool        # True: CI size, a tiny random model (seconds); False: the default model (minutes)
    model: str | None  # model folder (None: the default model, or at quick size the tiny one)
    device: str = "auto"  # auto | cpu | gpu, passed into EngineConfig
    seed: int = 0


@dataclass(frozen=True)
class Experiment:
    name: str          # the CLI name: python run.py --lab NAME
    claim: str         # one sentence: what the experiment shows
    varies: str        # the knob(s) swept
    fixed: str         # what is held fixed
    measures: str      # what is measured
    run: Callable[[Size], list[dict]]                 # rows: one dict per measured point, JSON-able
    plot: Callable[[list[dict], "matplotlib.figure.Figure"], None]  # draws the rows onto the figure
    check: Callable[[list[dict]], str | None] | None = None  # None if the claim's direction holds, else why not


def model_of(size: Size) -> str | None:
    """The model folder a size runs: its own, else the tiny one at quick size, else the default."""
    if size.model is not None:
        return size.model
    return str(tiny.model_dir()) if size.quick else None


def engine(size: Size, policy=FCFS, **config_overrides) -> LLMEngine:
    """An LLMEngine on the size's model, device and seed with `config_overrides` (EngineConfig
    fields) and the scheduling policy `policy`, warmed up (its KV pool touched, one short request run, metrics reset), so the
    first measured step pays no first-use cost."""
    eng = LLMEngine(EngineConfig(model=model_of(size), device=size.device, seed=size.seed,
                                 **config_overrides), policy=policy)
    Metrics.attach(eng)
    warm_up(eng)
    return eng


Request = tuple[list[int] | str, SamplingParams] | tuple[list[int] | str, SamplingParams, float]


def serve(eng: LLMEngine, requests: Iterable[Request]) -> list[Sequence]:
    """Add every request, (prompt, params) or (prompt, params, arrival in seconds after now),
    and step until all are finished; their sequences in the order given."""
    start = eng.clock.now()
    seqs = [eng.add_request(r[0], r[1], None if len(r) == 2 else start + r[2]) for r in requests]
    while eng.has_unfinished():
        eng.step()
    return seqs
