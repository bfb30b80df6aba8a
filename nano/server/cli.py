"""run.py --serve: the HTTP server until SIGTERM or Ctrl-C; then the TP ranks are told to stop.

Under mpirun there is no grace period: mpirun, on SIGTERM or Ctrl-C, passes SIGTERM on to
every rank and kills them all 0.25 s later (Open MPI 5: SIGCONT, then SIGTERM 0.25 s on,
then SIGKILL 0.25 s after that, however the ranks handle the signals). So open requests end
at once, a stream with an error event and [DONE], rather than be cut mid-stream."""
import json
import os
import sys

from nano import checks, parallel
from nano.cli.flags import given, parse_bytes
from nano.cli.output import metrics_writer
from nano.errors import NanoError
from nano.server import generation_config, tool_parsers
from nano.server.limits import CORS, LOG_LEVELS, SHUTDOWN_TIMEOUT, Limits
from nano.structured.bounds import GrammarLimits
from nano.weights import resolve_model


def add_arguments(p) -> None:
    h = p.add_argument_group("HTTP server (OpenAI-compatible, nano/server)")
    h.add_argument("--serve", action="store_true", help="serve /v1/completions, /v1/chat/completions, ... "
                   "(under mpirun --tp N: rank 0 serves)")
    h.add_argument("--host", default="127.0.0.1")
    h.add_argument("--port", type=int, default=8000)
    h.add_argument("--served-model-name", nargs="+", metavar="NAME", help="the names requests may give as "
                   "\"model\"; responses, /v1/models' first card and the metrics' model_name label carry the "
                   "first (vLLM's flag; default: the model folder's name)")
    h.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER", help="the sampling "
                   "defaults of requests that leave them out: auto, the model folder's generation_config.json "
                   "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens); vllm, "
                   "nano's own; a folder, its file (vLLM's flag)")
    h.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests in flight beyond this are answered 503")
    limits = Limits()
    h.add_argument("--api-key", default=os.environ.get("NANO_API_KEY"),
                   help="requests to /v1/* need the header Authorization: Bearer KEY (default: $NANO_API_KEY; "
                        "/health and /metrics stay open)")
    h.add_argument("--allowed-hosts", help="comma-separated names the Host header may hold ('*': any; default: "
                   "localhost, 127.0.0.1, [::1] and --host, or any when --host is 0.0.0.0 or ::)")
    for flag, what in (("--allowed-origins", "origins"), ("--allowed-methods", "methods"),
                       ("--allowed-headers", "headers")):
        h.add_argument(flag, help=f"CORS: the {what} a web page's script may use, as a JSON list (vLLM's flag; "
                       "default: '[\"*\"]', any)")
    h.add_argument("--allow-credentials", action="store_true", help="CORS: a page's script may send cookies "
                   "and Authorization (vLLM's flag)")
    h.add_argument("--max-request-bytes", type=parse_bytes, default=limits.body_bytes,
                   help="a request body's size (413 beyond, before parsing)")
    h.add_argument("--max-prompt-chars", type=int, default=limits.prompt_chars,
                   help="a prompt's characters, all chat messages together (checked before tokenizing)")
    h.add_argument("--max-stop-strings", type=int, default=limits.stop_strings, help="stop strings in a request")
    h.add_argument("--max-stop-chars", type=int, default=limits.stop_chars, help="characters in a stop string")
    h.add_argument("--max-request-tokens", type=int, default=limits.request_tokens,
                   help="n x max_tokens of a request (no max_tokens: the rest of the context)")
    h.add_argument("--max-stream-backlog", type=int, default=limits.stream_backlog,
                   help="chunks a stream may leave unread before its choices are aborted")
    h.add_argument("--max-bad-words", type=int, default=limits.bad_words, help="bad_words in a request (each word "
                   "at most --max-stop-chars long)")
    h.add_argument("--max-logit-bias", type=int, default=limits.logit_bias, help="logit_bias entries in a request")
    h.add_argument("--max-tools", type=int, default=limits.tools, help="tools in a request")
    h.add_argument("--max-grammar-bytes", type=parse_bytes, default=limits.grammar.grammar_bytes,
                   help="a grammar's size: a JSON schema's text, a regex, a Lark grammar, a choice's strings together")
    h.add_argument("--grammar-timeout", type=float, default=limits.grammar_timeout,
                   help="seconds a grammar may wait for a compile thread and take to compile (400 beyond; 503 if "
                        "it never got a thread)")
    h.add_argument("--grammar-workers", type=int, default=limits.grammar_workers,
                   help="threads that compile grammars, apart from the engine's (default: half the cores)")
    h.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT,
                   help="seconds open requests get after SIGTERM or Ctrl-C; then they end with an error")
    h.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice \"auto\" (the default with tools): the model's tool calls read back from its "
                        "text by --tool-call-parser")
    h.add_argument("--tool-call-parser", help="how tool calls are read from the model's text: hermes "
                   "(<tool_call>JSON</tool_call>, Hermes', Qwen2.5's and Qwen3's format)")
    h.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                   help="the server's log on stderr: one line per request (4xx at warning, 5xx at error) "
                        "and uvicorn's own lines")


def check_args(args) -> None:
    """The server's flags, before the model loads."""
    if not args.serve:
        if flags := given(args, add_arguments):
            raise NanoError(f"{', '.join(flags)}: the HTTP server's, which needs --serve")
        return
    checks.integer("--port", args.port, 0, 65535)
    checks.integer("--max-queued-requests", args.max_queued_requests, low=1)
    for flag, value in (("--max-request-bytes", args.max_request_bytes), ("--max-prompt-chars", args.max_prompt_chars),
                        ("--max-stop-strings", args.max_stop_strings), ("--max-stop-chars", args.max_stop_chars),
                        ("--max-request-tokens", args.max_request_tokens),
                        ("--max-stream-backlog", args.max_stream_backlog), ("--max-bad-words", args.max_bad_words),
                        ("--max-logit-bias", args.max_logit_bias), ("--max-tools", args.max_tools),
                        ("--max-grammar-bytes", args.max_grammar_bytes), ("--grammar-workers", args.grammar_workers)):
        checks.integer(flag, value, low=1)
    checks.number("--grammar-timeout", args.grammar_timeout, low=0, open_low=True)
    checks.number("--shutdown-timeout", args.shutdown_timeout, low=0)
    if parallel.launched_by_mpirun() and args.shutdown_timeout != SHUTDOWN_TIMEOUT:
        raise NanoError("--shutdown-timeout: under mpirun open requests end at once on SIGTERM or Ctrl-C "
                        "(mpirun kills every rank 0.25 s after passing SIGTERM on): drop it")
    if args.tool_call_parser is not None:
        try:
            tool_parsers.parser(args.tool_call_parser)
        except ValueError as e:
            raise NanoError(str(e)) from None
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise NanoError("--enable-auto-tool-choice requires --tool-call-parser")
    if args.api_key is not None and not args.api_key:
        raise NanoError("--api-key is empty (or NANO_API_KEY is set but empty)")
    cors(args)  # a list that is not one: an error before the model loads
    generation_config.read(args.generation_config, None)  # a folder's file: checked before the model loads
    if args.prompt_file or args.bench or args.disagg is not None:
        raise NanoError("--serve takes its prompts over HTTP: drop --prompt-file, --bench and --disagg")


def limits(args) -> Limits:
    return Limits(body_bytes=args.max_request_bytes, prompt_chars=args.max_prompt_chars,
                  stop_strings=args.max_stop_strings, stop_chars=args.max_stop_chars,
                  request_tokens=args.max_request_tokens, stream_backlog=args.max_stream_backlog,
                  bad_words=args.max_bad_words, logit_bias=args.max_logit_bias, tools=args.max_tools,
                  grammar=GrammarLimits(grammar_bytes=args.max_grammar_bytes), grammar_timeout=args.grammar_timeout,
                  grammar_workers=args.grammar_workers)


def served_name(args, engine) -> str:
    """The name responses and metrics carry: the first --served-model-name, else the model folder's."""
    return (args.served_model_name or [engine.model_name])[0]


def cors(args) -> dict:
    """CORSMiddleware's arguments from --allowed-origins, --allowed-methods, --allowed-headers
    (JSON lists of strings, as vLLM reads them) and --allow-credentials; vLLM's defaults for
    those not given."""
    out = {**CORS, "allow_credentials": args.allow_credentials}
    for flag, key in (("--allowed-origins", "allow_origins"), ("--allowed-methods", "allow_methods"),
                      ("--allowed-headers", "allow_headers")):
        text = getattr(args, flag[2:].replace("-", "_"))
        if text is None:
            continue
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise NanoError(f"{flag}: a JSON list of strings, as '[\"https://app.example\"]', got {text!r}")
        out[key] = value
    return out


def serve(args, engine, engine_metrics: bool = True, pool=None) -> int:
    """engine: an LLMEngine, or what answers its calls (nano/dp's front over replicas);
    engine_metrics: --metrics-file gets the engine's snapshot after each step (False: a
    front, whose router writes its own); pool: nano/lora's, with --enable-lora."""
    try:
        from nano.server.adapters import Adapters
        from nano.server.app import serve as serve_http
        from nano.server.middleware import allowed_hosts
    except ImportError as e:
        raise NanoError(f"--serve needs FastAPI and uvicorn (pip install -r requirements.txt): {e}") from None
    name = served_name(args, engine)
    adapters = None if pool is None else Adapters(pool, args.lora_modules, args.served_model_name or [engine.model_name],
                                                  args.allow_runtime_lora_updating)
    print(f"serving {name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    try:
        serve_http(engine, args.host, args.port, args.max_queued_requests,
                   metrics_writer(args, engine, name) if engine_metrics else None, limits(args),
                   args.api_key, allowed_hosts(args.host, args.allowed_hosts),
                   0.0 if parallel.launched_by_mpirun() else args.shutdown_timeout,
                   args.stall_timeout, args.log_level, args.chat_template, args.tool_call_parser,
                   args.enable_auto_tool_choice, cors(args), args.served_model_name,
                   generation_config.read(args.generation_config, resolve_model(engine.config.model)), adapters)
    finally:
        engine.stop_workers()
    return 0
