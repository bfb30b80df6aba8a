"""Data-parallel replicas behind a router: every replica a whole engine, rank 0 also routes.

    mpirun -n 2 python run.py --dp 2 --prompt-file prompts.txt
    mpirun -n 4 python run.py --dp 2 --tp 2 --prompt-file prompts.txt   (replicas of 2 TP ranks)

A request's life:

    router   --request-->  replica r   chosen by the policy (policy.py) when it arrives
    r: prefill (its own prefix cache) and decode, as one engine does
    r        --cache-->    router      after each step: the block hashes stored and evicted
    r        --status-->   router      after each step: queued tokens, blocks in use
    r        --result-->   router      the finished sequence

Under --tp T, world rank w is TP rank w % T of replica w // T (fleet.world.split_replicas): the
router talks to each replica's leader (its TP rank 0) only, and the leader's TP ranks
replay its steps as under --tp alone.

Rank 0 is router and replica 0 in one loop (ranks.Node.tick): the router's own replica
delays routing by at most one of its steps, and it never waits on another rank (every
send is non-blocking), so a slow replica slows only its own requests. The launch is the one
disaggregated serving uses too (nano/fleet/ranks.py); a stopped rank is told
from a busy one by every rank's heartbeat (nano/telemetry/heartbeat.py).

Clocks: a request's arrival time is rebased onto the replica's clock on receipt (the time it
waited at the router kept), so TTFT and TPOT are measured on one clock even when replicas
run on several hosts.
"""
from collections import Counter

from nano.fleet.ranks import Instance, InstanceStatus, Router as RouterBase, launch as launch_ranks
from nano.dp.policy import CacheIndex, Policy, prompt_hashes
from nano.errors import NanoError
from nano.policy import FCFS
from nano.sequence import Status
from nano.telemetry.export import queue_state


def check_replicas(dp: int) -> None:
    if dp < 1:
        raise NanoError(f"--dp must be at least 1, got {dp}")


class Replica(Instance):
    """One engine serving whole requests; it reports its prefix cache's changes."""

    def __init__(self, engine, link, stream: bool = False):
        super().__init__(engine, link)
        engine.take_cache_events()  # from now on, every change to its prefix cache is recorded
        self.received = 0
        self.streamed: dict[int, int] | None = {} if stream else None  # seq_id -> output tokens sent

    def receive(self, source: int, message: tuple) -> None:
        kind = message[0]
        if kind == "request":
            _, seq, sent_at = message
            seq.arrival_time = self.engine.clock.now() - (sent_at - seq.arrival_time)
            self.seqs[seq.seq_id] = seq
            self.engine.queue(seq)
            self.received += 1
        elif kind == "abort" and message[1] in self.seqs:
            seq = self.seqs[message[1]]
            self.engine.abort(seq)
            self.end(seq)
        elif kind == "finish" and message[1] in self.seqs:  # the server found a stop string
            seq = self.seqs[message[1]]
            self.engine.finish(seq, message[2])
            self.end(seq)
        elif kind == "stop":
            self.stopping = True

    def work(self) -> bool:
        queue = self.queue_tokens()
        busy = self.step()
        if self.streamed is not None:
            self.stream()
        events = self.engine.take_cache_events()
        if events:
            self.tell_router(("cache", events))
        self.status(queue if busy else self.queue_tokens(), busy, received=self.received,
                    work_tokens=self.work_tokens())
        if self.stopping and not self.engine.has_unfinished():
            self.finish_stop()
        return busy

    def queue_tokens(self) -> int:
        return queue_state(self.engine, self.engine.clock.now()).queue_tokens

    def work_tokens(self) -> int:
        """Tokens still to compute here: waiting prompts less the blocks this replica's prefix
        cache holds of them, the rest of admitted ones, every output token to come. kv-aware's
        load term: a queue of one tenant's requests whose prefix is cached is short."""
        seqs = self.engine.unfinished()  # none held: a replica hands nothing over
        waiting = [q for q in seqs if q.status is Status.WAITING]
        admitted = [q for q in seqs if q.status is not Status.WAITING]
        prompts = (sum(q.num_tokens - self.engine.cached_tokens(q.token_ids) for q in waiting)
                   + sum(q.num_uncomputed_tokens for q in admitted))
        return prompts + sum(q.params.max_tokens - q.num_output_tokens for q in seqs)

    def stream(self) -> None:
        """Each unfinished request's new tokens (and their logits rows, if it asked for them)
        to the router, after a step: a server streams them to its client. A finished one's
        last tokens go with its result."""
        news = []
        for seq in self.seqs.values():
            sent = self.streamed.get(seq.seq_id, 0)
            if seq.num_output_tokens > sent:
                news.append((seq.seq_id, seq.output_token_ids[sent:], seq.logits))
                seq.logits = []
                self.streamed[seq.seq_id] = seq.num_output_tokens
        if news:
            self.tell_router(("tokens", news))

    def end(self, seq) -> None:
        if self.streamed is not None:
            self.streamed.pop(seq.seq_id, None)
        super().end(seq)


class Router(RouterBase):
    """Rank 0: each request, once it has arrived, to the replica the policy picks."""

    def __init__(self, link, num_replicas: int, policy: str, block_size: int, clock, on_result=None,
                 on_snapshot=None):
        # on_result(seq, replica): the replica that served it (None: ended before routing)
        super().__init__(link, list(range(num_replicas)), clock,
                         on_result and (lambda seq: on_result(seq, self.replica_of.get(seq.seq_id))))
        self.block_size = block_size
        self.index = CacheIndex(self.ranks)
        self.policy = Policy(policy, self.ranks, block_size, self.queued_tokens, self.occupancy, self.work_tokens,
                             self.index)
        self.where: dict[int, int] = {}           # seq_id -> replica, until its result
        self.replica_of: dict[int, int] = {}      # seq_id -> replica, kept (the --output file)
        self.expected_hits = Counter()            # prompt blocks the index showed cached, per replica
        self.samples: dict[int, list] = {r: [] for r in self.ranks}  # (queue tokens, KV occupancy) per report
        self.on_snapshot = on_snapshot
        self.on_tokens = None                     # a server's: [(seq_id, new tokens, logits rows)] per message

    def route(self) -> bool:
        arrived = self.arrived()
        for seq in arrived:
            hashes = prompt_hashes(seq.token_ids, self.block_size)
            r = self.policy.choose(seq, hashes)
            cached = self.index.overlap(r, hashes)
            self.expected_hits[r] += cached
            self.index.apply(r, [(True, h) for h in hashes])  # about to be computed there
            self.in_flight[r].append((seq.num_prompt_tokens + seq.params.max_tokens,
                                      seq.num_prompt_tokens - self.block_size * cached + seq.params.max_tokens))
            self.where[seq.seq_id] = self.replica_of[seq.seq_id] = r
            self.link.send(r, ("request", seq, self.clock.now()))
        return bool(arrived)

    def work_tokens(self, r: int) -> int:
        """Tokens replica r has still to compute: its last report plus, for each request sent
        since, the prompt tokens the index does not show cached and its output tokens."""
        reported = self.status[r].work_tokens if r in self.status else 0
        return reported + sum(work for _, work in self.in_flight[r])

    def occupancy(self, r: int) -> float:
        s = self.status.get(r)
        return s.used_blocks / s.num_blocks if s else 0.0

    def abort(self, seq_id: int, reason: str = "aborted") -> None:
        """End a request wherever it is; reason "stop": a stop string, found by the server."""
        if not self.abort_pending(seq_id) and seq_id in self.where:
            self.link.send(self.where[seq_id], ("abort", seq_id) if reason == "aborted" else ("finish", seq_id, reason))

    def receive(self, source: int, message: tuple) -> bool:
        if message[0] == "cache":
            self.index.apply(source, message[1])
        elif message[0] == "tokens" and self.on_tokens:
            self.on_tokens(message[1])
        return super().receive(source, message) or message[0] in ("cache", "tokens")

    def on_result_message(self, source: int, message: tuple) -> None:
        self.where.pop(message[1].seq_id, None)
        self.result(message[1])

    def on_status(self, s: InstanceStatus) -> None:
        super().on_status(s)
        self.samples[s.rank].append((s.queue_tokens, s.used_blocks / s.num_blocks))
        if self.on_snapshot:
            self.on_snapshot({"time": self.clock.now(), "arrived": self.expected - len(self.pending),
                              "finished": len(self.results), "replicas": self.replicas()})

    def replicas(self) -> dict:
        """Each replica's signals, from its latest report."""
        return {r: {"queue_depth_tokens": s.queue_tokens, "kv_occupancy": s.used_blocks / s.num_blocks,
                    "routed": self.policy.routed[r]} for r, s in sorted(self.status.items())}


def wrong_size(num_replicas: int, tp: int):
    return lambda got: (f"{flags(num_replicas, tp)} needs {num_replicas * tp} MPI ranks, got {got}: "
                        + how_to_run(num_replicas, tp))


def flags(num_replicas: int, tp: int) -> str:
    """The flags that ask for this many replicas of this many ranks, as the user types them."""
    return f"--dp {num_replicas}" + (f" --tp {tp}" if tp > 1 else "")


def how_to_run(num_replicas: int, tp: int) -> str:
    return f"run mpirun -n {num_replicas * tp} python run.py {flags(num_replicas, tp)} ..."


def banner(num_replicas: int, tp: int, policy: str) -> str:
    """The run's first line, before each replica's engine is described."""
    ranks = f" of {tp} TP ranks each" if tp > 1 else ", one rank each"
    return f"data parallel: {num_replicas} replicas{ranks}, policy {policy}"


def launch(config, num_replicas: int, policy: str, make_requests, warm_up: bool = False, on_result=None,
           make_metrics=None, engine_policy=FCFS, speculative=None):
    """This rank's part of a run under mpirun -n DP x TP (ranks.launch): rank 0 returns
    (router, its engine, wall seconds), the others None. make_metrics(engine): rank 0's
    MetricsWriter for the replicas' snapshots (metrics.ReplicaExport), or None."""

    def make_router(link, engine):
        metrics = make_metrics(engine) if make_metrics else None
        return Router(link, num_replicas, policy, config.block_size, engine.clock, on_result,
                      metrics and metrics.tick)

    return launch_ranks(config, num_replicas, wrong_size(num_replicas, config.tp), make_requests,
                        lambda engine, link, rank: Replica(engine, link), make_router, warm_up, engine_policy,
                        speculative)
