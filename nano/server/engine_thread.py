"""The server's engine side: one thread owns the LLMEngine. It takes new jobs and aborts from
its inbox between steps, runs a step, and turns each job's new tokens into text
(Detokenizer), stop-string checks and logprobs, which it puts on the job's asyncio queue
(loop.call_soon_threadsafe), so nothing the engine does blocks the event loop (app.py). It
alone touches nano/lora's pool of LoRA adapters: weights read on worker threads come in
through the inbox (adapters.py)."""
import asyncio
import logging
import queue
import re
import threading
import time
from dataclasses import dataclass

import numpy as np

from nano.cli.output import exit_on_error
from nano.errors import NanoError
from nano.lora.peft import Adapter, LoRARequest
from nano.lora.pool import AdapterPool
from nano.sequence import SamplingParams, Sequence
from nano.telemetry.export import gauges
from nano.telemetry.prometheus import EngineExport
from nano.telemetry.watchdog import GRACE, Watchdog, alone

log = logging.getLogger("nano.server")


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


# GPT-2's byte-level alphabet, which byte-level vocabularies spell their tokens in: each byte's
# character (the printable ones as themselves, the rest from 256 on), inverted.
_PRINTABLE = [*range(33, 127), *range(161, 173), *range(174, 256)]
BYTE_OF = {chr(c): b for b, c in zip(_PRINTABLE + [b for b in range(256) if b not in _PRINTABLE],
                                     _PRINTABLE + list(range(256, 512 - len(_PRINTABLE))))}


def token_view(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token as logprobs show it, and its bytes: its text, a special token as itself
    ("<|im_end|>"); a piece of a character, which is no text alone, as OpenAI's API writes
    it ("bytes:\\xe2\\x80"), or as vLLM's "token_id:N" if its bytes are not known."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if "\ufffd" not in text:
        return text, list(text.encode())
    piece = tokenizer.hf.id_to_token(token_id) or ""  # a byte-level vocabulary spells it a character a byte
    byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)  # SentencePiece's byte-fallback tokens
    if byte is None and not (piece and all(c in BYTE_OF for c in piece)):
        return f"token_id:{token_id}", []
    raw = [int(byte[1], 16)] if byte else [BYTE_OF[c] for c in piece]
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def logprob_entry(tokenizer, token_id: int, logprob: float | None, **more) -> dict:
    """One token's logprob as both APIs' shapes are built from it (app.py)."""
    text, raw = token_view(tokenizer, token_id)
    return {"token": text, "id": token_id, "bytes": raw, "logprob": logprob, **more}


class StopStrings:
    """A request's stop strings: one object its choices share. A search looks only at text
    that is new since the last one (and the few characters before it a stop string could
    start in), so a step costs what it generated, not what was generated before."""

    def __init__(self, strings: tuple[str, ...] = ()):
        self.strings = strings
        self.hold = max(map(len, strings), default=1) - 1  # the most of one that can end a text

    def find(self, text: str, new_from: int) -> int:
        """Where the first stop string in text starts (-1: none), given that none was in text[:new_from]."""
        return self.span(text, new_from)[0]

    def span(self, text: str, new_from: int) -> tuple[int, int]:
        """The first stop string's (start, end) in text ((-1, -1): none), as find."""
        start = max(0, new_from - self.hold)
        return min(((i, i + len(s)) for s in self.strings if (i := text.find(s, start)) >= 0), default=(-1, -1),
                   key=lambda span: span[0])


@dataclass(eq=False)
class Job:
    """One choice of one request: its sequence, and the queue its events go to."""
    prompt: list[int]
    params: SamplingParams
    stops: StopStrings
    top_logprobs: int | None             # None: no logprobs
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    echo: bool = False                   # the first event's text and logprobs start with the prompt's
    prompt_logprobs: int | None = None   # vLLM's prompt_logprobs, sent with the first event
    min_tokens: int = 0                  # no stop string ends the output before this many tokens
    include_stop: bool = False           # the text ends after the stop string found, not before it
    constrained: bool = False            # a grammar constrains the output (params.logits_processor has failure())
    base: int = 0                        # text offset of the first output token (the echoed prompt's length)
    seq: Sequence | None = None
    tokens: int = 0                      # output tokens turned into text so far
    text: str = ""                       # all of it, stop string removed
    sent: int = 0                        # characters of text already sent
    detok: Detokenizer | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop_token_ids id that ended it, set
    # before the event that finishes it is put
    lora: LoRARequest | None = None      # the adapter the request names (None: the base model)
    adapter: Adapter | None = None       # its weights, read again on a worker thread: host memory had dropped them

    def put(self, event: dict) -> None:
        if self.loop is None:  # in the engine's own process (engine_process.py): events relays them
            self.events.put_nowait(event)
        else:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def __getstate__(self):  # to the engine's own process, which gives the job a way back
        return {**self.__dict__, "events": None, "loop": None}


class EngineThread(threading.Thread):
    """Owns the engine: inbox in, steps, text out. Stops when told (None in the inbox). A step
    blocked for stall_timeout seconds, or under MPI a rank silent that long (telemetry/watchdog.py),
    fails every job, then ends the process."""

    def __init__(self, engine, metrics=None, stall_timeout=None, model_name: str | None = None,
                 pool: AdapterPool | None = None):
        """pool: nano/lora's, when the server serves LoRA adapters."""
        super().__init__(name="nano-engine", daemon=True)
        self.engine, self.metrics = engine, metrics  # metrics: a MetricsWriter (--metrics-file)
        self.pool = pool
        self.retiring: list[LoRARequest] = []  # adapters unloaded that jobs still use
        # GET /metrics renders this registry, which this thread sets from the engine between steps:
        # --metrics-prom's, or one of its own (labelled model_name); a front over several engines
        # (nano/dp) has its own.
        front = engine if hasattr(engine, "snapshot") else None  # nano/dp's Front, not an LLMEngine
        self.export = (front.export if front else metrics.export if metrics else
                       EngineExport(engine, model_name, pool.max_loras if pool else None))
        self.snapshot = front.snapshot if front else lambda: gauges(engine, engine.clock.now())
        # ("add", job) | ("abort", job) | ("keep", an adapter's weights) | ("retire", its request) | None
        self.inbox: queue.Queue = queue.Queue()
        self.jobs: list[Job] = []
        self.error: str | None = None
        self.watchdog = Watchdog(stall_timeout, self._fail)

    def run(self) -> None:
        try:
            self._refresh()
            while self._take(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    with self.watchdog.step():
                        self.engine.step()
                    events = self._publish()
                    if self.metrics:
                        self.metrics.after_step(self.engine)
                    self._refresh()  # before the events go out: a client that has its answer finds it counted
                    for job, event in events:
                        job.put(event)
                    self._forget_unused()
        except Exception as e:  # a bug, or a rank that stopped: every waiting client gets an error,
            self._fail(str(e) if isinstance(e, NanoError) else f"{type(e).__name__}: {e}")  # /health says so
            if not alone():  # then the job ends: the other ranks would wait for this one forever
                time.sleep(GRACE)
                exit_on_error(e, 1)
        finally:
            self.watchdog.close()

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
            elif kind == "keep":
                self.pool.keep(value)
            elif kind == "retire":
                self.pool.retire(value.lora_int_id)
                self.retiring.append(value)
        self._forget_unused()
        if items:  # arrivals and freed blocks show before the next step, which may take long
            self._refresh()
        return True

    def _refresh(self) -> None:
        """GET /metrics' registry set from the engine as it is now: about 12 us, whatever the
        requests served so far (docs/server.md, Metrics)."""
        self.export.update(self.snapshot())

    def _forget_unused(self) -> None:
        """Drop the weights of each unloaded adapter that no job uses any more (the inbox's
        order puts every job that names it before its "retire")."""
        if not self.retiring:
            return
        used = {job.lora for job in self.jobs}
        for request in [r for r in self.retiring if r not in used]:
            self.pool.forget(request.lora_int_id)
            self.retiring.remove(request)

    def _add(self, job: Job) -> None:
        if job.adapter is not None:
            self.pool.keep(job.adapter)
        try:
            job.seq = self.engine.add_request(job.prompt, job.params, lora_request=job.lora)
        except NanoError as e:
            job.put({"error": str(e)})
            return
        job.detok = Detokenizer(self.engine.tokenizer)
        self.jobs.append(job)

    def _publish(self) -> list[tuple[Job, dict]]:
        """Each job's news since the last step, as (job, event): sent by the caller."""
        events = []
        for job in list(self.jobs):
            seq = job.seq
            if job.constrained and (why := job.params.logits_processor.failure(seq)):
                events.append((job, self._failed(job, why)))
                continue
            new = seq.output_token_ids[job.tokens:]
            first = job.tokens == 0 and bool(new or seq.is_finished) and seq.error is None
            prompt_text, prompt_lp, vllm_lp = self._prompt(job) if first else ("", [], None)
            logprobs, (start, stop_end) = self._read(job, new)
            reason = seq.finish_reason
            if start >= 0:  # a stop string: the text ends before it (or after it), the sequence ends now
                job.stop_reason = job.text[start:stop_end]
                job.text = job.text[:stop_end if job.include_stop else start]
                if not seq.is_finished:
                    self.engine.finish(seq, "stop")
                reason = "stop"
            elif reason == "stop":
                job.stop_reason = self._stop_token(job)
            # Hold back what could be the start of a stop string until it is settled.
            hold = 0 if seq.is_finished else job.stops.hold
            end = max(job.sent, len(job.text) - hold)
            if end > job.sent or logprobs or seq.is_finished or first:
                if prompt_lp and job.top_logprobs is not None:
                    logprobs = prompt_lp + (logprobs or [])
                events.append((job, {
                    "text": prompt_text + job.text[job.sent:end], "logprobs": logprobs, "prompt_logprobs": vllm_lp,
                    "finish_reason": reason if seq.is_finished else None,
                    "error": seq.error if reason == "rejected" else None,
                    "completion_tokens": job.tokens,
                    "cached_tokens": seq.num_cached_prompt_tokens or 0}))  # None: not admitted yet
                job.sent = end
            if seq.is_finished:
                self.jobs.remove(job)
        return events

    def _stop_token(self, job: Job) -> int | None:
        """The stop_token_ids id that ended a choice, as vLLM reports it; None when EOS did (an
        id that is both is EOS's, as vLLM checks EOS first)."""
        last, params = job.seq.output_token_ids[-1], job.params
        if last in self.engine.tokenizer.eos_token_ids and not params.ignore_eos:
            return None
        return last if last in params.stop_token_ids else None

    def _failed(self, job: Job, why: str) -> dict:
        """End a choice whose grammar failed mid-output (or found the request's controls
        against it): the reason logged, an error event in place of a finish."""
        self.engine.finish(job.seq, "error")
        self.jobs.remove(job)
        log.warning("request %s: its grammar failed after %d tokens: %s", job.seq.seq_id, job.seq.num_output_tokens,
                    why)
        return {"error": f"the output cannot go on under its grammar: {why}", "status": 400}

    def _read(self, job: Job, new: list[int]) -> tuple[list[dict] | None, tuple[int, int]]:
        """The new tokens into the job's text, one at a time as a step of one token each would
        (speculative decoding adds several): their logprob entries, and the first stop string's
        span ((-1, -1): none). The tokens after the one that completes a stop string are left
        out: not in the text, the logprobs or the count, as without drafts."""
        logprobs, span = [], (-1, -1)
        for token in new or [None]:
            if token is not None:
                logprobs += self._logprobs(job, [token]) or []
                job.tokens += 1
            searched = len(job.text)
            job.text += job.detok.add([token]) if token is not None else ""
            if job.tokens >= job.min_tokens:  # vLLM's rule: no stop before min_tokens
                span = job.stops.span(job.text, searched)
                if span[0] >= 0:
                    break
        return logprobs or None, span

    def _prompt(self, job: Job) -> tuple[str, list[dict], list | None]:
        """Once the prompt is scored (the engine's prompt_logprobs, with the first token or the
        end): with echo, its text and its tokens' logprob entries (offsets into that text; the
        output's follow it); with prompt_logprobs, vLLM's list (None, then per token
        {id: {logprob, rank, decoded_token}}, the token's own and the top ones)."""
        seq, tok, text = job.seq, self.engine.tokenizer, ""
        entries, detok = [], Detokenizer(tok)
        scores = seq.prompt_logprobs + [None] * (seq.num_prompt_tokens - len(seq.prompt_logprobs))  # unscored: echo alone
        for token, score in zip(seq.token_ids[:seq.num_prompt_tokens], scores if job.echo else []):
            logprob, rank, top = score or (None, None, [])
            top = [logprob_entry(tok, t, lp) for t, lp in top[:job.top_logprobs or 0]]
            entries.append(logprob_entry(tok, token, logprob, top=top if score else None, offset=len(text)))
            text += detok.add([token])
        job.base = len(text)
        if job.prompt_logprobs is None:
            return text, entries, None
        vllm = [None]
        for token, (logprob, rank, top) in zip(seq.token_ids[1:], seq.prompt_logprobs[1:]):
            ranked = [(token, logprob, rank)] + [(t, lp, r) for r, (t, lp) in enumerate(top[:job.prompt_logprobs], 1)]
            vllm.append({str(t): {"logprob": lp, "rank": r, "decoded_token": token_view(tok, t)[0]} for t, lp, r in ranked})
        return text, entries, vllm

    def _logprobs(self, job: Job, new: list[int]) -> list[dict] | None:
        """Each new token's log-probability and the top ones of its distribution."""
        if job.top_logprobs is None or not new:
            return None
        rows, job.seq.logits = job.seq.logits[:len(new)], job.seq.logits[len(new):]
        out, tok = [], self.engine.tokenizer
        for token, row in zip(new, rows):
            row = np.asarray(row, np.float64)
            logp = row - row.max() - np.log(np.exp(row - row.max()).sum())
            top = np.argsort(-logp)[:job.top_logprobs]
            out.append(logprob_entry(tok, token, float(logp[token]), offset=job.base + len(job.text),
                                     top=[logprob_entry(tok, int(t), float(logp[t])) for t in top]))
        return out
