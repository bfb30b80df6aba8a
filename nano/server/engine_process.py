"""The engine in a process of its own, as vLLM runs its EngineCore: the server's process parses,
validates, tokenizes, compiles grammars and streams, and none of that Python work can hold the
GIL that the engine's steps wait for between their NumPy calls (docs/perf_notes.md, "The
server's own threads").

The child is forked when the server starts, so it has the engine (weights, KV pool, tokenizer)
and the grammars' vocabulary without loading anything again. It runs engine_thread.EngineThread
as one process would, fed through a pipe: the server's side translates the inbox's messages
(a job travels pickled, with a number), and the child sends each job's events back by number,
and GET /metrics' text when asked. What both processes held at the fork (the vocabulary) travels
as a reference, not as a copy.

    server process                               engine process
    inbox.put(("add", job))  --("add", n, job)-->  grammars compiled on a feeder thread, then the
                                                   engine thread's inbox
    job.events               <--("event", n, e)--  the engine thread's job.put(e)
    metrics_text()           --("metrics", k)--->  answered between messages, off the steps
    /health's error          <--("error", why)---  the engine thread failed

The child ignores SIGINT and SIGTERM (a terminal's Ctrl-C reaches the whole process group):
the server's shutdown ends it, after the open requests, through the pipe. If it ends any other
way (a stall past --stall-timeout, a crash, the kernel's OOM killer), the server fails the open
requests, says why on /health, and on_death ends it.
"""
import contextlib
import io
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future

from nano.errors import NanoError
from nano.server.engine_thread import EngineThread
from nano.server.limits import GRAMMAR_CACHE
from nano.structured.compose import Chain
from nano.structured.grammar import Grammar
from nano.structured.stack import lower_priority

log = logging.getLogger("nano.server")
FORK = multiprocessing.get_context("fork")


class EngineProcess:
    """The engine thread's surface to the server (inbox, error, is_alive, start, join), and
    GET /metrics' text, with the thread itself in a child process."""

    def __init__(self, thread_args: tuple, held_at_fork):
        """thread_args: EngineThread's, for the child to build it with; held_at_fork: returns the
        objects that requests refer to and that the child will hold too (the vocabulary)."""
        self.thread_args, self.held_at_fork = thread_args, held_at_fork
        self.shared: dict[int, object] = {}  # id -> object, the same in both processes after the fork
        self.conn, self.child_conn = FORK.Pipe()
        self.process = FORK.Process(target=self._child, name="nano-engine", daemon=True)
        self.sending = threading.Lock()  # a message is written whole, whichever threads send
        self.numbers = itertools.count()
        self.jobs = weakref.WeakValueDictionary()     # number -> job, while the server holds the job
        self.job_numbers = weakref.WeakKeyDictionary()  # job -> number
        self.replies: dict[int, Future] = {}          # GET /metrics' requests, by number
        self.error: str | None = None
        self.stopping = False
        self.on_death = None  # called once on the reader thread when the child ends unasked
        self.reader = threading.Thread(target=self._read, name="nano-engine-events", daemon=True)
        self.inbox = self  # serving.py and adapters.py put to the inbox; put() below sends

    def start(self) -> None:
        self.shared = {id(obj): obj for obj in self.held_at_fork() if obj is not None}
        self.process.start()
        self.child_conn.close()  # the child's end, so that its exit reads here as the end of the pipe
        self.reader.start()

    def is_alive(self) -> bool:
        """Whether the child runs; the reader, which alone reaps it, lives as long."""
        return self.reader.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self.reader.join(timeout)

    def put(self, item) -> None:
        """The inbox's messages (engine_thread.py's) to the child: a job as its number after it is added."""
        if item is None:
            self.stopping = True
        elif item[0] == "add":
            number = next(self.numbers)
            self.jobs[number], self.job_numbers[item[1]] = item[1], number
            item = ("add", number, item[1])
        elif item[0] == "abort":
            number = self.job_numbers.get(item[1])
            if number is None:
                return
            item = ("abort", number)
        self._send(item)

    def metrics_text(self) -> Future:
        """GET /metrics' text, to come: rendered in the child from the engine's registry."""
        reply, number = Future(), next(self.numbers)
        self.replies[number] = reply
        self._send(("metrics", number))
        if self.error and self.replies.pop(number, None):  # the child ended before the reader could see this one
            reply.set_exception(NanoError(f"engine stopped: {self.error}"))
        return reply

    def _send(self, message) -> None:
        data = _dumps(message, self.shared)
        with self.sending:
            try:
                self.conn.send_bytes(data)
            except OSError:  # the child has ended: the reader fails what waits on it
                pass

    def _read(self) -> None:
        """On a thread of the server's process: the child's messages, until it ends."""
        while True:
            try:
                kind, number, value = _loads(self.conn.recv_bytes(), self.shared)
            except (EOFError, OSError):
                break
            if kind == "event" and (job := self.jobs.get(number)) is not None:
                job.put(value)
            elif kind == "metrics" and (reply := self.replies.pop(number, None)) is not None:
                reply.set_result(value)
            elif kind == "error":
                self.error = value
        self.process.join()
        if self.stopping and self.process.exitcode == 0:
            return
        self.error = self.error or f"the engine's process ended (exit status {self.process.exitcode})"
        log.error("engine stopped: %s", self.error)
        for job in list(self.jobs.values()):
            job.put({"error": "engine failed: " + self.error, "status": 500})
        while self.replies:  # popitem is one step, so metrics_text may pop one meanwhile
            with contextlib.suppress(KeyError):
                self.replies.popitem()[1].set_exception(NanoError(f"engine stopped: {self.error}"))
        if self.on_death:
            self.on_death()

    def _child(self) -> None:
        """The child's main thread: the engine thread's loop, fed by two threads of its own."""
        signal.set_wakeup_fd(-1)  # the server's event loop's wakeup pipe is the parent's, not this process's
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.conn.close()
        conn, sending = self.child_conn, threading.Lock()

        def send(message) -> None:
            data = _dumps(message, self.shared)
            with sending:
                conn.send_bytes(data)

        thread = ReportingThread(send, *self.thread_args)
        ordered: queue.Queue = queue.Queue()  # what the feeder passes on in order, grammars compiled first
        threading.Thread(target=_receive, args=(conn, self.shared, ordered, thread, send), daemon=True).start()
        threading.Thread(target=_feed, args=(ordered, thread, send), daemon=True).start()
        thread.run()


class ReportingThread(EngineThread):
    """The engine thread in the child: a failure is also sent to the server, for /health."""

    def __init__(self, send, *args):
        self.send = send
        super().__init__(*args)

    def _fail(self, error: str) -> None:
        super()._fail(error)
        self.send(("error", None, error))


class Relay:
    """A job's event queue in the child: an event put goes to the server's process, which puts
    it on the job's own queue."""

    def __init__(self, send, number: int):
        self.send, self.number = send, number

    def put_nowait(self, event: dict) -> None:
        self.send(("event", self.number, event))


def _receive(conn, shared: dict, ordered: queue.Queue, thread: EngineThread, send) -> None:
    """The child's reader: GET /metrics answered at once, everything else to the feeder."""
    while True:
        try:
            message = _loads(conn.recv_bytes(), shared)
        except (EOFError, OSError):  # the server's process has gone: stop after the step
            message = None
        if message is not None and message[0] == "metrics":
            send(("metrics", message[1], thread.export.text()))
            continue
        ordered.put(message)
        if message is None:
            return


def _feed(ordered: queue.Queue, thread: EngineThread, send) -> None:
    """The child's feeder: each job's grammars compiled (a pickle carries a grammar's source,
    not llguidance's compiled form), off the stepping thread, then the job to the engine thread;
    aborts and adapters after it, in order. At the compile threads' lower priority, so that where
    cores are few the steps go first."""
    lower_priority()
    jobs = weakref.WeakValueDictionary()  # number -> job, while the engine thread holds the job
    grammars: OrderedDict[str, Grammar] = OrderedDict()  # by source: a request's choices share one
    while (message := ordered.get()) is not None:
        if message[0] == "add":
            _, number, job = message
            job.params.logits_processor = _compiled(job.params.logits_processor, grammars)
            job.events, job.loop = Relay(send, number), None
            jobs[number] = job
            thread.inbox.put(("add", job))
        elif message[0] == "abort":
            if (job := jobs.get(message[1])) is not None:
                thread.inbox.put(("abort", job))
        else:
            thread.inbox.put(message)
    thread.inbox.put(None)


def _compiled(processor, grammars: OrderedDict):
    """processor with each grammar in it compiled: the one of the same source compiled here
    before, or itself, compiled now."""
    if isinstance(processor, Chain):
        processor.parts = [_compiled(part, grammars) for part in processor.parts]
    if not isinstance(processor, Grammar):
        return processor
    grammar = grammars.pop(processor.source, processor)
    grammars[grammar.source] = grammar
    if len(grammars) > GRAMMAR_CACHE:
        grammars.popitem(last=False)
    grammar.compile_again()
    return grammar


def _dumps(message, shared: dict) -> bytes:
    """message pickled, with each object both processes hold as its id."""
    out = io.BytesIO()
    pickler = pickle.Pickler(out, pickle.HIGHEST_PROTOCOL)
    pickler.persistent_id = lambda obj: id(obj) if id(obj) in shared and shared[id(obj)] is obj else None
    pickler.dump(message)
    return out.getvalue()


def _loads(data: bytes, shared: dict):
    unpickler = pickle.Unpickler(io.BytesIO(data))
    unpickler.persistent_load = shared.__getitem__
    return unpickler.load()
