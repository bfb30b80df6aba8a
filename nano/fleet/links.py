"""How a fleet's instances talk (ranks.py): small control messages, and KV payloads.

    send(dest, message)             a picklable tuple, delivered in order per (source, dest)
    send_payload(dest, tag, array)  a large uint8 array, matched by tag (in order, per tag); the
                                    sender does not wait, and leaves array alone while sending(array)
    ready(source, tag)              whether the next payload of that tag is here to receive
    recv_payload(source, tag, n)    blocks until that payload is here; valid until the next one
    poll()                          [(source, message), ...] that have arrived
    wait(seconds)                   idle until a message or payload arrives (or the time is up)

MpiLink runs over MPI point-to-point (one rank per instance, under mpirun); LocalLinks is
the same in one process, for tests and for watching a whole run in a debugger.
"""
import time
from collections import deque

import numpy as np

CONTROL = 1           # the tag of control messages; payloads use tags above it
IDLE_POLL = 2e-4      # seconds between polls when idle: short next to a decode step (~10 ms)


class MpiLink:
    def __init__(self, comm):
        from mpi4py import MPI
        self.MPI, self.comm = MPI, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.pending = []  # (request, buffer kept alive until the send completes)
        # One receive buffer, reused: fresh memory is slow to first touch (on this VM a 40 MB
        # copy into new pages took 75 ms instead of 4; docs/perf_notes.md).
        self.recv_buffer = np.empty(0, np.uint8)

    def send(self, dest: int, message: tuple) -> None:
        self.pending.append((self.comm.isend(message, dest, tag=CONTROL), None))
        self._reap()

    def send_payload(self, dest: int, tag: int, array: np.ndarray) -> None:
        # Non-blocking: a large message waits for the receiver to post its receive, which it
        # does only once it has room for the blocks (back-pressure); the payload stays here.
        self.pending.append((self.comm.Isend(array, dest, tag=tag), array))
        self._reap()

    def ready(self, source: int, tag: int) -> bool:
        # Its envelope is here: receiving it copies straight from the sender's memory (Open
        # MPI's single-copy transport), without waiting for the sender to make progress.
        return self.comm.iprobe(source=source, tag=tag)

    def recv_payload(self, source: int, tag: int, nbytes: int) -> np.ndarray:
        """The payload, in a buffer valid until the next call."""
        if self.recv_buffer.nbytes < nbytes:
            self.recv_buffer = np.zeros(nbytes, np.uint8)
        buf = self.recv_buffer[:nbytes]
        self.comm.Recv(buf, source=source, tag=tag)
        return buf

    def poll(self) -> list[tuple[int, tuple]]:
        messages, status = [], self.MPI.Status()
        while self.comm.iprobe(source=self.MPI.ANY_SOURCE, tag=CONTROL, status=status):
            source = status.Get_source()
            messages.append((source, self.comm.recv(source=source, tag=CONTROL)))
        self._reap()
        return messages

    def wait(self, seconds: float) -> None:
        """Sleep in short naps until a message (control or payload) is here: MPI's own
        blocking receive spins on a core, which the instance sharing this machine needs."""
        end = time.perf_counter() + max(seconds, 0.0)
        while not self.comm.iprobe(source=self.MPI.ANY_SOURCE, tag=self.MPI.ANY_TAG) and time.perf_counter() < end:
            time.sleep(IDLE_POLL)

    def sending(self, array: np.ndarray) -> bool:
        """Whether a send from array's memory is still under way."""
        owner = array.base if array.base is not None else array
        return any(b is not None and (b.base is owner or b is owner) for _, b in self.pending)

    def _reap(self) -> None:
        self.pending = [(r, b) for r, b in self.pending if not r.Test()]

    def close(self) -> None:
        """Wait until every message this rank sent has been delivered."""
        self.MPI.Request.Waitall([r for r, _ in self.pending])
        self.pending = []


class LocalLinks:
    """n endpoints in one process: link(r) is rank r's."""

    def __init__(self, n: int):
        self.inbox = [deque() for _ in range(n)]   # control messages: (source, message)
        self.payloads = {}                         # (source, dest, tag) -> deque of arrays

    def link(self, rank: int) -> "LocalLink":
        return LocalLink(self, rank)


class LocalLink:
    def __init__(self, links: LocalLinks, rank: int):
        self.links, self.rank, self.size = links, rank, len(links.inbox)

    def send(self, dest: int, message: tuple) -> None:
        self.links.inbox[dest].append((self.rank, message))

    def send_payload(self, dest: int, tag: int, array: np.ndarray) -> None:
        self.links.payloads.setdefault((self.rank, dest, tag), deque()).append(array.copy())

    def ready(self, source: int, tag: int) -> bool:
        return (source, self.rank, tag) in self.links.payloads

    def recv_payload(self, source: int, tag: int, nbytes: int) -> np.ndarray:
        key = (source, self.rank, tag)
        array = self.links.payloads[key].popleft()
        if not self.links.payloads[key]:
            del self.links.payloads[key]
        assert array.nbytes == nbytes, (array.nbytes, nbytes)
        return array.reshape(-1)

    def sending(self, array: np.ndarray) -> bool:
        return False  # sent payloads are copies

    def poll(self) -> list[tuple[int, tuple]]:
        inbox = self.links.inbox[self.rank]
        messages = list(inbox)
        inbox.clear()
        return messages

    def wait(self, seconds: float) -> None:
        """One process runs every instance in turn: never wait for another."""

    def close(self) -> None:
        pass
