"""Grammars from clients as a hostile one would send them (nano/structured, nano/server): sizes
bounded before llguidance compiles them, compiles on a thread whose stack fits the bounds,
within a time limit on a fixed number of threads, a grammar that can never be satisfied refused
before it runs, and a grammar that fails mid-output (a limit of llguidance's, or the request's
own controls against it) ending its choice with an error, never with "stop". On the tiny
random model; the child processes build the default model's vocabulary, where the limits were
measured."""
import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llguidance")

from test_server import httpx  # noqa: E402  (it skips without the server's packages)

from nano.config import EngineConfig  # noqa: E402
from nano.engine import LLMEngine  # noqa: E402
from nano.errors import NanoError  # noqa: E402
from nano.server.limits import Limits  # noqa: E402
from nano.server.schemas import BadRequest  # noqa: E402
from nano.server.serving import Server  # noqa: E402
from nano.structured import bounds  # noqa: E402
from nano.structured.bounds import GrammarLimits  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LIMITS = GrammarLimits()


def rule_chain(n: int) -> str:
    """A Lark grammar of n + 1 rules, each calling the next: llguidance recurses once a rule."""
    return "start: r0\n" + "".join(f'r{i}: "t" r{i + 1}\n' for i in range(n)) + f'r{n}: "end"\n'


def ref_chain(n: int) -> dict:
    """A JSON schema whose $defs call each other n deep: llguidance recurses once a $ref."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
            for i in range(n)}
    return {"$defs": {**defs, f"d{n}": {"type": "string"}}, "$ref": "#/$defs/d0"}


def nested(n: int) -> dict:
    schema = {"type": "string"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return schema


# ---- the bounds, before anything compiles ----
@pytest.mark.parametrize("kind, value, text", [
    ("grammar", rule_chain(LIMITS.rules), f"rules, more than this server's {LIMITS.rules}"),
    ("json", ref_chain(LIMITS.refs), f"$refs, more than this server's {LIMITS.refs}"),
    ("json", nested(LIMITS.json_depth), f"nested deeper than this server's {LIMITS.json_depth} levels"),
    ("json", json.dumps(nested(LIMITS.json_depth)), f"nested deeper than this server's {LIMITS.json_depth}"),
    ("regex", "a" * (LIMITS.grammar_bytes + 1), f"bytes, more than this server's {LIMITS.grammar_bytes}"),
    ("choice", ["a"] * (LIMITS.choices + 1), f"choices, more than this server's {LIMITS.choices}"),
    ("choice", ["a" * 1000] * 200, f"bytes, more than this server's {LIMITS.grammar_bytes}"),
])
def test_a_grammar_past_a_bound_is_refused_naming_it(kind, value, text):
    with pytest.raises(NanoError, match=r"^field: .*" + text.replace("$", r"\$")):
        bounds.check(kind, value, "field", LIMITS)


@pytest.mark.parametrize("kind, value", [
    ("grammar", rule_chain(LIMITS.rules - 2)), ("json", ref_chain(LIMITS.refs - 1)),
    ("json", nested(LIMITS.json_depth - 1)), ("choice", ["a"] * LIMITS.choices), ("regex", "a" * 1000),
])
def test_a_grammar_within_the_bounds_passes(kind, value):
    bounds.check(kind, value, "field", LIMITS)


# The deepest grammars within the bounds, compiled (and their first mask computed) from the main
# thread of a child process whose compile stack is the argument: a stack overflow ends the
# process (SIGSEGV), which a test in this process could not survive.
DEEPEST = textwrap.dedent("""
    import sys
    from nano import weights
    from nano.default_model.fetch import ensure
    from nano.structured import Vocabulary, compile_grammar, stack
    from nano.tokenizer import Tokenizer
    from test_server_grammar_limits import LIMITS, nested, ref_chain, rule_chain
    ensure()
    vocab = Vocabulary.of(Tokenizer(weights.WEIGHTS_DIR / weights.DEFAULT_MODEL), 49152)
    stack.STACK_BYTES = int(sys.argv[1])
    for kind, value in [("grammar", rule_chain(LIMITS.rules - 2)), ("json", ref_chain(LIMITS.refs - 1)),
                        ("json", nested(LIMITS.json_depth - 1))]:
        try:
            compile_grammar(vocab, kind, value)
        except Exception as e:  # refused by llguidance is fine: the process lives
            print(kind, "refused:", e)
    print("lived")
""")


def run_deepest(stack_bytes: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", DEEPEST, str(stack_bytes)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "PATH": "/usr/bin"})


def test_the_compile_stack_fits_the_deepest_grammar_within_the_bounds():
    from nano.structured.stack import STACK_BYTES
    done = run_deepest(STACK_BYTES)
    assert done.returncode == 0 and "lived" in done.stdout, done.stdout + done.stderr


def test_a_threads_default_stack_would_not():
    """The check above can fail: with a thread's default 8 MiB the same grammars end the process."""
    done = run_deepest(8 * 2**20)
    assert done.returncode != 0 and "lived" not in done.stdout, done.stdout + done.stderr


# ---- the compile threads' time limit, their busy hours, and the grammars kept ----
@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", kv_cache_memory=20 * 10**6))


SLOW = "(a{1000}){1000}"  # a regex whose first mask builds a large lexer: about a second


def test_a_grammar_past_its_time_limit_is_a_400_and_one_waiting_past_it_a_503(engine):
    server = Server(engine, limits=Limits(grammar_timeout=0.05, grammar_workers=1))

    async def both():
        return await asyncio.gather(server._compile("regex", SLOW, True, "structured_outputs.regex"),
                                    server._compile("regex", "b", True, "structured_outputs.regex"),
                                    return_exceptions=True)
    slow, waiting = asyncio.run(both())
    assert isinstance(slow, BadRequest) and slow.status == 400 and "took longer than" in str(slow), slow
    assert slow.param == "structured_outputs"
    assert isinstance(waiting, BadRequest) and waiting.status == 503 and waiting.code == "server_overloaded"


def test_a_grammar_within_its_time_limit_compiles_off_the_loop(engine):
    server = Server(engine, limits=Limits(grammar_workers=1))
    grammar = asyncio.run(server._compile("regex", "[a-z]{3}", True, "structured_outputs.regex"))
    assert grammar.first_mask is not None and grammar.first_mask.any()


def test_grammar_work_runs_at_a_lower_cpu_priority(engine):
    """Where cores are few, the engine's steps go before a compile and a first mask."""
    import os
    import threading
    from nano.structured.stack import NICENESS, on_large_stack

    def priority():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    server = Server(engine, limits=Limits(grammar_workers=1))
    asyncio.run(server._compile("regex", "[a-z]", True, "structured_outputs.regex"))
    assert server.grammars.submit(priority).result() == NICENESS and on_large_stack(priority) == NICENESS
    assert priority() == os.getpriority(os.PRIO_PROCESS, 0)  # the caller's own is as it was


def test_the_server_builds_the_vocabulary_and_freezes_its_heap_before_serving(engine, monkeypatch):
    """llguidance holds the GIL while it builds the vocabulary, and a full collection walks the
    whole heap with every thread stopped: both happen before the first request, not during one."""
    import gc
    from nano.server import app
    seen = {}

    def run(uvicorn):  # stands in for uvicorn's serving loop: what holds as requests would arrive
        seen.update(vocabulary=uvicorn.nano.vocabulary, frozen=gc.get_freeze_count())
    monkeypatch.setattr(app._Uvicorn, "run", run)
    try:
        app.serve(engine, "127.0.0.1", 0, 4)
    finally:
        gc.unfreeze()
        engine.stop_workers()
    assert seen["vocabulary"] is not None and seen["frozen"] > 0


def test_a_grammar_asked_for_again_is_compiled_once(engine):
    """Requests that arrive together share one compile; a later one gets the compiled grammar."""
    server = Server(engine, limits=Limits(grammar_workers=1))

    async def asked(*names):
        return await asyncio.gather(*(server._compile("regex", "[a-z]{3}", True, name) for name in names))
    first, again = asyncio.run(asked("structured_outputs.regex", "structured_outputs.regex"))
    later, = asyncio.run(asked("structured_outputs.regex"))
    other, = asyncio.run(asked("response_format"))  # named apart: its errors name its own field
    assert first is again is later and other is not first


# ---- the server ----
@pytest.fixture(scope="module")
def srv(tiny_model):
    from test_server import Running
    running = Running(max_queued=16, model=str(tiny_model), device="cpu", kv_cache_memory=20 * 10**6)
    yield running
    running.stop()


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json={"model": srv.model, **body}, timeout=120)


CHAT = {"messages": [{"role": "user", "content": "Go."}], "max_tokens": 8, "temperature": 0}
TOOL = {"type": "function", "function": {"name": "deep", "parameters": ref_chain(3000)}}


@pytest.mark.parametrize("path, body, param, text", [
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": rule_chain(3000)}},
     "structured_outputs", "rules, more than"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "deep", "schema": ref_chain(3000)}}}, "response_format", "$refs, more than"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": {"type": "function",
                                                                         "function": {"name": "deep"}}},
     "tool_choice", "$refs, more than"),
    ("/v1/responses", {"input": "Go.", "max_output_tokens": 8, "text": {"format": {
        "type": "json_schema", "name": "deep", "schema": ref_chain(3000)}}}, "text.format", "$refs, more than"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "self", "schema": {"$ref": "#"}}}}, "response_format", "the grammar allows no output"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": ["yes"]}, "min_tokens": 6},
     "min_tokens", "more than the longest of structured_outputs.choice"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": ["yes"]}, "bad_words": ["yes"]},
     None, "ban every token its grammar allows"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["w"] * 129}, "bad_words", "129 entries, more than"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["w" * 257]}, "bad_words", "longer than this server's 256"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(t): 1 for t in range(1025)}}, "logit_bias",
     "1025 entries, more than"),
])
def test_a_hostile_grammar_or_control_is_a_400_naming_it(srv, path, body, param, text):
    r = post(srv, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert text in error["message"] and error["param"] == param, error
    assert httpx.get(srv.url + "/health").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_fails_mid_output_ends_its_choice_with_an_error(srv, stream):
    """The regex allows two bytes, then only EOS, which min_tokens bans: the engine must not draw
    from a row with nothing allowed, and the choice must not end as if it were done."""
    body = {"prompt": "x", "structured_outputs": {"regex": "ab"}, "min_tokens": 5, "max_tokens": 8,
            "temperature": 0, "stream": stream}
    r = post(srv, "/v1/completions", body)
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert "error" in events[-1] and "cannot go on under its grammar" in events[-1]["error"]["message"], events
        assert all(c["finish_reason"] is None for e in events[:-1] for c in e["choices"]), events
    else:
        assert r.status_code == 400 and "cannot go on under its grammar" in r.json()["error"]["message"], r.text
    assert srv.idle()


def test_ignore_eos_past_the_grammars_end_is_no_failure(srv):
    """The grammar ends, then EOS follows EOS until max_tokens: the text is the choice, "length"."""
    r = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 6, "ignore_eos": True, "temperature": 0,
                                      "structured_outputs": {"choice": ["yes", "no"]}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] in ("yes", "no") and choice["finish_reason"] == "length", choice


def test_a_matcher_that_stopped_at_the_grammars_end_takes_eos_after_eos():
    """The default model's vocabulary, where llguidance stops a choice's matcher at its last
    token and refuses any token fed after that: EOS under ignore_eos is not fed to it."""
    from nano import weights
    from nano.default_model.fetch import ensure
    from nano.sequence import SamplingParams, Sequence
    from nano.structured import Vocabulary, compile_grammar
    from nano.tokenizer import Tokenizer
    ensure()
    tokenizer = Tokenizer(weights.WEIGHTS_DIR / weights.DEFAULT_MODEL)
    grammar = compile_grammar(Vocabulary.of(tokenizer, 49152), "choice", ["yes", "no"])
    eos = sorted(tokenizer.eos_token_ids)
    seq = Sequence(0, "", [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True), 0.0, 0)
    for token in tokenizer.encode("yes", plain=True) + eos * 3:
        grammar.mask(seq)
        seq.token_ids.append(token)
    allowed = np.flatnonzero(np.unpackbits(grammar.mask(seq).view(np.uint8), bitorder="little"))
    assert allowed.tolist() == eos
    assert grammar.failure(seq) is None and grammar.is_complete(seq)


def test_a_forced_call_whose_schema_cannot_end_is_an_error_not_a_call(srv):
    endless = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    r = post(srv, "/v1/chat/completions", {**CHAT, "max_tokens": 40, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": endless}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 200:  # the model ran out of tokens before llguidance's limits: honestly cut short
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and not choice["message"].get("tool_calls"), choice


def test_no_token_is_drawn_from_a_row_the_controls_and_the_grammar_leave_empty(engine):
    """Past "ab" the grammar allows only EOS and min_tokens bans it: the ban is dropped, so the
    row draws the grammar's EOS (never a token nothing allowed), and failure() says why."""
    from nano.controls import sampling_params
    from nano.structured import Vocabulary, chain, compile_grammar
    grammar = compile_grammar(Vocabulary.of(engine.tokenizer, engine.model_config.vocab_size), "regex", "ab")
    params = sampling_params(engine, temperature=0, max_tokens=8, min_tokens=6)
    params.logits_processor = chain(params.logits_processor, grammar)
    seq = engine.generate([[5, 6, 7]], params)[0]
    eos = sorted(engine.tokenizer.eos_token_ids)
    assert seq.output_token_ids == engine.tokenizer.encode("ab", plain=True) + eos, seq.output_token_ids
    assert "ban every token its grammar allows" in params.logits_processor.failure(seq)
