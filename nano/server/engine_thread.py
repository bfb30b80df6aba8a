"""The server's engine side: one thread owns the LLMEngine. It takes new jobs and aborts from
its inbox between steps, runs a step, and turns each job's new tokens into text
(Detokenizer), stop-string checks and logprobs, which it puts on the job's asyncio queue
(loop.call_soon_threadsafe), so nothing the engine does blocks the event loop (app.py)."""
import asyncio
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from nano import parallel
from nano.errors import NanoError
from nano.sequence import SamplingParams, Sequence
from nano.telemetry.export import prometheus_text, snapshot
from nano.telemetry.watchdog import GRACE, Watchdog


class Detokenizer:
    """A sequence's text, token by token: the text of the tokens since a few before the last
    emitted one, minus the text of those few (vLLM's prefix/read offsets), so that a
    multi-byte character split over tokens is emitted whole, once it is complete."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix, self.read = 0, 0  # ids[prefix:read] was decoded last time as context

    def add(self, ids: list[int]) -> str:
        self.ids += ids
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if text.endswith("\ufffd"):  # an incomplete character: wait for the next token
            return ""
        self.prefix, self.read = max(self.read - 5, 0), len(self.ids)
        return text[len(before):]


class StopStrings:
    """A request's stop strings: one object its choices share. A search looks only at text
    that is new since the last one (and the few characters before it a stop string could
    start in), so a step costs what it generated, not what was generated before."""

    def __init__(self, strings: tuple[str, ...] = ()):
        self.strings = strings
        self.hold = max(map(len, strings), default=1) - 1  # the most of one that can end a text

    def find(self, text: str, new_from: int) -> int:
        """Where the first stop string in text starts (-1: none), given that none was in text[:new_from]."""
        start = max(0, new_from - self.hold)
        return min((i for i in (text.find(s, start) for s in self.strings) if i >= 0), default=-1)


@dataclass(eq=False)
class Job:
    """One choice of one request: its sequence, and the queue its events go to."""
    prompt: list[int]
    params: SamplingParams
    stops: StopStrings
    top_logprobs: int | None             # None: no logprobs
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    seq: Sequence | None = None
    tokens: int = 0                      # output tokens turned into text so far
    text: str = ""                       # all of it, stop string removed
    sent: int = 0                        # characters of text already sent
    detok: Detokenizer | None = None

    def put(self, event: dict) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class EngineThread(threading.Thread):
    """Owns the engine: inbox in, steps, text out. Stops when told (None in the inbox). A step
    that runs past stall_timeout (a TP rank stopped) fails every job and ends the process."""

    def __init__(self, engine, metrics=None, stall_timeout=None):
        super().__init__(name="nano-engine", daemon=True)
        self.engine, self.metrics = engine, metrics  # metrics: a MetricsWriter (--metrics-file)
        self.inbox: queue.Queue = queue.Queue()  # ("add", job) | ("abort", job) | ("metrics", fn) | None
        self.jobs: list[Job] = []
        self.error: str | None = None
        self.watchdog = Watchdog(stall_timeout, self._fail)

    def run(self) -> None:
        try:
            while self._take(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    with self.watchdog.step():
                        self.engine.step()
                    self._publish()
                    if self.metrics:
                        self.metrics.after_step(self.engine)
        except Exception as e:  # a bug, or a rank that stopped: every waiting client gets an error,
            self._fail(str(e) if isinstance(e, NanoError) else f"{type(e).__name__}: {e}")  # /health says so
            if not parallel.alone():  # then the job ends: the other ranks would wait for this one forever
                time.sleep(GRACE)
                parallel.exit_on_error(e, 1)

    def _fail(self, error: str) -> None:
        self.error = error
        for job in self.jobs:
            job.put({"error": "engine failed: " + error, "status": 500})

    def _take(self, block: bool) -> bool:
        """Apply what the event loop sent; False once it says stop."""
        items = [self.inbox.get()] if block else []
        while not self.inbox.empty():
            items.append(self.inbox.get_nowait())
        for item in items:
            if item is None:
                return False
            kind, value = item
            if kind == "add":
                self._add(value)
            elif kind == "abort" and value in self.jobs:
                self.engine.abort(value.seq)
                self.jobs.remove(value)
            elif kind == "metrics":  # a front over several engines (nano/dp) has its own series
                own = getattr(self.engine, "prometheus", None)
                value(own() if own else prometheus_text(snapshot(self.engine, self.engine.clock.now())))
        return True

    def _add(self, job: Job) -> None:
        try:
            job.seq = self.engine.add_request(job.prompt, job.params)
        except NanoError as e:
            job.put({"error": str(e)})
            return
        job.detok = Detokenizer(self.engine.tokenizer)
        self.jobs.append(job)

    def _publish(self) -> None:
        for job in list(self.jobs):
            seq = job.seq
            new = seq.output_token_ids[job.tokens:]
            job.tokens += len(new)
            logprobs = self._logprobs(job, new)
            searched = len(job.text)
            job.text += job.detok.add(new) if new else ""
            reason = seq.finish_reason
            cut = job.stops.find(job.text, searched)
            if cut >= 0:  # a stop string: the text ends before it, the sequence ends now
                job.text = job.text[:cut]
                if not seq.is_finished:
                    self.engine.finish(seq, "stop")
                reason = "stop"
            # Hold back what could be the start of a stop string until it is settled.
            hold = 0 if seq.is_finished else job.stops.hold
            end = max(job.sent, len(job.text) - hold)
            if end > job.sent or logprobs or seq.is_finished:
                job.put({"text": job.text[job.sent:end], "logprobs": logprobs,
                         "finish_reason": reason if seq.is_finished else None,
                         "error": seq.error if reason == "rejected" else None,
                         "prompt_tokens": seq.num_prompt_tokens, "completion_tokens": seq.num_output_tokens})
                job.sent = end
            if seq.is_finished:
                self.jobs.remove(job)

    def _logprobs(self, job: Job, new: list[int]) -> list[dict] | None:
        """Each new token's log-probability and the top ones of its distribution."""
        if job.top_logprobs is None or not new:
            return None
        rows, job.seq.logits = job.seq.logits[:len(new)], job.seq.logits[len(new):]
        out, decode = [], self.engine.tokenizer.decode
        for token, row in zip(new, rows):
            row = np.asarray(row, np.float64)
            logp = row - row.max() - np.log(np.exp(row - row.max()).sum())
            top = np.argsort(-logp)[:job.top_logprobs]
            out.append({"token": decode([token]), "logprob": float(logp[token]),
                        "top": [(decode([int(t)]), float(logp[t])) for t in top]})
        return out
