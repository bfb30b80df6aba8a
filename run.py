"""nano's command line: prompts in, completions and a summary out.

    python run.py --prompt-file prompts.txt
    python run.py --bench --num-seqs 256 --input-len 100:1024 --output-len 100:1024
    python run.py --bench --request-rate 4 --ttft-slo 2000 --tpot-slo 100   (FCFS vs deadline)
    python run.py --capacity --kv-cache-memory 2GB               (capacity planning)
    mpirun -n 2 python run.py --tp 2 --prompt-file prompts.txt   (tensor parallel)
    mpirun -n 2 python run.py --disagg 1:1 --prompt-file prompts.txt   (prefill and decode apart)
    mpirun -n 2 python run.py --dp 2 --prompt-file prompts.txt   (replicas behind a KV-aware router)
    python run.py --serve --port 8000                           (OpenAI-compatible HTTP server)
    python run.py --lab list                                     (the lab: each concept's claim measured)

This file assembles the parser and dispatches; each mode's code, its flags and the checks
between them live with its package (add_arguments, check_args): nano/cli (the shared flags,
prompts in, completions out), nano/bench (benchmarks, capacity), nano/disagg, nano/dp,
nano/server, nano/lab (experiments).
"""
import argparse
import os
import signal
import sys

from nano import default_model, parallel
from nano.bench import cli as bench
from nano.cli import flags, offline
from nano.cli.output import exit_on_error
from nano.cli.prompts import prompt_workload
from nano.deadline import cli as deadline
from nano.disagg import cli as disagg
from nano.dp import cli as dp
from nano.errors import NanoError
from nano.fleet.world import world
from nano.lab import cli as lab
from nano.lora import cli as lora
from nano.server import cli as server
from nano.speculative import attach
from nano.speculative import cli as speculative
from nano.telemetry import heartbeat
from nano.telemetry.launcher import launcher_stderr
from nano.telemetry.watchdog import abort_all, alone


def build_parser() -> flags.Parser:
    p = flags.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_arguments(p)
    for add_on in (deadline, speculative, lora, server, bench, disagg, dp, lab):
        add_on.add_arguments(p)
    return p


def main(argv=None) -> int:
    group = parallel.tp_group()  # under mpirun every rank runs main; rank 0 alone talks to the user,
    with group.together():       # so a bad argument stops every rank, and is printed once
        heartbeat.start(group)   # every rank watched from here on (--stall-timeout), this collective included
        args, config, policy, params, requests = parse(argv, group.rank)
        heartbeat.set_timeout(args.stall_timeout)
        if not args.capacity and not args.disagg and not args.dp:  # a report for --tp N is computed in one process
            group.require(config.tp)
        if not args.lab:  # the lab fetches the default model only for a full-size run
            default_model.ensure(config.model)  # fetched and converted on first use
    if args.lab:
        return lab.run_lab(args)
    if args.capacity:
        bench.show_capacity(config)
        if args.disagg is not None:
            disagg.show_estimate(args, config, params)
        return 0
    if args.bench and args.policy_compare:
        return bench.policy_compare(args, config, deadline.policies(args.drop_late))
    workload = (bench.bench_workload(args, params) if args.bench
                else prompt_workload(requests, chat=not args.no_chat, chat_template=args.chat_template))
    if args.dp and args.serve:  # the server drives the replicas' router in place of an engine
        front = dp.make_front(args, config, policy)
        return 0 if front is None else server.serve(args, front, engine_metrics=False)
    if args.dp:
        return dp.run_dp(args, config, workload, policy)
    if args.disagg:
        return disagg.run_disagg(args, config, workload, policy)
    if args.disagg_compare:
        return disagg.disagg_compare(args, argv if argv is not None else sys.argv[1:], config, workload, policy)
    if args.bench and args.request_rate:
        return bench.rate_bench(args, config, params, deadline.policies(args.drop_late))
    if group.rank > 0:
        from nano.fleet.worker import Worker  # after argument checks: loading takes seconds
        worker = Worker(config)
        lora.use_adapters(args, runner=worker.runner)
        if args.bench:  # as rank 0's warm-up does: page faults stay out of the figures
            worker.runner.touch_kv_cache()
        offline.forward_interrupts(world())
        worker.run()
        return 0
    from nano.cli.output import describe
    from nano.engine import LLMEngine
    from nano.telemetry.metrics import Metrics
    engine = LLMEngine(config, policy=policy)
    Metrics.attach(engine)
    attach(engine, args.speculative)
    pool = lora.use_adapters(args, engine)
    print(describe(engine), file=sys.stderr)
    if args.serve:
        if engine.device.kind == "gpu":  # kernels compiled and decode graphs captured before requests
            offline.warm_up(engine)
        return server.serve(args, engine, pool=pool)
    if args.bench:
        return bench.run_bench(args, engine, params)
    return offline.run_prompts(args, engine, requests)


def parse(argv, rank: int):
    """Flags, checked (each package its own, in this order: the first error is the one
    printed); the scheduling policy's class; the prompt file, read (on rank 0) before the
    model loads."""
    parser = build_parser()
    args = parser.parse_args(argv)
    config = flags.engine_config(args)
    config.validate()
    policy = deadline.policy_factory(args.policy, args.drop_late)
    lab.check_args(args, parser)
    speculative.check_args(args)
    if args.lab is not None:
        return args, config, policy, None, None
    params = flags.check_args(args, rank)
    bench.check_args(args, config)
    flags.check_mode(args)
    server.check_args(args)
    disagg.check_args(args, config, rank)
    dp.check_args(args, config)
    lora.check_args(args)
    return args, config, policy, params, lora.prompt_adapters(args, flags.read_prompts(args, params, rank))


class Terminated(KeyboardInterrupt):
    """SIGTERM on rank 0: the run ends as after a Ctrl-C (its finished outputs written in order)."""


def on_sigterm(*_) -> None:
    """SIGTERM: what Slurm and Kubernetes send, and what mpirun, given SIGTERM or Ctrl-C,
    sends every rank 0.25 s before it kills them all. Rank 0 says so at once, then ends the
    run; another rank tells world rank 0, as for a Ctrl-C, and goes on until then."""
    group = world()
    if group.rank > 0:
        offline.tell_interrupted(group)
        return
    if not heartbeat.just_resumed():  # else another rank found this one stopped and said so
        os.write(launcher_stderr(), b"error: terminated (SIGTERM)\n")
    raise Terminated


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        sys.exit(main())
    except NanoError as e:
        exit_on_error(e, 2)
    except BrokenPipeError:  # stdout's reader went away (| head): end quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush into it
        abort_all(141)
    except Terminated:  # said already (on_sigterm)
        sys.stdout.flush()
        abort_all(143)
    except KeyboardInterrupt as e:  # here, or on another rank (PeerInterrupted): every rank ends
        exit_on_error(NanoError("interrupted"), 130, e.args[0] if e.args else None)
    except Exception as e:  # a bug: alone, show the traceback; under MPI, end every rank
        if alone():
            raise
        exit_on_error(e, 1)
