"""The engine's signals for autoscalers and dashboards: a snapshot of its metrics and queues,
appended to a JSONL file (--metrics-file) and given to a Prometheus export (prometheus.py),
whose registry is rewritten to a file (--metrics-prom) and served by the HTTP server (GET
/metrics). Whoever drives the engine's steps writes them (MetricsWriter.after_step): the
command line's loop, the server's engine thread; a disaggregated run's router writes its
pools' instead."""
import json
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from nano.errors import NanoError
from nano.sequence import Status
from nano.telemetry.metrics import metrics_of
from nano.telemetry.summary import speculative

# Latency histogram bucket bounds in seconds (Prometheus style: cumulative, then +Inf).
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@contextmanager
def writing(path):
    """Writing a file the user named: a failure (a full disk, a folder gone) is theirs, one line too."""
    try:
        yield
    except OSError as e:
        raise NanoError(f"cannot write {path}: {e.strerror}") from None


def histogram(values: list[float]) -> list[int]:
    """Cumulative counts per bucket bound, then the total (+Inf)."""
    counts = np.searchsorted(np.sort(values), BUCKETS, side="right").tolist() if values else [0] * len(BUCKETS)
    return counts + [len(values)]


@dataclass
class QueueState:
    """The engine's queues at one instant (arrived requests only)."""
    arrived: int
    running: int
    waiting: int
    swapped: int
    queue_tokens: int   # waiting prompt tokens + remaining output tokens of everything unfinished


def queue_state(engine, now: float) -> QueueState:
    """From the engine's unfinished sequences (held ones, a KV handoff's, are in no queue)."""
    seqs = engine.unfinished()
    queued = [q for q in seqs if q.status is Status.WAITING]
    waiting = [q for q in queued if q.arrival_time <= now]
    running = [q for q in seqs if q.status is Status.RUNNING]
    swapped = [q for q in seqs if q.status is Status.SWAPPED]
    return QueueState(
        arrived=engine.num_requests_queued - (len(queued) - len(waiting)), running=len(running),
        waiting=len(waiting), swapped=len(swapped),
        queue_tokens=sum(q.num_uncomputed_tokens for q in waiting)
        + sum(q.params.max_tokens - q.num_output_tokens for q in waiting + running + swapped))


def gauges(engine, now: float) -> dict:
    """The engine's queues and KV pool as of now (between steps too: an abort frees blocks
    without a step): what a Prometheus export reads (prometheus.EngineExport.update) and, unlike
    the history snapshot() adds, cheap enough for the server to take after every step."""
    m, queues = metrics_of(engine), queue_state(engine, now)
    num_blocks, free_blocks, _, _ = engine.kv_blocks()
    return {
        "time": now, "step": m.steps, "arrived": queues.arrived,
        "running": queues.running, "waiting": queues.waiting, "swapped": queues.swapped,
        "queue_depth_tokens": queues.queue_tokens,
        "kv_occupancy": 1 - free_blocks / num_blocks,
        "step_time": m.last_step_time,
    }


def snapshot(engine, now: float) -> dict:
    """The engine's gauges and the run's figures so far, as of now."""
    m = metrics_of(engine)
    return {
        **gauges(engine, now),
        "finished": m.requests - m.rejected, "rejected": m.rejected, "aborted": m.aborted,
        "ttft_histogram": histogram(m.ttft), "tpot_histogram": histogram(m.tpot),
        "preemptions": {"swap": m.preemptions["swap"], "recompute": m.preemptions["recompute"]},
        "prefix_cache_hit_rate": m.prefix_hits / m.prefix_queried if m.prefix_queried else 0.0,
        "mean_step_time": m.step_time / m.steps if m.steps else 0.0,
        "ttft_sum": float(sum(m.ttft)), "tpot_sum": float(sum(m.tpot)),
        **speculative(m.spec_drafts, m.spec_draft_tokens, m.spec_accepted, m.spec_accepted_per_pos),
    }


class MetricsWriter:
    """Appends snapshots to a JSONL file and/or rewrites a Prometheus text file from an
    export's registry (prometheus.Export: updated from each snapshot)."""

    def __init__(self, jsonl_path: str | None, prom_path: str | None, export, interval: int = 1):
        self.jsonl_path, self.prom_path, self.interval = jsonl_path, prom_path, interval
        self.export = export
        self.count = 0  # the engine's steps, or the snapshots ticked, so far
        if jsonl_path:  # a new run starts a new file
            with writing(jsonl_path):
                open(jsonl_path, "w", encoding="utf-8").close()

    def after_step(self, engine) -> None:
        """Whoever drives the engine calls this after each step(): every interval-th step
        the engine ran is written (a call after an idle step(), which ran nothing, is not)."""
        self._at(metrics_of(engine).steps, lambda: snapshot(engine, engine.clock.now()))

    def tick(self, snap: dict) -> None:
        """One more snapshot made elsewhere (a disaggregated run's router): every interval-th
        is written."""
        self._at(self.count + 1, lambda: snap)

    def _at(self, count: int, make_snapshot) -> None:
        if count != self.count:
            self.count = count
            if count % self.interval == 0:
                self.write(make_snapshot())

    def write(self, snap: dict) -> None:
        if self.jsonl_path:  # opened per snapshot: nothing is left open for anyone to close
            with writing(self.jsonl_path), open(self.jsonl_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(snap) + "\n")
        self.export.update(snap)
        if self.prom_path:
            self.export.write(self.prom_path)
