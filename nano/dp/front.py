"""--serve --dp N: the HTTP server on rank 0 drives the router instead of an engine.

The server's engine thread (nano/server/engine_thread.py) calls add_request, step, abort,
finish and reads each request's Sequence as it grows; Front answers those calls as the
router: a request goes to the replica the policy picks, every replica sends its requests'
new tokens after each of its steps ("tokens", Replica.stream), and they are appended to
the server's Sequence, which the thread turns into text as with one engine. Rank 0's own
replica steps inside Front.step, as in the command line's loop (ranks.Node.tick).
"""
from nano.fleet.ranks import run_node, start
from nano.dp import metrics as dp_metrics
from nano.dp.serving import Replica, Router, wrong_size
from nano.errors import NanoError
from nano.policy import FCFS
from nano.sequence import Sequence, Status

IDLE_WAIT = 0.005  # seconds a step waits for a message when nothing happened: a new request's extra latency


class Front:
    def __init__(self, node, world, export):
        self.node, self.world, self.router = node, world, node.router
        self.export = export  # dp_metrics.ReplicaExport: /metrics, and --metrics-prom's file
        engine = node.instance.engine
        self.local = engine  # rank 0's: it makes the sequences (checks, tokenizer, ids, seeds)
        self.tokenizer, self.clock, self.model_name = engine.tokenizer, engine.clock, engine.model_name
        self.max_model_len, self.model_config, self.config = engine.max_model_len, engine.model_config, engine.config
        self.live: dict[int, Sequence] = {}  # the server's sequences, by id, until their result
        self.router.accepting = True
        self.router.on_tokens = self.on_tokens
        self.router.on_result = self.on_result

    # ---- what the server's engine thread calls -------------------------------------------
    def add_request(self, prompt, params, arrival_time=None, lora_request=None) -> Sequence:
        if lora_request is not None:  # run.py refuses --enable-lora with --dp before any model loads
            raise NanoError("LoRA adapters are not served by data-parallel replicas (--dp)")
        seq = self.local.make_sequence(prompt, params, arrival_time)
        self.live[seq.seq_id] = seq
        self.router.add([seq])  # the router sends a copy: this one is the server's
        return seq

    def has_unfinished(self) -> bool:
        return True  # the router always has work: the replicas' messages

    def step(self) -> list[Sequence]:
        if not self.node.tick():
            self.node.instance.link.wait(IDLE_WAIT)
        return []

    def abort(self, seq: Sequence) -> None:
        self.end_here(seq, "aborted")

    def finish(self, seq: Sequence, reason: str) -> None:
        self.end_here(seq, reason)

    def end_here(self, seq: Sequence, reason: str) -> None:
        """The server is done with seq now; its replica is told, and its result, when it
        comes, is dropped."""
        if seq.is_finished:
            return
        self.live.pop(seq.seq_id, None)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.router.abort(seq.seq_id, reason)

    def snapshot(self) -> dict:
        """The router's signals now, which the server's engine thread sets self.export from."""
        return {"replicas": self.router.replicas(), "finished": len(self.router.results)}

    def stop_workers(self) -> None:
        """The server has ended: the replicas are stopped and give their final reports."""
        self.router.accepting = False
        self.router.stop()
        run_node(self.node, self.world)

    # ---- what the replicas send ------------------------------------------------------------
    def on_tokens(self, news) -> None:
        for seq_id, tokens, logits in news:
            seq = self.live.get(seq_id)
            if seq is not None:
                seq.token_ids.extend(tokens)
                seq.logits.extend(logits)

    def on_result(self, result: Sequence) -> None:
        seq = self.live.pop(result.seq_id, None)
        if seq is not None:  # its last tokens and how it ended
            logits = seq.logits + result.logits
            seq.__dict__.update(result.__dict__, logits=logits)


def start_front(config, num_replicas: int, policy: str, make_metrics=None, engine_policy=FCFS,
                speculative=None, model_name: str | None = None) -> Front | None:
    """Under mpirun -n DP x TP: rank 0 returns the Front the server drives; the other ranks
    run their replica (or their share of it) until the router stops them, and return None.
    make_metrics(engine, export): rank 0's MetricsWriter of that export, or None; model_name:
    the metrics' label (the server's name for the model; None: the folder's)."""
    exports = []

    def make_router(link, engine):
        exports.append(dp_metrics.ReplicaExport(model_name or engine.model_name))
        metrics = make_metrics(engine, exports[0]) if make_metrics else None
        return Router(link, num_replicas, policy, config.block_size, engine.clock, None,
                      metrics and metrics.tick)

    started = start(config, num_replicas, wrong_size(num_replicas, config.tp),
                    lambda engine, link, rank: Replica(engine, link, stream=True), make_router, warm_up=True,
                    engine_policy=engine_policy, speculative=speculative)
    if started is None:
        return None
    node, world, _ = started
    if node.router is None:
        run_node(node, world)
        return None
    return Front(node, world, exports[0])
