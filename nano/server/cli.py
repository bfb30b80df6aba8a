"""run.py --serve: the HTTP server until SIGTERM or Ctrl-C; then the TP ranks are told to stop.

Under mpirun there is no grace period: mpirun, on SIGTERM or Ctrl-C, passes SIGTERM on to
every rank and kills them all 0.25 s later (Open MPI 5: SIGCONT, then SIGTERM 0.25 s on,
then SIGKILL 0.25 s after that, however the ranks handle the signals). So open requests end
at once, a stream with an error event and [DONE], rather than be cut mid-stream."""
import sys

from nano import checks, parallel
from nano.cli.output import metrics_writer
from nano.errors import NanoError
from nano.server.limits import SHUTDOWN_TIMEOUT, Limits


def check_args(args) -> None:
    """The server's flags, before the model loads."""
    for flag, value in (("--max-request-bytes", args.max_request_bytes), ("--max-prompt-chars", args.max_prompt_chars),
                        ("--max-stop-strings", args.max_stop_strings), ("--max-stop-chars", args.max_stop_chars),
                        ("--max-request-tokens", args.max_request_tokens),
                        ("--max-stream-backlog", args.max_stream_backlog)):
        checks.integer(flag, value, low=1)
    checks.number("--shutdown-timeout", args.shutdown_timeout, low=0)
    if parallel.launched_by_mpirun() and args.shutdown_timeout != SHUTDOWN_TIMEOUT:
        raise NanoError("--shutdown-timeout: under mpirun open requests end at once on SIGTERM or Ctrl-C "
                        "(mpirun kills every rank 0.25 s after passing SIGTERM on): drop it")
    if args.api_key is not None and not args.api_key:
        raise NanoError("--api-key is empty (or NANO_API_KEY is set but empty)")


def limits(args) -> Limits:
    return Limits(body_bytes=args.max_request_bytes, prompt_chars=args.max_prompt_chars,
                  stop_strings=args.max_stop_strings, stop_chars=args.max_stop_chars,
                  request_tokens=args.max_request_tokens, stream_backlog=args.max_stream_backlog)


def serve(args, engine, engine_metrics: bool = True) -> int:
    """engine_metrics: --metrics-file gets the engine's snapshot after each step (False: the
    engine is a front over replicas, nano/dp, whose router writes its own)."""
    try:
        from nano.server.app import serve as serve_http
        from nano.server.middleware import allowed_hosts
    except ImportError as e:
        raise NanoError(f"--serve needs FastAPI and uvicorn (pip install -r requirements.txt): {e}") from None
    print(f"serving {engine.model_name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    try:
        serve_http(engine, args.host, args.port, args.max_queued_requests,
                   metrics_writer(args, engine) if engine_metrics else None, limits(args),
                   args.api_key, allowed_hosts(args.host, args.allowed_hosts),
                   0.0 if parallel.launched_by_mpirun() else args.shutdown_timeout,
                   args.stall_timeout, args.log_level)
    finally:
        engine.stop_workers()
    return 0
