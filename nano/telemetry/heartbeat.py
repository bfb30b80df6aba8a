"""Under mpirun: every rank's heartbeat, heard by every other, from the first collective to the last.

A rank that stops (SIGSTOP, a lost host, a process frozen whole) leaves the others waiting
for it in a collective, spinning: neither their CPU time nor the length of their step says
anything about it. So from the moment MPI starts (run.py, before the first collective) each
rank runs a thread that sends every other rank a one-byte heartbeat every --stall-timeout / 4
seconds (at most a second apart), on a communicator of its own (a duplicate of the world's,
so heartbeats never meet the run's messages), and hears theirs. A long step is no silence:
the thread runs beside it (NumPy's kernels and MPI's calls release the GIL). A rank silent
past --stall-timeout has stopped, or its host is cut off: the job ends with one line naming
it and its host, said by the lowest-ranked rank that still hears the others (so it is said
once by each side of a cut), after the drivers are told (watchdog.end_stalled: the server
fails its open requests first). Each rank's first message to the others is its host name,
so that the line can name the host even when the ranks' hosts share nothing but the network.

A rank that finds a gap in its own ticks far past their period was itself stopped (or
starved of CPU): the silence it did not hear is not the others', so it listens afresh
instead of blaming them; if it was stopped long enough, the others have ended the job,
naming it. At the end each rank says goodbye and waits for the others' goodbyes, still
watching those not yet gone, so that MPI_Finalize, where they all meet, is reached by all.
"""
import atexit
import math
import socket
import threading
import time

import numpy as np

from nano.errors import NanoError
from nano.telemetry import watchdog

BEAT, BYE = np.array([1], np.int8), np.array([0], np.int8)  # what one rank sends another
NAME = 1  # the tag of a rank's first message: its host name (beats and goodbyes go on tag 0)
_heartbeat = None  # this process's, once started


class Monitor:
    """One rank's view of the others: when each was last heard, and whether one has been
    silent too long. The times are given (the thread's clock, or a test's)."""

    def __init__(self, rank: int, peers, timeout: float, now: float):
        self.rank, self.timeout = rank, timeout
        self.heard = dict.fromkeys(peers, now)  # the peers still watched (until their goodbye): when last heard
        self.hosts: dict[int, str] = {}          # each peer's host name, once it has sent it
        self.ticked = now
        self.resumed = -math.inf  # when this rank last found it had been stopped

    def tick(self, now: float, news=()) -> str | None:
        """One round: news is [(peer, said goodbye)], in the order received. Returns the line
        that ends the job if a peer has been silent too long and this rank is the one to say
        it: the lowest-ranked one still heard, or any once the silence has lasted twice the
        timeout (the one to say it is stuck as well)."""
        if now - self.ticked > self.timeout / 2:  # this process was stopped: the silence was its own
            self.heard = dict.fromkeys(self.heard, now)
            self.resumed = now
        self.ticked = now
        for peer, bye in news:
            if bye:
                self.heard.pop(peer, None)
            elif peer in self.heard:
                self.heard[peer] = now
        silent = [p for p, t in sorted(self.heard.items()) if now - t > self.timeout]
        if not silent:
            return None
        sayer = min(r for r in (self.rank, *self.heard) if r not in silent)
        if self.rank == sayer or now - self.heard[silent[0]] > 2 * self.timeout:
            host = self.hosts.get(silent[0], "a host not yet heard from")
            return (f"rank {silent[0]} on {host} has sent nothing for {self.timeout:g} s: stopped, wedged or cut "
                    f"off (--stall-timeout)")
        return None

    def stopped_lately(self, now: float) -> bool:
        """No tick for half the timeout (stopped, not yet ticked again), or resumed less than
        that ago."""
        return now - self.ticked > self.timeout / 2 or now - self.resumed < self.timeout / 2


class Heartbeat(threading.Thread):
    """This rank's heartbeats out and the others' in, on comm (the world's duplicate)."""

    def __init__(self, comm, timeout: float):
        super().__init__(name="nano-heartbeat", daemon=True)
        self.comm = comm
        self.peers = [r for r in range(comm.Get_size()) if r != comm.Get_rank()]
        self.monitor = Monitor(comm.Get_rank(), self.peers, timeout, time.monotonic())
        self.host = np.frombuffer(bytearray(socket.gethostname().encode()), np.uint8)
        self.sends = []                  # its name, heartbeats and goodbyes not yet known to be delivered
        self.leaving = False             # set at exit: say goodbye, then wait for the others'
        self.wake = threading.Event()    # cuts a wait short: the timeout changed, or leaving

    def run(self) -> None:
        said_bye = False
        self.sends += [self.comm.Isend(self.host, p, NAME) for p in self.peers]
        while not (said_bye and not self.monitor.heard):
            self.sends = [s for s in self.sends if not s.Test()]
            if not said_bye:
                said_bye = self.leaving
                self.sends += [self.comm.Isend(BYE if said_bye else BEAT, p) for p in self.peers]
            error = self.monitor.tick(time.monotonic(), self.news())
            if error:
                watchdog.end_stalled(error, list(watchdog.drivers))
            self.wake.wait(min(1.0, self.monitor.timeout / 4))
            self.wake.clear()
        from mpi4py import MPI
        MPI.Request.Waitall(self.sends)  # each peer received up to this rank's goodbye before it left

    def news(self) -> list[tuple[int, bool]]:
        from mpi4py import MPI
        news, status, message = [], MPI.Status(), np.empty(1, np.int8)
        while self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
            source = status.Get_source()
            if status.Get_tag() == NAME:
                name = np.empty(status.Get_count(MPI.BYTE), np.uint8)
                self.comm.Recv(name, source, NAME)
                self.monitor.hosts[source] = name.tobytes().decode(errors="replace")
                news.append((source, False))  # its name is news from it, as a beat is
            else:
                self.comm.Recv(message, source, 0)
                news.append((source, message[0] == BYE[0]))
        return news

    def leave(self) -> None:
        self.leaving = True
        self.wake.set()
        self.join()


def start(group, timeout: float = watchdog.DEFAULT_STALL_TIMEOUT) -> None:
    """Every rank of the run (group: the world, from parallel.tp_group) starts its heartbeat
    here, before any other collective; nothing when the run is one process."""
    global _heartbeat
    if group.world == 1:
        return
    from mpi4py import MPI
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise NanoError("the stall watch needs MPI_THREAD_MULTIPLE: leave mpi4py's thread level at its default")
    _heartbeat = Heartbeat(group.comm.Dup(), timeout)
    _heartbeat.start()
    atexit.register(_heartbeat.leave)  # before mpi4py's MPI_Finalize, which was registered first


def set_timeout(timeout: float) -> None:
    """--stall-timeout, once the flags are read (the same on every rank)."""
    if _heartbeat:
        _heartbeat.monitor.timeout = timeout
        _heartbeat.wake.set()


def just_resumed() -> bool:
    """Whether this rank was stopped until moments ago, or is still: a SIGTERM now is mpirun
    ending the job because another rank found this one silent, and said so."""
    return bool(_heartbeat) and _heartbeat.monitor.stopped_lately(time.monotonic())
