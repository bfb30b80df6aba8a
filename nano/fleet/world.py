"""Every rank of the run, and its split into replicas: under mpirun -n N x T, N engines of T
ranks each (data parallel; T = 1: also disaggregated instances). The core knows only its own
TP group (parallel.tp_group); this module keeps the world it was split from, which an error
on any rank must end whole."""
from nano import parallel

_world: parallel.Group | None = None  # after split_replicas(): every rank, of every replica


def split_replicas(tp: int) -> parallel.Group | None:
    """Replicas of `tp` ranks, each an engine of its own: world rank w is TP rank w % tp of
    replica w // tp, this process's TP group from now on. Returns the group of replica leaders
    (TP rank 0 of each) the engines talk over, else None."""
    global _world
    _world = world()  # split again for a second run in the same processes (nano/dp's --dp-compare)
    from mpi4py import MPI
    group = parallel.Group(_world.comm.Split(_world.rank // tp))  # ranked as in the world: TP rank w % tp
    parallel.use_tp_group(group)
    leaders = _world.comm.Split(0 if group.rank == 0 else MPI.UNDEFINED)  # ranked by replica
    return parallel.Group(leaders) if group.rank == 0 else None


def world() -> parallel.Group:
    """Every rank of the run (an error anywhere ends them): the TP group unless split."""
    return _world or parallel.tp_group()


def started() -> parallel.Group | None:
    """Every rank of the run, if this process has made its groups yet (None: MPI untouched);
    for ending the run (telemetry/watchdog.py, cli/output.py)."""
    return _world or parallel.started()
