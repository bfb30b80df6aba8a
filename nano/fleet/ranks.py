"""Engines side by side on MPI ranks behind a router on rank 0: what disaggregated serving
(nano/disagg) and data-parallel replicas (nano/dp) share.

Every instance runs a whole LLMEngine; rank 0 also runs the Router, in the same loop
(Node.tick): deliver what has arrived, route, take one step. The router never waits on
another rank: links are non-blocking (links.py), so a slow instance delays only its own
requests. Under --tp T an instance is T ranks (world.split_replicas): its leader runs the
engine and talks to the router, the others replay its steps (worker.Worker).

Liveness is not the router's to judge: a step, however long, sends the router nothing, yet a
rank that computes is alive. Every rank's heartbeat thread (telemetry/heartbeat.py) tells a
stopped rank, the router's included, from a busy one.

Times are each process's time.perf_counter(): CLOCK_MONOTONIC, which on another host counts
from another boot. So no time read on one rank is compared with one read on another: a
request's times are moved onto each rank's clock as it arrives there (the time it spent in
flight counted as none), and the router stamps the snapshots with its own clock.
"""
from collections import deque
from dataclasses import dataclass, field

from nano.capacity import Capacity
from nano.policy import FCFS
from nano.sequence import Sequence, Status
from nano.telemetry.metrics import Metrics, metrics_of
from nano.telemetry.summary import summarize

ROUTER = 0


@dataclass
class InstanceStatus:
    """An instance's report after each step (and once when it goes idle)."""
    rank: int
    time: float
    queue_tokens: int       # at the start of its last step: prefill, prompt tokens not yet computed;
                            # decode, output tokens still to come; a replica, both
    used_blocks: int
    num_blocks: int
    received: int = 0       # requests received so far (the router counts those in flight)
    work_tokens: int = 0    # a replica: tokens still to compute, prompt tokens its prefix cache holds left out
    adopted: list[int] = field(default_factory=list)  # decode: sequences taken since the last report


@dataclass
class Report:
    """An instance's figures at the end of a run."""
    rank: int
    summary: dict                     # its engine's Metrics.summary
    steps: list                       # its engine's Metrics.step_log
    stalls: list                      # decode: (start, end) of each KV handoff received between steps
    used_blocks: int                  # device blocks still in use: 0 unless leaked
    used_swap_blocks: int


def wire_copy(seq: Sequence) -> Sequence:
    """seq's state without its block table (block ids mean nothing in another pool)."""
    copy = Sequence.__new__(Sequence)
    copy.__dict__.update(seq.__dict__, block_table=[], block_hashes=[],
                         token_ids=list(seq.token_ids), token_times=list(seq.token_times))
    return copy


class Instance:
    """One engine and its side of the protocol."""

    def __init__(self, engine, link):
        self.engine, self.link = engine, link
        self.rank = link.rank
        self.seqs: dict[int, Sequence] = {}   # in this engine's scheduler, by id
        self.stopping = self.stopped = False
        self.start = engine.clock.now()
        self.stalls: list[tuple[float, float]] = []  # decode: (start, end) of each payload received
        self.reported = None                          # (queue tokens, used blocks) last sent
        self.handoffs: dict[int, dict] = {}           # decode: seq_id -> its KV handoff's figures
        self.tell_router(("capacity", engine.capacity))

    def step(self) -> bool:
        """One engine step if there is work; returns whether it ran one (a prefill instance
        whose pool is full of parked blocks has work but cannot run it)."""
        if not self.engine.has_unfinished():
            return False
        steps = metrics_of(self.engine).steps
        finished = self.engine.step()
        for seq in finished:
            self.end(seq)
        return bool(finished) or metrics_of(self.engine).steps > steps

    def end(self, seq: Sequence) -> None:
        self.seqs.pop(seq.seq_id, None)
        self.tell_router(("result", wire_copy(seq), self.handoffs.pop(seq.seq_id, None)))

    def tell_router(self, message: tuple) -> None:
        self.link.send(ROUTER, message)

    def status(self, queue_tokens: int, busy: bool, **extra) -> None:
        """Report to the router after a step, or when idle and something changed since (so
        an instance that has gone quiet does not keep showing its last busy queue)."""
        num_blocks, free, _, _ = self.engine.kv_blocks()
        used = num_blocks - free
        if not busy and (queue_tokens, used) == self.reported:
            return
        self.reported = (queue_tokens, used)
        self.tell_router(("status", InstanceStatus(self.rank, self.engine.clock.now(), queue_tokens,
                                                   used, num_blocks, **extra)))

    def finish_stop(self) -> None:
        m, (num_blocks, free, num_swap_blocks, free_swap) = metrics_of(self.engine), self.engine.kv_blocks()
        report = Report(self.rank, summarize(m, self.engine.clock.now() - self.start), list(m.step_log),
                        self.stalls, num_blocks - free, num_swap_blocks - free_swap)
        self.tell_router(("final", report))
        self.engine.stop_workers()  # its TP ranks' Worker.run returns
        self.stopped = True


class Router:
    """Rank 0's side: requests held until they arrive (route() sends them on), results and
    status reports collected, every instance's final report.
    Subclasses decide where a request goes (route) and what a status report means."""

    def __init__(self, link, ranks: list[int], clock, on_result=None):
        self.link, self.clock, self.ranks = link, clock, ranks
        self.pending: deque[Sequence] = deque()       # not yet arrived, in arrival order
        self.expected = 0
        self.results: dict[int, Sequence] = {}
        self.status: dict[int, InstanceStatus] = {}
        self.capacity: dict[int, Capacity] = {}       # each instance's, from its first message
        # per request sent and not yet in a report: (its queue tokens, ...)
        self.in_flight: dict[int, deque[tuple]] = {r: deque() for r in ranks}
        self.reports: dict[int, Report] = {}
        self.on_result = on_result
        self.stopped = False
        self.accepting = False  # more requests may come (a server's router): not finished when idle

    def add(self, seqs: list[Sequence]) -> None:
        self.pending.extend(sorted(seqs, key=lambda s: s.arrival_time))
        self.expected += len(seqs)

    @property
    def finished(self) -> bool:
        return not self.accepting and len(self.results) == self.expected

    @property
    def done(self) -> bool:
        return len(self.reports) == len(self.ranks)

    def next_arrival(self) -> float | None:
        return self.pending[0].arrival_time if self.pending else None

    def arrived(self) -> list[Sequence]:
        """The pending requests whose arrival time has come, taken off the queue in order;
        none before every instance has told its capacity (where a request can go)."""
        now, out = self.clock.now(), []
        while len(self.capacity) == len(self.ranks) and self.pending and self.pending[0].arrival_time <= now:
            out.append(self.pending.popleft())
        return out

    def abort_pending(self, seq_id: int) -> bool:
        """End a request that has not left the router; False if it has."""
        pending = next((s for s in self.pending if s.seq_id == seq_id), None)
        if pending is None:
            return False
        self.pending.remove(pending)
        self.end(pending, "aborted")
        return True

    def end(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """A request ended here, never sent to an instance."""
        seq.status, seq.finish_reason, seq.error = Status.FINISHED, reason, error
        self.result(seq)

    def fitting(self, seq: Sequence, ranks: list[int]) -> tuple[list[int], str | None]:
        """The instances among ranks that could ever hold seq (the scheduler's own never-fit
        rule, capacity.Capacity); if none, why not, in the words of the largest pool's engine."""
        errors = {r: self.capacity[r].never_fits(seq) for r in ranks}
        fit = [r for r in ranks if errors[r] is None]
        largest = max(ranks, key=lambda r: self.capacity[r].usable_blocks)
        return fit, None if fit else errors[largest]

    def result(self, seq: Sequence) -> None:
        self.results[seq.seq_id] = seq
        if self.on_result:
            self.on_result(seq)

    def receive(self, source: int, message: tuple) -> bool:
        """Take a message meant for the router; False if it is for the instance on this rank."""
        kind = message[0]
        if kind == "result":
            self.on_result_message(source, message)
        elif kind == "status":
            self.on_status(message[1])
        elif kind == "final":
            self.reports[source] = message[1]
        elif kind == "capacity":
            self.capacity[source] = message[1]
        else:
            return False
        return True

    def on_result_message(self, source: int, message: tuple) -> None:
        self.result(message[1])

    def on_status(self, s: InstanceStatus) -> None:
        """Requests the instance has received are in its report: no longer in flight."""
        previous = self.status[s.rank].received if s.rank in self.status else 0
        for _ in range(s.received - previous):
            self.in_flight[s.rank].popleft()
        self.status[s.rank] = s

    def queued_tokens(self, rank: int) -> int:
        """The instance's queue in tokens: its last report plus what was sent to it since."""
        reported = self.status[rank].queue_tokens if rank in self.status else 0
        return reported + sum(queue for queue, *_ in self.in_flight[rank])

    def stop(self) -> None:
        for rank in self.ranks:
            self.link.send(rank, ("stop",))
        self.stopped = True


# ---- one rank's loop ------------------------------------------------------------------------
class Node:
    """What runs on one rank: its instance, and on rank 0 the router too."""

    def __init__(self, instance: Instance, router: Router | None = None):
        self.instance, self.router = instance, router

    @property
    def done(self) -> bool:
        return self.router.done if self.router else self.instance.stopped

    def tick(self) -> bool:
        """Deliver what has arrived, route, take one step; returns whether anything happened."""
        messages = self.instance.link.poll()
        for source, message in messages:
            if not (self.router and self.router.receive(source, message)):
                self.instance.receive(source, message)
        busy = bool(messages)
        if self.router:
            busy = self.router.route() or busy
            if self.router.finished and not self.router.stopped:
                self.router.stop()
        if not self.instance.stopped:
            busy = self.instance.work() or busy
        return busy

    def idle_time(self) -> float:
        """How long to wait for a message when nothing happened."""
        arrival = self.router.next_arrival() if self.router else None
        return 0.05 if arrival is None else min(0.05, arrival - self.instance.engine.clock.now())


def start(config, num_instances: int, wrong_size, make_instance, make_router, make_requests=None,
          warm_up: bool = False, engine_policy=FCFS, speculative=None):
    """This rank's engine, instance and (rank 0) router under mpirun -n num_instances x
    config.tp (wrong_size(ranks): the error when it is not). make_requests(engine) ->
    sequences runs on rank 0 with the others waiting (a failure on any rank, loading or
    reading requests, ends them all); make_instance(engine, link, instance) -> this rank's
    Instance; make_router(link, engine) -> rank 0's Router; engine_policy: every engine's
    scheduling policy (LLMEngine's policy); speculative: every engine's speculative
    decoding (nano/speculative's config, None: off). Returns (node, world group, rank 0's sequences)
    once every instance is ready; an instance's TP ranks other than its leader replay its
    steps until it stops, then return None."""
    from nano import parallel
    from nano.cli import offline
    from nano.engine import LLMEngine
    from nano.fleet import world as fleet
    from nano.fleet.links import MpiLink
    from nano.speculative import attach
    from nano.fleet.worker import Worker

    world = fleet.world()
    if world.world != num_instances * config.tp:  # every rank sees it: each raises the same error
        raise parallel.SharedError(wrong_size(world.world))
    leaders = fleet.split_replicas(config.tp)
    with world.together():
        if leaders is None:
            worker = Worker(config)
        else:
            engine = LLMEngine(config, policy=engine_policy)
            Metrics.attach(engine)
            attach(engine, speculative)
            seqs = make_requests(engine) if make_requests and leaders.rank == ROUTER else []
    if leaders is None:
        if warm_up:  # as the leader's warm-up does: page faults stay out of the figures
            worker.runner.touch_kv_cache()
        offline.forward_interrupts(world)
        worker.run()
        return None
    if warm_up:
        offline.warm_up(engine)
    link = MpiLink(leaders.comm)
    node = Node(make_instance(engine, link, leaders.rank))
    if leaders.rank == ROUTER:
        node.router = make_router(link, engine)
    leaders.comm.Barrier()  # every instance loaded and warmed up: the arrival trace starts now
    return node, world, seqs


def launch(config, num_instances: int, wrong_size, make_requests, make_instance, make_router,
           warm_up: bool = False, engine_policy=FCFS, speculative=None):
    """A whole run (start(), then every rank's loop to the end): make_requests(engine) ->
    sequences (engine.make_sequence, arrival times in seconds after the start). Rank 0
    returns (router, its engine, wall seconds) at the end; the other ranks return None."""
    started = start(config, num_instances, wrong_size, make_instance, make_router, make_requests, warm_up,
                    engine_policy, speculative)
    if started is None:
        return None
    node, world, seqs = started
    engine = node.instance.engine
    begin = engine.clock.now()
    if node.router:
        for seq in seqs:
            seq.arrival_time += begin
        node.router.add(seqs)
    run_node(node, world)
    return (node.router, engine, engine.clock.now() - begin) if node.router else None


def run_node(node: Node, world) -> None:
    """One instance's leader in an MPI run, to the end. A SIGINT on another rank is passed
    on to the router's, which ends the run (its finished outputs written in order)."""
    from nano.cli import offline
    if not node.router:
        offline.forward_interrupts(world)
    while not node.done:
        if node.router:
            offline.check_interrupted(world)
        busy = node.tick()
        if not busy:
            node.instance.link.wait(node.idle_time())
    node.instance.link.close()


def run_local(nodes: list[Node], on_tick=None) -> None:
    """Every instance in this process, in turn (tests): on_tick(nodes) after each round."""
    while not nodes[0].done:
        for node in nodes:
            if not node.done:
                node.tick()
        if on_tick:
            on_tick(nodes)
