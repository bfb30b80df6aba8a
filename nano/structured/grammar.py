"""A grammar as a logits processor (nano.sequence.LogitsProcessor): llguidance compiles it
against the model's vocabulary once; each sequence gets its own matcher (a copy of the
compiled one), which consumes the sequence's output tokens it has not yet seen and fills the
next token's allowed-token bitmask. When the grammar is complete the mask allows EOS alone,
so the engine stops with "stop". When the matcher fails (a token it refused, a limit of
llguidance's passed), the mask allows EOS alone too, so that the row still has a token to draw,
and failure(seq) says why: whoever runs the request reports an error, never a finished answer.

The per-sequence state survives what the engine does to a sequence: preemption (by swap or
by recompute, the output tokens stay in seq.token_ids and the matcher just goes on from the
tokens it has consumed), tokens consumed that the output no longer holds (a speculative
step's drafts, rejected: rolled back), and pickling (disaggregated serving sends a copy of the
sequence to another process): the native matcher is dropped and rebuilt from the compiled
grammar and the output tokens the first time it is needed."""
from __future__ import annotations

import copy
import hashlib
import json
import threading
import zlib

import llguidance
import numpy as np

from nano.errors import NanoError
from nano.sequence import LogitsProcessor, Sequence
from nano.structured.stack import on_large_stack

_VOCABULARIES: dict[tuple, "Vocabulary"] = {}  # by (source digest, vocab size, EOS ids): one LLTokenizer each
_LOCK = threading.Lock()


class Vocabulary:
    """The model's tokenizer as llguidance reads it (an LLTokenizer: ~0.3 s to build for a 49k
    vocabulary, so built once per tokenizer and shared). size: the model's logits width (its
    vocab_size), which may exceed the tokenizer's ids; eos: the ids that end a sequence."""

    def __init__(self, source: str, size: int, eos: list[int]):
        if not eos:
            raise NanoError("structured output needs the model's EOS token, and this tokenizer has none")
        self.size, self.eos = size, sorted(eos)
        self.digest = hashlib.sha256(source.encode()).hexdigest()
        self._source = source
        try:
            self.llg = llguidance.LLTokenizer(source, n_vocab=size, eos_token=self.eos)
        except Exception as e:  # the library raises ValueError or a bare exception
            raise NanoError(f"llguidance cannot read this tokenizer: {e}") from None
        self.words = (size + 31) // 32  # the bitmask's int32 words

    @classmethod
    def of(cls, tokenizer, size: int) -> "Vocabulary":
        """The (cached) vocabulary of a nano.tokenizer.Tokenizer, for logits `size` wide."""
        source = tokenizer.hf.to_str()  # the tokenizers library's JSON, added tokens included
        return cls.cached(source, size, sorted(tokenizer.eos_token_ids))

    @classmethod
    def cached(cls, source: str, size: int, eos: list[int]) -> "Vocabulary":
        key = (hashlib.sha256(source.encode()).hexdigest(), size, tuple(sorted(eos)))
        with _LOCK:
            found = _VOCABULARIES.get(key)
        if found is None:
            found = cls(source, size, eos)
            with _LOCK:
                found = _VOCABULARIES.setdefault(key, found)
        return found

    def __reduce__(self):  # the tokenizer's source travels compressed (~1/4); a process that has it reuses it
        return _unpickle_vocabulary, (zlib.compress(self._source.encode(), 1), self.size, self.eos)


def _unpickle_vocabulary(source: bytes, size: int, eos: list[int]) -> Vocabulary:
    return Vocabulary.cached(zlib.decompress(source).decode(), size, eos)


# JSON as compact as the schema allows: a small model given free whitespace can spend its
# whole budget on newlines. A schema may ask for more through llguidance's "x-guidance" key.
JSON_DEFAULTS = {"whitespace_flexible": False}

# llguidance's bounds on one matcher's work (its defaults, but for the lexer's states, whose
# default of 250,000 at 1-2 kB each lets one grammar take hundreds of MB, and errors that name
# the grammar's rule rather than dump the parser's state). A step past them fails that
# sequence alone; llguidance's figures: lexer fuel ~14k a ms, Earley items ~20k a ms.
PARSER_LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
                     max_lexer_states=50_000, max_grammar_size=500_000, verbose_errors=False)


def grammar_source(kind: str, value, strict: bool = True, name: str | None = None) -> str:
    """llguidance's grammar text for a request's grammar: kind is json (a JSON schema, a dict
    or its text, closed by closed_schema), json_object (any object), regex, choice (a list of
    strings) or grammar (Lark, or GBNF, as llguidance reads them). strict False: JSON-schema
    keywords llguidance does not implement are ignored (lenient) rather than refused. name: the
    grammar's in errors (kind)."""
    matcher = llguidance.LLMatcher
    try:
        if kind == "json":
            schema = closed_schema(json.loads(value) if isinstance(value, str) else value)
            options = {"lenient": not strict}
            return matcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS, overrides=options)
        if kind == "json_object":
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
        if kind == "regex":
            return matcher.grammar_from_regex(value)
        if kind == "choice":
            if not value or not all(isinstance(c, str) and c for c in value):
                raise NanoError(f"{name or kind}: a non-empty list of non-empty strings")
            return llguidance.grammar_from("choice", list(value))
        if kind == "grammar":
            return llguidance.grammar_from("grammar", value)
    except (ValueError, TypeError) as e:
        raise NanoError(f"{name or kind}: {_one_line(str(e))}") from None
    raise NanoError(f"unknown grammar kind {kind!r}")


# The keywords whose value is a schema, a list of schemas, or a map of names to schemas: where
# closed_schema looks for object and array schemas (never inside const, enum or default, which
# hold data).
_SCHEMA = ("items", "additionalItems", "contains", "additionalProperties", "propertyNames", "not", "if", "then",
           "else", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# An object schema with one of these says what else it allows, or takes properties from schemas
# beside it (closing it would refuse theirs): closed_schema leaves it as it is and closes those.
_OPEN_OR_COMPOSED = {"additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
                     "$ref", "if", "dependentSchemas"}


def closed_schema(schema):
    """A copy of a JSON schema in which an object allows only the properties it lists, and an
    array of prefixItems only those items, where the schema does not say otherwise: vLLM's
    default backend (xgrammar, strict mode) reads schemas so, and clients rely on it (pydantic's
    schemas never say additionalProperties). An object with additionalProperties,
    patternProperties or unevaluatedProperties keeps them, and one composed with anyOf, oneOf,
    allOf, $ref or if is left open for the schemas it is composed with, which are closed; an
    array with items, additionalItems or unevaluatedItems keeps those. Walked with a stack,
    whatever its depth."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        kinds = node.get("type", [])
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if ("object" in kinds or "properties" in node) and not _OPEN_OR_COMPOSED & node.keys():
            node["additionalProperties"] = False
        if "prefixItems" in node and not {"items", "additionalItems", "unevaluatedItems"} & node.keys():
            node["items"] = False
        stack += [node[k] for k in _SCHEMA if isinstance(node.get(k), dict)]
        stack += [s for k in _SCHEMA_LIST if isinstance(node.get(k), list) for s in node[k]]
        stack += [s for k in _SCHEMA_MAP if isinstance(node.get(k), dict) for s in node[k].values()]
    return schema


def _one_line(message: str) -> str:
    return " ".join(message.split())[:400]


class MatcherState:
    """A sequence's matcher and the tokens it has consumed (output tokens, then maybe drafts, up
    to the grammar's end); pickled without the matcher (native), which is rebuilt from the
    grammar and the output tokens."""

    def __init__(self, matcher):
        self.matcher, self.consumed = matcher, []
        self.mask: np.ndarray | None = None  # the mask after the consumed tokens, while it holds
        self.failure: str | None = None      # why the matcher failed, once it has

    def __getstate__(self):
        return {"matcher": None, "consumed": [], "mask": None, "failure": self.failure}


class Grammar(LogitsProcessor):
    """A compiled grammar over a vocabulary; one object serves any number of sequences."""

    def __init__(self, vocabulary: Vocabulary, source: str, name: str = "grammar"):
        """Compiles `source` (grammar_source's text) and computes the mask of its first token,
        which for some grammars takes longer than the compile (a regex's lexer is built
        then); raises a one-line NanoError naming the problem, or saying that the grammar
        allows no output at all. Compiles on a thread with a large stack (stack.py) and drops
        the GIL while it works: call it off the thread that steps the engine."""
        self.vocabulary, self.source, self.name = vocabulary, source, name
        self._compiled = self._compile()
        first = self._compiled.deep_copy()
        self.first_mask = self._fill(first)
        if self.first_mask is None:
            why = _one_line(first.get_error()) or "no first token"
            raise NanoError(f"{self.name}: the grammar allows no output ({why})")

    def _compile(self):
        matcher = on_large_stack(lambda: llguidance.LLMatcher(self.vocabulary.llg, self.source, log_level=0,
                                                              limits=llguidance.LLParserLimits(**PARSER_LIMITS)))
        if matcher.is_error():
            raise NanoError(f"{self.name}: {_one_line(matcher.get_error())}")
        return matcher

    def _fill(self, matcher) -> np.ndarray | None:
        """The matcher's next-token mask as int32 words, or None if it has failed or allows nothing."""
        mask = np.zeros(self.vocabulary.words, np.uint32)
        if not matcher.is_error():
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        return None if matcher.is_error() or not mask.any() else mask.view(np.int32)

    def __getstate__(self):
        return {"vocabulary": self.vocabulary, "source": self.source, "name": self.name,
                "first_mask": self.first_mask}

    def __setstate__(self, state):
        self.__dict__.update(state, _compiled=None)  # compiled again when first needed

    def compile_again(self) -> None:
        """Compile now what a pickle left out, and compute a first mask, which builds the lexer
        that every later mask shares: on the caller's thread rather than in the first step that
        needs them."""
        if self._compiled is None:
            self._compiled = self._compile()
            self._fill(self._compiled.deep_copy())

    def state(self, seq: Sequence, ahead: list[int] = ()) -> MatcherState:
        """seq's matcher, having consumed seq's output tokens and then `ahead` (made, or rebuilt,
        as needed): tokens it consumed that differ (taken back, or drafts rejected) rolled back."""
        state = seq.processor_state
        if state is None or state.matcher is None:
            self.compile_again()
            state = seq.processor_state = MatcherState(self._compiled.deep_copy())
        out = seq.output_token_ids + list(ahead)
        n = min(len(state.consumed), len(out))
        differ = np.flatnonzero(np.asarray(state.consumed[:n]) != np.asarray(out[:n]))
        keep = int(differ[0]) if len(differ) else n  # the tokens consumed that still stand
        if keep < len(state.consumed):
            if not state.matcher.rollback(len(state.consumed) - keep):
                state.matcher = None
                return self.state(seq, ahead)
            del state.consumed[keep:]
            state.mask = None
        fed = 0
        for token in out[keep:]:
            if state.matcher.is_stopped():  # the grammar has ended: what follows is EOS under ignore_eos, not fed
                break
            state.matcher.consume_token(token)  # an error state shows in the mask below
            fed += 1
        if fed:
            state.consumed += out[keep:keep + fed]
            state.mask = None
        return state

    def mask(self, seq: Sequence, ahead: list[int] = ()) -> np.ndarray:
        state = self.state(seq, ahead)
        if state.mask is None:
            state.mask = self.first_mask if not state.consumed else self._fill(state.matcher)
            if state.mask is None:  # a token the grammar refused (ignore_eos past its end, ...), or a limit passed
                if not ahead:  # a draft the grammar refuses is rejected anyway: no failure of the sequence's
                    state.failure = _one_line(state.matcher.get_error()) or "the grammar allows no token here"
                state.mask = self.eos_mask()
        return state.mask

    def eos_mask(self) -> np.ndarray:
        """The mask that allows the model's EOS tokens alone."""
        mask = np.zeros(self.vocabulary.words, np.uint32)
        for t in self.vocabulary.eos:
            mask[t // 32] |= np.uint32(1 << (t % 32))
        return mask.view(np.int32)

    def failure(self, seq: Sequence) -> str | None:
        """Why seq's matcher failed (a one-line reason), or None while it has not."""
        state = seq.processor_state
        return None if state is None else state.failure

    def is_complete(self, seq: Sequence) -> bool:
        """The grammar is satisfied by seq's output so far (it may or may not go on)."""
        return self.state(seq).matcher.is_accepting()
