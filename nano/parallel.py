"""The tensor-parallel ranks and what they say to each other, over MPI (mpi4py), imported only
under mpirun (a plain `python run.py` never initialises it): docs/tensor-parallel.md.
"""
import os
import time
from contextlib import contextmanager

import numpy as np

from nano.device import from_float32, to_float32
from nano.errors import NanoError

STOP = -1  # a step message's length that means "no more steps"
# Set by the launcher in every process it starts (Open MPI, PMIx, MPICH/Hydra).
_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE")


class SharedError(NanoError):
    """A failure that every rank raises at once (agreed in `together`): rank 0 prints it
    and all ranks exit normally, with no rank left waiting."""


class Group:
    """The TP ranks. One rank without MPI when not launched by mpirun."""

    def __init__(self, comm=None):
        self.comm = comm
        self.rank = comm.Get_rank() if comm else 0
        self.world = comm.Get_size() if comm else 1  # the number of ranks
        self.all_reduce_seconds = 0.0    # since the last take_all_reduce_stats()
        self.all_reduce_bytes = 0

    def require(self, tp: int) -> None:
        if tp != self.world and self.world == 1:
            raise NanoError(f"--tp {tp} needs {tp} MPI ranks: run mpirun -n {tp} python run.py "
                            f"--tp {tp} ...")
        if tp != self.world:
            raise NanoError(f"--tp {tp} but mpirun started {self.world} ranks: "
                            f"give --tp {self.world} or mpirun -n {tp}")

    # ---- collectives -------------------------------------------------------------------
    def all_reduce(self, x):
        """Sum x (NumPy or CuPy, contiguous) over all ranks, in place; returns x.
        The time includes waiting for the slowest rank to reach it."""
        if self.world == 1:
            return x
        from mpi4py import MPI
        start = time.perf_counter()
        if isinstance(x, np.ndarray):
            self.comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
            self.all_reduce_bytes += x.nbytes
        else:  # CuPy: through host memory (requirements.txt's Open MPI is built without CUDA),
            # as float32 (MPI has no float16 or bfloat16 sum)
            buf = to_float32(x.get())
            self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            x.set(from_float32(buf, x.dtype))
            self.all_reduce_bytes += buf.nbytes
        self.all_reduce_seconds += time.perf_counter() - start
        return x

    def take_all_reduce_stats(self) -> tuple[float, int]:
        """All-reduce seconds and bytes since the last call (one step's worth)."""
        stats = self.all_reduce_seconds, self.all_reduce_bytes
        self.all_reduce_seconds, self.all_reduce_bytes = 0.0, 0
        return stats

    def min(self, value: int) -> int:
        if self.world == 1:
            return value
        from mpi4py import MPI
        return self.comm.allreduce(value, op=MPI.MIN)

    def broadcast(self, message: np.ndarray | None) -> np.ndarray | None:
        """Rank 0 sends an int32 array (None = STOP; the other ranks pass None) and every
        rank returns it (None on STOP).
        Two messages: its length, then the array itself (buffer sends, no pickling)."""
        if self.world == 1:
            return message
        size = np.array([STOP if message is None else message.size], dtype=np.int64)
        self.comm.Bcast(size, root=0)
        if size[0] == STOP:
            return None
        if self.rank != 0:
            message = np.empty(int(size[0]), dtype=np.int32)
        self.comm.Bcast(message, root=0)
        return message

    @contextmanager
    def together(self):
        """Run a block on every rank; if it raises a NanoError on any rank, raise a
        SharedError on all of them. Start-up code runs inside this, so that a rank that
        fails before the first collective cannot leave the others waiting in it."""
        if self.world == 1:
            yield
            return
        error = None
        try:
            yield
        except NanoError as e:
            error = str(e)
        for r, e in enumerate(self.comm.allgather(error)):  # the lowest failed rank's error
            if e is not None:
                raise SharedError(f"rank {r}: {e}" if r else e)


_group: Group | None = None


def launched_by_mpirun() -> bool:
    return any(var in os.environ for var in _LAUNCHER_VARS)


def tp_group() -> Group:
    """The ranks this process belongs to: MPI's world under mpirun, else one rank, no MPI."""
    global _group
    if _group is None:
        comm = None
        if launched_by_mpirun():
            try:
                from mpi4py import MPI
            except Exception as e:  # ImportError, or the MPI library failing to load
                raise NanoError(f"launched by mpirun but mpi4py cannot load: {e}") from None
            comm = MPI.COMM_WORLD
        _group = Group(comm)
    return _group


def use_tp_group(group: Group) -> None:
    """Make group this process's TP group from now on: nano/fleet splits the run's ranks into
    replicas, each an engine of its own, before any engine is made."""
    global _group
    _group = group


def started() -> Group | None:
    """This process's TP group, if it has made it yet (None: MPI untouched)."""
    return _group
