"""Offline inference: a list of requests run to completion through the engine's public API
(add_request, step), with progress, and --output written as requests finish; and the
warm-up every measured run starts with; and how a Ctrl-C on one MPI rank ends the run."""
import signal

from nano import parallel
from nano.cli.output import OutputFile, Progress, metrics_writer, print_completions, write_summary
from nano.cli.prompts import bound, model_inputs
from nano.sequence import SamplingParams
from nano.telemetry.metrics import metrics_of, reset_metrics
from nano.telemetry.summary import format_summary, summarize
from nano.telemetry.watchdog import Watchdog

INTERRUPTED = 7  # the tag of a rank's message to rank 0 that it was interrupted
_pending = None  # tell_interrupted()'s send, kept until it completes


class PeerInterrupted(KeyboardInterrupt):
    """On rank 0: another rank (args[0]) was interrupted. The run ends as after a Ctrl-C on
    rank 0 (its finished outputs written in order), not killed from that rank."""


def tell_interrupted(group: parallel.Group) -> None:
    """On a rank > 0 that got SIGINT or SIGTERM: tell group's rank 0, without waiting (this
    rank's steps go on until then)."""
    global _pending
    _pending = group.comm.isend(group.rank, dest=0, tag=INTERRUPTED)


def forward_interrupts(group: parallel.Group) -> None:
    """On a rank > 0: a SIGINT is passed on to group's rank 0 (the engine's, or nano/dp's
    router), which ends the run; a rank leaving mid-step would leave the others waiting in a
    collective."""
    signal.signal(signal.SIGINT, lambda *_: tell_interrupted(group))


def check_interrupted(group: parallel.Group) -> None:
    """On rank 0, between steps: raise PeerInterrupted if another rank told it
    (tell_interrupted) that it was interrupted."""
    if group.world > 1 and group.comm.Iprobe(tag=INTERRUPTED):
        raise PeerInterrupted(group.comm.recv(tag=INTERRUPTED))


def warm_up(engine) -> None:
    """First-use costs kept out of the figures: the whole KV pool written once (first-touch
    page faults, see ModelRunner.touch_kv_cache), then one short request (kernel compilation
    and graph capture on the GPU, BLAS thread start on the CPU; seen here: a first step of
    300 ms instead of 70). Metrics start afresh."""
    engine.touch_kv_cache()
    engine.generate([list(range(3, 19))], SamplingParams(max_tokens=4, ignore_eos=True))
    reset_metrics(engine)


def run_all(engine, inputs, per_request, arrivals=None, output=None, metrics=None, stall_timeout=None,
            loras=None):
    """Generate everything (arrivals: seconds from now at which each request arrives; output:
    an OutputFile that gets each request as it finishes; metrics: a MetricsWriter, given
    every step; stall_timeout: seconds a step may go without CPU before the run is ended;
    loras: each request's LoRARequest or None, nano/lora's). Returns (sequences, wall seconds)."""
    progress, watchdog = Progress(len(inputs)), Watchdog(stall_timeout)
    start = engine.clock.now()
    none = [None] * len(inputs)
    seqs = [engine.add_request(p, sp, None if t is None else start + t, lora_request=lora)
            for p, sp, t, lora in zip(inputs, per_request, none if arrivals is None else arrivals,
                                      none if loras is None else loras, strict=True)]
    index = {seq.seq_id: i for i, seq in enumerate(seqs)}
    while engine.has_unfinished():
        with watchdog.step():
            finished = engine.step()
        check_interrupted(parallel.tp_group())  # the engine's TP ranks: one got a SIGINT
        progress.update(len(finished), metrics_of(engine).generated_tokens)
        if metrics:
            metrics.after_step(engine)
        if output:
            for seq in finished:
                output.write(index[seq.seq_id], seq)
    return seqs, engine.clock.now() - start


def generate(path: str | None, engine, prompts, inputs, per_request, metrics=None, stall_timeout=None,
             loras=None):
    """run_all, with --output written as requests finish and put in input order at the end,
    also on Ctrl-C or an error; then the TP ranks are told to stop."""
    output = OutputFile(path, prompts, engine.detokenize) if path else None
    try:
        seqs, wall = run_all(engine, inputs, per_request, output=output, metrics=metrics,
                             stall_timeout=stall_timeout, loras=loras)
    finally:
        if output:
            output.close()
    engine.stop_workers()
    return seqs, wall


def run_prompts(args, engine, requests) -> int:
    """--prompt-file: every prompt's completion printed, then the run's summary."""
    prompts = [r.prompt for r in requests]
    inputs = model_inputs(engine.tokenizer, prompts, chat=not args.no_chat, chat_template=args.chat_template)
    seqs, wall = generate(args.output, engine, prompts, inputs, bound(engine, requests), metrics_writer(args, engine),
                          args.stall_timeout, [r.lora for r in requests])
    print_completions(prompts, seqs, engine.detokenize)
    summary = summarize(metrics_of(engine), wall)
    print(format_summary(summary))
    write_summary(args.summary_json, summary)
    return 0
