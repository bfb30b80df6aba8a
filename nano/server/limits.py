"""What the server bounds, and its other defaults (each one a run.py --serve flag,
docs/server.md). Kept apart from app.py so that run.py shows the defaults without importing
FastAPI."""
import os
from dataclasses import dataclass, field

from nano.structured.bounds import GrammarLimits

GRAMMAR_CACHE = 32  # compiled grammars kept for requests that ask for one again, here and in the engine's process


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, so that none costs the others more than a bounded share.
    The defaults are far above what a client of a model with a context of thousands of tokens
    needs (OpenAI allows 4 stop strings)."""
    body_bytes: int = 8 * 2**20        # a request's body: 413 before it is parsed
    prompt_chars: int = 1_000_000      # a prompt (all messages together), checked before tokenizing
    stop_strings: int = 32             # stop strings in one request
    stop_chars: int = 256              # each stop string (also the text held back while streaming)
    request_tokens: int = 2**17        # n x max_tokens (no max_tokens: the rest of the context)
    stream_backlog: int = 1024         # chunks a stream may leave unread before its choices are aborted
    bad_words: int = 128               # bad_words in one request (each word as long as a stop string at most)
    logit_bias: int = 1024             # logit_bias entries in one request
    tools: int = 128                   # tools in one request (OpenAI's limit)
    grammar: GrammarLimits = field(default_factory=GrammarLimits)  # a grammar's size, before it compiles
    grammar_timeout: float = 10.0      # seconds a grammar may wait for, and take, its compile and first mask
    grammar_workers: int = max(1, ((os.cpu_count() or 1) + 1) // 2)  # grammars compiled at once (vLLM's: half
    # the cores); the others wait their turn, within grammar_timeout


# How deep the JSON a client sends may nest (arrays and objects, counted from the value's own top:
# a tool's parameters, a call's arguments): far above any real schema or call, far below what
# would take the recursion that the chat template and copy.deepcopy walk such a value with.
JSON_DEPTH = 64
SHUTDOWN_TIMEOUT = 5.0  # seconds open requests get to finish after SIGTERM or Ctrl-C
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")  # --log-level: Python's logging levels
# vLLM's defaults for --allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials
CORS = {"allow_origins": ["*"], "allow_methods": ["*"], "allow_headers": ["*"], "allow_credentials": False}
