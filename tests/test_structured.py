"""Structured output (nano/structured): grammars compiled by llguidance constrain what the
engine samples. On the tiny random model (its byte-level tokenizer is a real one to
llguidance), so the outputs are random but must follow the grammar: JSON that validates,
regexes that match, one of the choices, a Lark grammar's language. A constrained request
leaves the others in its batch as they are alone, and its matcher's state survives
preemption by recompute and by swap, and a pickled copy of its sequence (disaggregated
serving's handoff). Then the server: response_format and structured_outputs."""
import json
import pickle
import re

import numpy as np
import pytest

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from nano.config import EngineConfig  # noqa: E402
from nano.engine import LLMEngine  # noqa: E402
from nano.errors import NanoError  # noqa: E402
from nano.fleet.ranks import wire_copy  # noqa: E402
from nano.sequence import LogitsProcessor, SamplingParams, Status  # noqa: E402
from nano.structured import Chain, Vocabulary, compile_grammar  # noqa: E402
from nano.telemetry.metrics import Metrics  # noqa: E402

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "kind": {"enum": ["cat", "dog", None]},
                         "tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                  "items": {"type": "string", "pattern": "^[a-z]{1,3}$"}},
                         "score": {"anyOf": [{"type": "number", "minimum": -1, "maximum": 1}, {"type": "boolean"}]}}}
REGEX = r"(ab|c)[0-9]{2,4}-(x|yz)"
CHOICES = ["red", "green", "blue", "dark blue"]
LARK = 'start: "(" expr ")"\nexpr: NUM | NUM "+" expr\nNUM: /[1-9]/'
LARK_LANGUAGE = re.compile(r"\([1-9](\+[1-9])*\)")
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [40, 41], [100, 200, 300, 400]]


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(EngineConfig(model=str(tiny_model), device="cpu"))


@pytest.fixture(scope="module")
def vocab(engine):
    return Vocabulary.of(engine.tokenizer, engine.model_config.vocab_size)


@pytest.fixture(scope="module")
def grammars(vocab):
    return {"json": compile_grammar(vocab, "json", PERSON), "regex": compile_grammar(vocab, "regex", REGEX),
            "choice": compile_grammar(vocab, "choice", CHOICES), "grammar": compile_grammar(vocab, "grammar", LARK)}


def follows(kind: str, text: str) -> bool:
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
        return True
    return bool({"regex": lambda: re.fullmatch(REGEX, text), "choice": lambda: text in CHOICES,
                 "grammar": lambda: LARK_LANGUAGE.fullmatch(text)}[kind]())


def constrained(grammar, seed=0, max_tokens=80):
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed, logits_processor=grammar)


@pytest.mark.parametrize("kind", ["json", "regex", "choice", "grammar"])
def test_outputs_follow_the_grammar(engine, grammars, kind):
    """Random draws (temperature 1, four seeds): each output is in the grammar's language and
    ends with "stop" (the grammar complete, EOS the only token allowed)."""
    seqs = engine.generate(PROMPTS, [constrained(grammars[kind], seed) for seed in range(len(PROMPTS))])
    for seq in seqs:
        text = engine.detokenize(seq)
        assert seq.finish_reason == "stop", (text, seq.finish_reason)
        assert follows(kind, text), text


def test_json_object_is_any_object(engine, vocab):
    seqs = engine.generate(PROMPTS[:2], constrained(compile_grammar(vocab, "json_object", None)))
    for seq in seqs:  # the random model may run out of tokens mid-object: then it is a prefix
        text = engine.detokenize(seq)
        assert text.startswith("{")
        if seq.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_one_processor_serves_a_batch_and_leaves_the_others_as_they_are_alone(engine, grammars):
    """Constrained and unconstrained requests in one batch: the unconstrained ones' tokens are
    those they get alone; the constrained ones follow their grammars."""
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [s.output_token_ids for s in engine.generate(PROMPTS, free)]
    kinds = ["json", "regex", "choice", "grammar"]
    params = [p for i, kind in enumerate(kinds) for p in (free, constrained(grammars[kind], i))]
    seqs = engine.generate([p for p in PROMPTS for _ in (0, 1)], params)
    assert [s.output_token_ids for s in seqs[::2]] == alone
    for kind, seq in zip(kinds, seqs[1::2]):
        assert follows(kind, engine.detokenize(seq))


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_the_matcher_survives_preemption(tiny_model, vocab, preemption):
    """A pool too small for the batch: sequences are preempted mid-output and resume; the
    outputs are those of an engine that never preempts (same seeds), so no token was fed to a
    matcher twice or skipped."""
    grammar = compile_grammar(vocab, "json", PERSON)
    prompts = [list(range(3 + i, 40 + i)) for i in range(6)]
    params = [constrained(grammar, seed) for seed in range(6)]
    roomy = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu"))
    want = [s.output_token_ids for s in roomy.generate(prompts, params)]
    tight = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", num_blocks=16, block_size=8, watermark=0.0,
                                   preemption=preemption))
    metrics = Metrics.attach(tight)
    seqs = tight.generate(prompts, params)
    assert metrics.preemptions[preemption] > 0
    assert [s.output_token_ids for s in seqs] == want
    for seq in seqs:
        assert follows("json", tight.detokenize(seq))


def test_chunked_prefill_and_prefix_hits_change_nothing(tiny_model, vocab):
    """Prompts prefilled in chunks of 16 tokens, then the same prompts again, served from the
    prefix cache: the constrained outputs are those of one unchunked, uncached engine."""
    grammar = compile_grammar(vocab, "json", PERSON)
    prompts = [list(range(3 + i, 60 + i)) for i in range(3)]
    params = [constrained(grammar, seed) for seed in range(3)]
    plain = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", enable_prefix_caching=False))
    want = [s.output_token_ids for s in plain.generate(prompts, params)]
    chunked = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", max_num_batched_tokens=16, block_size=8))
    assert [s.output_token_ids for s in chunked.generate(prompts, params)] == want
    again = chunked.generate(prompts, params)
    assert all(s.num_cached_tokens > 0 for s in again)
    assert [s.output_token_ids for s in again] == want


def test_a_pickled_sequence_goes_on_where_it_was(engine, grammars):
    """Disaggregated serving's handoff: a copy of a sequence mid-output, pickled (the native
    matcher dropped) and queued again, finishes as the original would have."""
    params = constrained(grammars["json"], seed=5)
    want = engine.generate([PROMPTS[1]], params)[0].output_token_ids
    seq = engine.add_request(PROMPTS[1], params)
    for _ in range(20):  # bounded: a sequence that stops early fails below, never hangs
        if seq.num_output_tokens >= 6 or seq.is_finished:
            break
        engine.step()
    assert seq.num_output_tokens == 6 and not seq.is_finished
    assert seq.processor_state.matcher is not None
    copy = pickle.loads(pickle.dumps(wire_copy(seq)))
    assert copy.processor_state.matcher is None and copy.params.logits_processor is not grammars["json"]
    engine.abort(seq)
    copy.status, copy.num_computed_tokens, copy.num_cached_tokens = Status.WAITING, 0, 0
    engine.queue(copy)
    while engine.has_unfinished():
        engine.step()
    assert copy.output_token_ids == want and follows("json", engine.detokenize(copy))


def allowed(mask: np.ndarray) -> set[int]:
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def test_the_mask_rolls_back_with_the_output(engine, grammars):
    """Fewer output tokens than the matcher consumed (a speculative decoder's rejected draft):
    the matcher rolls back, and the mask is the one it had at that length."""
    choice = grammars["choice"]
    seq = engine.make_sequence([5, 6], constrained(choice))
    first = allowed(choice.mask(seq).copy())
    assert first == {t for c in CHOICES for t in engine.tokenizer.encode(c)[:1]}
    seq.token_ids += engine.tokenizer.encode("dark")
    after = allowed(choice.mask(seq).copy())
    assert after and after != first
    del seq.token_ids[seq.num_prompt_tokens:]
    assert allowed(choice.mask(seq)) == first
    seq.token_ids += engine.tokenizer.encode("green")
    assert allowed(choice.mask(seq)) == engine.tokenizer.eos_token_ids & set(range(512))


class Ban(LogitsProcessor):
    """A stand-in for penalties: bans token 2 (EOS) until there are 3 output tokens; counts its calls in its state."""

    def edits(self, seq, ahead):
        seq.processor_state = (seq.processor_state or 0) + 1
        return None if seq.num_output_tokens >= 3 else (np.array([2], np.int32), np.zeros(1, np.float32),
                                                         np.ones(1, np.float32), np.full(1, -np.inf, np.float32))


def test_a_chain_combines_a_grammars_mask_with_anothers_edits(engine, vocab):
    grammar = compile_grammar(vocab, "regex", "[a-z]{1,8}")
    seq = engine.generate([[5, 6]], SamplingParams(temperature=1.0, max_tokens=20, seed=1,
                                                   logits_processor=Chain(grammar, Ban())))[0]
    assert re.fullmatch("[a-z]{3,8}", engine.detokenize(seq)), engine.detokenize(seq)
    assert seq.processor_state[1] == seq.num_output_tokens  # the Ban's own state, one call a token


@pytest.mark.parametrize("kind, value, text", [
    ("json", {"type": "nonsense"}, "json: "), ("json", {"type": "string", "pattern": "(unclosed"}, "json: "),
    ("regex", "[a-", "unclosed character class"), ("choice", [], "non-empty"),
    ("grammar", "start: missing_rule", "unknown name"),
])
def test_a_grammar_that_does_not_compile_is_one_line(vocab, kind, value, text):
    with pytest.raises(NanoError, match=re.escape(text)) as e:
        compile_grammar(vocab, kind, value)
    assert "\n" not in str(e.value)


def test_strict_false_ignores_what_llguidance_lacks(vocab):
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": "not-a-format"}}}
    with pytest.raises(NanoError):
        compile_grammar(vocab, "json", schema)
    compile_grammar(vocab, "json", schema, strict=False)


# ---- the server ----
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "rank"],
          "properties": {"city": {"type": "string", "maxLength": 8}, "rank": {"type": "integer", "minimum": 1,
                                                                              "maximum": 99}}}


@pytest.fixture(scope="module")
def srv(tiny_model):
    from test_server import Running
    running = Running(max_queued=16, model=str(tiny_model), device="cpu")
    yield running
    running.stop()


def chat_body(**extra):
    return {"messages": [{"role": "user", "content": "A city and its rank, in JSON."}], "max_tokens": 60,
            "temperature": 0, **extra}


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema(srv, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    if stream:
        chunks = srv.client.chat.completions.create(model=srv.model, **chat_body(response_format=fmt), stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        r = srv.client.chat.completions.create(model=srv.model, **chat_body(response_format=fmt))
        text, reason = r.choices[0].message.content, r.choices[0].finish_reason
        assert reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_response_format_json_object_and_text(srv):
    from test_server import httpx
    r = httpx.post(srv.url + "/v1/chat/completions", json=chat_body(response_format={"type": "text"}), timeout=120)
    assert r.status_code == 200, r.text
    r = httpx.post(srv.url + "/v1/chat/completions", json=chat_body(response_format={"type": "json_object"},
                                                                     max_tokens=8), timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("{"), r.text


@pytest.mark.parametrize("body, param, text", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "Invalid type"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "Input should be"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "structured_outputs.regex: "),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "set one of them"),
    ({"guided_regex": "a+"}, "guided_regex", "unknown field"),
])
def test_a_bad_grammar_is_a_400_naming_the_field(srv, body, param, text):
    from test_server import httpx
    r = httpx.post(srv.url + "/v1/chat/completions", json=chat_body(**body), timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and text in error["message"], error


@pytest.mark.parametrize("stream", [False, True])
def test_structured_outputs_choice_on_completions(srv, stream):
    extra = {"structured_outputs": {"choice": CHOICES}}
    out = srv.client.completions.create(model=srv.model, prompt="Pick a colour:", max_tokens=10, temperature=1.0,
                                        seed=3, n=3, stream=stream, extra_body=extra)
    if stream:
        texts = {}
        for chunk in out:
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
        texts = list(texts.values())
    else:
        texts = [c.text for c in out.choices]
    assert len(texts) == 3 and all(t in CHOICES for t in texts), texts
    assert srv.idle()


# ---- objects closed as vLLM's default backend closes them ----
@pytest.mark.parametrize("schema, allowed, refused", [
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, ['{"a":1}', "{}"], ['{"a":1,"b":2}']),
    ({"properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}},
     ['{"a":{"b":1}}'], ['{"a":{"b":1,"c":2}}', '{"a":{},"z":1}']),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
     ['{"a":1,"b":2}'], []),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, ['{"x":1}'], ['{"x":"s"}']),
    ({"type": "array", "prefixItems": [{"type": "integer"}]}, ["[1]"], ["[1,2]"]),
    ({"$defs": {"p": {"type": "object", "properties": {"n": {"type": "integer"}}}}, "$ref": "#/$defs/p"},
     ['{"n":1}'], ['{"n":1,"m":2}']),
    ({"anyOf": [{"type": "object", "properties": {"n": {"type": "integer"}}}, {"type": "null"}]},
     ['{"n":1}', "null"], ['{"n":1,"m":2}']),
    ({"type": "object", "anyOf": [{"properties": {"n": {"type": "integer"}}, "required": ["n"]}]},
     ['{"n":1}'], ['{"n":1,"m":2}']),
])
def test_an_object_allows_only_its_listed_properties_unless_it_says_otherwise(vocab, engine, schema, allowed, refused):
    grammar = compile_grammar(vocab, "json", schema)
    for text, expected in [(t, True) for t in allowed] + [(t, False) for t in refused]:
        ids = engine.tokenizer.encode(text, plain=True)
        matcher = grammar._compiled.deep_copy()
        whole = matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()
        assert whole == expected, (schema, text)


def test_closing_a_schema_leaves_the_callers_and_its_data_alone():
    from nano.structured.grammar import closed_schema
    schema = {"type": "object", "properties": {"a": {"const": {"type": "object"}}},
              "default": {"properties": {}}}
    closed = closed_schema(schema)
    assert "additionalProperties" not in schema  # the caller's copy is untouched
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["const"] == {"type": "object"} and closed["default"] == {"properties": {}}
