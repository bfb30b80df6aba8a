"""run.py --serve: the HTTP server until Ctrl-C; then the TP ranks are told to stop."""
import sys

from nano.cli.output import metrics_writer
from nano.errors import NanoError


def serve(args, engine) -> int:
    try:
        from nano.server.app import serve as serve_http
    except ImportError as e:
        raise NanoError(f"--serve needs FastAPI and uvicorn (pip install -r requirements.txt): {e}") from None
    print(f"serving {engine.shard.model_dir.name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    try:
        serve_http(engine, args.host, args.port, args.max_queued_requests, metrics_writer(args), args.stall_timeout)
    finally:
        engine.stop_workers()
    return 0
