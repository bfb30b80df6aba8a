"""Threads that compile grammars, apart from the engine's thread and the server's event loop.
Each has a stack far larger than a thread's default (8 MiB), because llguidance recurses once
per rule, `$ref` or nesting level and a stack overflow ends the whole process; the stack's
pages are reserved, not used, until a deep grammar touches them. A fixed number of threads
bounds how many grammars compile at once: a grammar that runs past its caller's time limit
keeps its thread until llguidance's own limits end it, and the requests behind it wait."""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

STACK_BYTES = 512 * 2**20  # covers the deepest grammar within bounds.GrammarLimits' defaults


class CompilePool:
    def __init__(self, workers: int, stack_bytes: int = STACK_BYTES):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        before = threading.stack_size(stack_bytes)  # for the threads made here only
        try:
            self.threads = [threading.Thread(target=self._work, name=f"nano-grammar-{i}", daemon=True)
                            for i in range(workers)]
            for thread in self.threads:
                thread.start()
        finally:
            threading.stack_size(before)

    def submit(self, fn, *args) -> Future:
        """Run fn(*args) on the next free thread; its Future may be cancelled until it starts."""
        future = Future()
        self.jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self.jobs.get()
            if not future.set_running_or_notify_cancel():
                continue  # its caller stopped waiting before it started
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # the caller sees it, as a ThreadPoolExecutor's would
                future.set_exception(e)
