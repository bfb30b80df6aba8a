"""Disaggregated prefill and decode: separate engines for the two phases, KV handed over.

    mpirun -n 2 python run.py --disagg 1:1 --prompt-file prompts.txt

A prefill step is long and compute-bound, a decode step short and memory-bound: in one
engine every prefill chunk stretches the time per output token of every running decode.
Here ranks 0..P-1 are prefill instances and ranks P..P+D-1 decode instances, each a whole
LLMEngine (tp=1) with its own KV pool; rank 0 also routes. A request's life:

    router   --request-->  prefill p   chunked prefill (+ prefix cache); samples the first
                                       token; the sequence is parked, its blocks held
    p        --offer-->    decode d    state + one checksum per block, then the payload
                                       (the filled blocks, kv_transfer.py) in ~2 MB pieces,
                                       sent without waiting
    d: adopts the offer once its watermark allows (back-pressure: until then the payload
       stays on p, whose held blocks stop it admitting new prompts when its pool is full),
       receives its pieces between its own steps (a tenth of a step's time at a time, so
       its running decodes barely notice), checks every block, writes them into its blocks
    d        --ack-->      p           p frees the blocks (full ones stay prefix-cached)
    d decodes to the end   --result--> router

Routing, at arrival: to the prefill instance with the least queued prompt tokens, and to
the decode instance with the most free blocks (its last report, less the blocks of
requests already routed to it and not yet taken), each among those that could ever hold
the request. Every instance tells the router its capacity (capacity.Capacity: context,
pool, watermark) once at the start, and the router routes nothing before it has them all:
a request no prefill or no decode instance could hold is rejected there, as one engine of
that pool size rejects it, before any prefill is spent on it. Every instance reports its queue depth
in tokens and KV occupancy after each step, and once more when it goes idle ("status"): the router routes on them, and
they are each pool's autoscaling signals (--metrics-file, the run's summary).

Aborts: the router tells both instances. p aborts the request if it still holds it
unparked; if parked it forwards the abort to d behind its offer, so d sees them in order.
d aborts it if it holds it (an offer, or one arriving: the rest of its payload is
received and dropped, then acknowledged, so p frees the blocks); an abort for a sequence d
never got is ignored,
since p dealt with it. Exactly one instance reports each request's end.

The loop every rank runs and the launch: nano/fleet/ranks.py; liveness (--stall-timeout): every rank's
heartbeat (telemetry/heartbeat.py).
"""
from collections import deque
from dataclasses import dataclass

import numpy as np

from nano.disagg import kv_transfer
from nano.fleet.ranks import Instance, InstanceStatus, Router as RouterBase, launch as launch_ranks
from nano.errors import NanoError
from nano.policy import FCFS
from nano.sequence import Sequence, Status
from nano.telemetry.metrics import metrics_of

STALL_FRACTION = 0.1  # of a decode step's time, given to receiving handoffs between two steps
TAG_SPAN = 1 << 14   # payload tags cycle through this many (MPI guarantees 32767 tags)


def parse_split(text: str) -> tuple[int, int]:
    """'P:D' -> (P, D), each at least 1."""
    try:
        p, d = (int(x) for x in str(text).split(":"))
    except ValueError:
        raise NanoError(f"--disagg must be P:D (prefill and decode instances), got {text!r}") from None
    if p < 1 or d < 1:
        raise NanoError(f"--disagg {text}: needs at least one prefill and one decode instance")
    return p, d


def payload_tag(seq_id: int) -> int:
    return 2 + seq_id % TAG_SPAN


def on_clock(offer: kv_transfer.Offer, now: float) -> kv_transfer.Offer:
    """The offer with its times (its sequence's and its own) moved onto the clock that reads
    now on its arrival: the prefill instance's clock may be another host's, whose monotonic
    clock counts from another boot. Its time in flight is counted as none."""
    shift = now - offer.offered_at
    seq = offer.seq
    seq.arrival_time += shift
    seq.scheduled_time = None if seq.scheduled_time is None else seq.scheduled_time + shift
    seq.first_token_time = None if seq.first_token_time is None else seq.first_token_time + shift
    seq.token_times = [t + shift for t in seq.token_times]
    offer.offered_at = now
    return offer


class PrefillInstance(Instance):
    def __init__(self, engine, link):
        super().__init__(engine, link)
        self.offered: dict[int, tuple[Sequence, int, np.ndarray]] = {}  # seq_id -> (sequence, decode rank, payload)
        self.buffers = kv_transfer.PayloadBuffers()
        self.returning: list[np.ndarray] = []               # payloads acknowledged, sends maybe not yet reaped
        self.decode_rank: dict[int, int] = {}              # of each sequence in self.seqs
        self.received = 0

    def receive(self, source: int, message: tuple) -> None:
        kind = message[0]
        if kind == "request":
            _, seq, decode, sent_at = message
            seq.arrival_time = self.engine.clock.now() - (sent_at - seq.arrival_time)  # onto this host's clock
            self.seqs[seq.seq_id], self.decode_rank[seq.seq_id] = seq, decode
            self.engine.queue(seq)
            self.received += 1
        elif kind == "ack":
            seq, _, payload = self.offered.pop(message[1])
            self.engine.finish(seq, "handed_off")  # frees its blocks
            self.returning.append(payload)
        elif kind == "abort":
            self.abort(message[1])
        elif kind == "stop":
            self.stopping = True

    def abort(self, seq_id: int) -> None:
        if seq_id in self.offered:  # offered: behind the offer, so the decode side has it first
            self.link.send(self.offered[seq_id][1], ("abort", seq_id))
        elif seq_id in self.seqs:
            seq = self.seqs[seq_id]
            self.engine.abort(seq)
            self.decode_rank.pop(seq_id)
            self.end(seq)

    def work(self) -> bool:
        done = [not self.link.sending(p) for p in self.returning]
        for payload in (p for p, d in zip(self.returning, done) if d):
            self.buffers.give(payload.base if payload.base is not None else payload)
        self.returning = [p for p, d in zip(self.returning, done) if not d]
        queue = self.queue_tokens()
        busy = self.step()
        for seq in [s for s in self.engine.unfinished() if s.status is Status.RUNNING and s.num_output_tokens]:
            self.offer(seq)
        self.status(queue if busy else self.queue_tokens(), busy, received=self.received)
        if self.stopping and not self.offered:  # every handoff acknowledged: nothing held
            self.finish_stop()
        return busy

    def end(self, seq: Sequence) -> None:
        self.decode_rank.pop(seq.seq_id, None)
        super().end(seq)

    def offer(self, seq: Sequence) -> None:
        decode = self.decode_rank.pop(seq.seq_id)
        del self.seqs[seq.seq_id]
        tag = payload_tag(seq.seq_id)
        offer, payload = kv_transfer.pack(self.engine, seq, self.rank, tag, self.engine.clock.now,
                                          self.buffers)
        self.link.send(decode, ("offer", offer))
        for first, n in kv_transfer.pieces(offer):
            self.link.send_payload(decode, tag, payload[first:first + n])
        self.offered[seq.seq_id] = (seq, decode, payload)

    def queue_tokens(self) -> int:
        return sum(q.num_uncomputed_tokens for q in self.engine.unfinished() if q.status in (Status.WAITING, Status.RUNNING))


@dataclass(eq=False)
class Arrival:
    """A handoff being received, piece by piece (kv_transfer.pieces)."""
    offer: kv_transfer.Offer
    pieces: deque                      # (first block, number of blocks) still to come
    adopted: bool = True               # blocks here to write into; else the pieces are discarded
    seconds: float = 0.0               # spent receiving so far
    ending: tuple | None = None        # (reason, error): receive the rest unchecked, then end it


class DecodeInstance(Instance):
    def __init__(self, engine, link):
        super().__init__(engine, link)
        self.offers: deque[kv_transfer.Offer] = deque()  # in arrival order: admitted in that order
        self.arriving: Arrival | None = None             # the adopted offer being received
        self.draining: list[Arrival] = []                # offers ended before adoption
        self.adopted: list[int] = []                     # since the last status report
        self.piece_seconds = 0.0                         # the last piece's receive time

    def receive(self, source: int, message: tuple) -> None:
        kind = message[0]
        if kind == "offer":
            self.offers.append(on_clock(message[1], self.engine.clock.now()))
        elif kind == "abort":
            self.abort(message[1])
        elif kind == "stop":
            self.stopping = True

    def abort(self, seq_id: int) -> None:
        offer = next((o for o in self.offers if o.seq.seq_id == seq_id), None)
        if offer is not None:
            self.offers.remove(offer)
            self.drop(offer, "aborted")
        elif self.arriving and self.arriving.offer.seq.seq_id == seq_id:
            self.arriving.ending = ("aborted", None)
        elif seq_id in self.seqs:
            seq = self.seqs[seq_id]
            self.engine.abort(seq)
            self.end(seq)

    def drop(self, offer: kv_transfer.Offer, reason: str, error: str | None = None) -> None:
        """End an offered sequence that never got blocks here, once its pieces are received
        and discarded (so the prefill side's sends complete) and acknowledged."""
        self.draining.append(Arrival(offer, deque(kv_transfer.pieces(offer)), False, ending=(reason, error)))

    # ---- taking handoffs ----------------------------------------------------------------
    def take_offers(self) -> bool:
        """Adopt offers in order while the watermark allows, and receive their pieces. While
        sequences are decoding, only about STALL_FRACTION of a step's time goes to pieces
        between two steps (at least one piece): a payload received whole would stretch every
        running decode's step by its full copy. A piece the prefill side has not posted yet
        (it is inside a step) waits for the next round instead of stalling this one.
        Returns whether anything was taken."""
        took = False
        for a in list(self.draining):
            while a.pieces and self.ready(a):
                self.receive_piece(a)
                took = True
        budget = STALL_FRACTION * metrics_of(self.engine).last_step_time if self.decoding() else np.inf
        spent, pieces = 0.0, 0
        while not pieces or spent + self.piece_seconds <= budget:
            if self.arriving is None and not self.adopt_next():
                break
            if not self.ready(self.arriving):
                break
            spent += self.receive_piece(self.arriving)
            pieces, took = pieces + 1, True
        return took

    def decoding(self) -> bool:
        return any(s.status is Status.RUNNING for s in self.engine.unfinished())

    def ready(self, a: Arrival) -> bool:
        return self.link.ready(a.offer.source, a.offer.tag)

    def adopt_next(self) -> bool:
        """Give the first offer blocks, if the watermark allows; False if there is none to take."""
        while self.offers:
            offer = self.offers[0]
            adopted = self.engine.adopt(offer.seq)
            if adopted is False:
                return False  # back-pressure: the payload waits on the prefill side
            self.offers.popleft()
            if adopted is True:
                self.arriving = Arrival(offer, deque(kv_transfer.pieces(offer)))
                return True
            self.drop(offer, "rejected", adopted)
        return False

    def receive_piece(self, a: Arrival) -> float:
        """Receive a's next piece and, if it is to be kept, check it and write it into its
        blocks (the last one written, the sequence decodes from the next step); returns the
        seconds it took."""
        clock, offer = self.engine.clock, a.offer
        first, n = a.pieces.popleft()
        start = clock.now()
        rows = self.link.recv_payload(offer.source, offer.tag, n * (offer.nbytes // offer.num_blocks))
        if a.adopted and a.ending is None:
            rows = rows.reshape(n, -1)
            try:
                kv_transfer.verify(offer, rows, first)
                self.engine.write_kv(offer.seq, first, rows)
            except kv_transfer.ChecksumError as e:
                a.ending = ("rejected", str(e))  # the rest is received unchecked
        end = clock.now()
        if self.decoding():  # decodes waited for it (else nothing did)
            self.stalls.append((start, end))
        a.seconds += end - start
        self.piece_seconds = end - start
        if not a.pieces:
            self.arrived(a, end)
        return end - start

    def arrived(self, a: Arrival, now: float) -> None:
        """The last piece is in: acknowledge (the prefill side frees its blocks), then decode
        the sequence here (write_kv put it in the batch), or end it (a failed checksum, an
        abort, a rejection)."""
        offer, seq = a.offer, a.offer.seq
        self.link.send(offer.source, ("ack", seq.seq_id))
        if not a.adopted:
            self.draining.remove(a)
            seq.status, seq.finish_reason, seq.error = Status.FINISHED, *a.ending
            self.end(seq)
            return
        self.arriving = None
        if a.ending:
            reason, seq.error = a.ending
            if reason == "aborted":
                self.engine.abort(seq)
            else:
                self.engine.finish(seq, reason)
            self.end(seq)
            return
        self.handoffs[seq.seq_id] = {"bytes": offer.nbytes, "pack_s": offer.pack_seconds,
                                     "receive_s": a.seconds, "handoff_s": now - offer.offered_at}
        self.seqs[seq.seq_id] = seq
        self.adopted.append(seq.seq_id)

    def work(self) -> bool:
        busy = self.take_offers()
        queue = self.queue_tokens()
        busy = self.step() or busy
        self.status(queue if busy else self.queue_tokens(), busy, adopted=self.adopted)
        self.adopted = []
        if self.stopping and not (self.offers or self.arriving or self.draining):
            self.finish_stop()
        return busy

    def queue_tokens(self) -> int:
        waiting = [o.seq for o in self.offers] + self.engine.unfinished()
        return sum(q.params.max_tokens - q.num_output_tokens for q in waiting)


# ---- the router ---------------------------------------------------------------------------
class Router(RouterBase):
    """Rank 0: sends each request, once it has arrived, to a prefill instance and names its
    decode instance; collects results, status reports and, at the end, every instance's report."""

    def __init__(self, link, num_prefill: int, num_decode: int, block_size: int, clock,
                 on_result=None, on_snapshot=None):
        self.prefill = list(range(num_prefill))
        self.decode = list(range(num_prefill, num_prefill + num_decode))
        super().__init__(link, self.prefill + self.decode, clock, on_result)
        self.block_size = block_size
        self.handoffs: dict[int, dict] = {}           # seq_id -> its KV handoff's figures (decode side)
        self.where: dict[int, tuple[int, int]] = {}   # seq_id -> (prefill rank, decode rank), until its result
        self.promised: dict[int, dict[int, int]] = {d: {} for d in self.decode}  # seq_id -> blocks, not yet taken
        self.pool_samples = {"prefill": [], "decode": []}  # (queue tokens, KV occupancy) per report
        self.on_snapshot = on_snapshot

    # ---- routing ----------------------------------------------------------------------
    def route(self) -> bool:
        arrived = self.arrived()
        for seq in arrived:
            prefill, error = self.fitting(seq, self.prefill)
            decode, decode_error = self.fitting(seq, self.decode)
            if error or decode_error:
                self.end(seq, "rejected", error or decode_error)
                continue
            p = min(prefill, key=self.queued_tokens)
            d = max(decode, key=self.free_blocks)
            self.in_flight[p].append((seq.num_prompt_tokens,))  # a prefill instance's queue: prompt tokens
            self.promised[d][seq.seq_id] = -(-(seq.num_prompt_tokens + 1) // self.block_size)
            self.where[seq.seq_id] = (p, d)
            self.link.send(p, ("request", seq, d, self.clock.now()))
        return bool(arrived)

    def free_blocks(self, d: int) -> int:
        used = self.status[d].used_blocks if d in self.status else 0
        return self.capacity[d].num_blocks - used - sum(self.promised[d].values())

    def abort(self, seq_id: int) -> None:
        """Abort a request wherever it is (a pending one never leaves the router)."""
        if not self.abort_pending(seq_id) and seq_id in self.where:
            for rank in self.where[seq_id]:
                self.link.send(rank, ("abort", seq_id))

    # ---- messages ---------------------------------------------------------------------
    def on_result_message(self, source: int, message: tuple) -> None:
        _, seq, handoff = message
        if handoff:
            self.handoffs[seq.seq_id] = handoff
        _, d = self.where.pop(seq.seq_id)
        self.promised[d].pop(seq.seq_id, None)
        self.result(seq)

    def on_status(self, s: InstanceStatus) -> None:
        for seq_id in s.adopted:  # decode: these no longer need the blocks promised
            self.promised[s.rank].pop(seq_id, None)
        super().on_status(s)
        pools = self.pools()
        for name, pool in pools.items():
            self.pool_samples[name].append((pool["queue_depth_tokens"], pool["kv_occupancy"]))
        if self.on_snapshot:
            self.on_snapshot({"time": self.clock.now(), "arrived": self.expected - len(self.pending),
                              "finished": len(self.results), "pools": pools})

    def pools(self) -> dict:
        """Each pool's autoscaling signals, from the instances' latest reports."""
        out = {}
        for name, ranks in (("prefill", self.prefill), ("decode", self.decode)):
            reports = [self.status[r] for r in ranks if r in self.status]
            blocks = sum(r.num_blocks for r in reports)
            out[name] = {"instances": len(ranks),
                         "queue_depth_tokens": sum(r.queue_tokens for r in reports),
                         "kv_occupancy": sum(r.used_blocks for r in reports) / blocks if blocks else 0.0}
        return out


def launch(config, num_prefill: int, num_decode: int, make_requests, warm_up: bool = False,
           on_result=None, make_metrics=None, engine_policy=FCFS, speculative=None):
    """This rank's part of a run under mpirun -n P+D (ranks.launch): rank 0 returns (router,
    its engine, wall seconds), the others None. make_metrics(engine): rank 0's MetricsWriter
    for the pools' snapshots (metrics.PoolExport), or None."""
    n = num_prefill + num_decode
    split = f"{num_prefill}:{num_decode}"

    def make_router(link, engine):
        metrics = make_metrics(engine) if make_metrics else None
        return Router(link, num_prefill, num_decode, config.block_size, engine.clock, on_result,
                      metrics and metrics.tick)

    return launch_ranks(
        config, n, lambda got: f"--disagg {split} needs {n} MPI ranks, got {got}: run mpirun -n {n} python run.py "
                               f"--disagg {split} ...", make_requests,
        lambda engine, link, rank: (PrefillInstance if rank < num_prefill else DecodeInstance)(engine, link),
        make_router, warm_up, engine_policy, speculative)
