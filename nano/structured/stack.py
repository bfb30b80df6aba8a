"""A thread with a large stack for llguidance's compiler, which recurses once per Lark rule,
`$ref` or nesting level: past a thread's default 8 MiB a deep grammar overflows the stack and
the process ends (SIGSEGV), with every request in it. The stack's pages are reserved, not
used, until a deep grammar touches them."""
from __future__ import annotations

import os
import threading

STACK_BYTES = 512 * 2**20  # holds the deepest grammar within bounds.GrammarLimits' defaults
# A grammar thread's nice value: Linux's scheduler then gives a busy engine thread about 9 parts
# of a shared core to its 1 (weights 1024 : 110), and the grammar all of an idle one. At 19
# (1024 : 15) a compile on a busy 2-core server starved past any time limit.
NICENESS = 10
_SIZING = threading.Lock()  # threading.stack_size is the process's: set, used and restored by one caller at a time


def on_large_stack(fn, *args):
    """fn(*args) on a new thread of STACK_BYTES' stack, waited for: its result, or its exception raised."""
    outcome = {}

    def run():
        lower_priority()
        try:
            outcome["result"] = fn(*args)
        except BaseException as e:  # raised again in the caller's thread
            outcome["error"] = e
    with _SIZING:
        before = threading.stack_size(STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="nano-grammar-compile")
            thread.start()
        finally:
            threading.stack_size(before)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def lower_priority() -> None:
    """Lower the calling thread's CPU priority to NICENESS, so that where cores are few the
    engine's steps go first (Linux sets a priority per thread; elsewhere nothing changes)."""
    if hasattr(os, "setpriority"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
