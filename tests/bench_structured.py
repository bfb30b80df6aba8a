"""Structured output on a real model: every schema's outputs parse and validate, batched with
unconstrained requests; and what compiling a large schema costs the requests already running.

    HF_HUB_OFFLINE=1 python tests/bench_structured.py [--model weights/SmolLM2-135M-Instruct]
        [--prompts 3] [--max-tokens 256] [--free 8] [--whitespace-flexible]

Part 1: SCHEMAS (nested objects, arrays with min/max items, enums, bounded numbers, optional
fields, anyOf unions, string formats and patterns) x --prompts chat prompts each, greedy, all
in one engine.generate call with --free unconstrained requests; each constrained output must
end with "stop", parse and validate against its schema (jsonschema). Part 2: LARGE, a schema of
a few hundred properties: the vocabulary's build and its compile times, against the decode
step of one unconstrained request; then that request's inter-token latency alone and while
LARGE compiles on another thread again and again (as the server compiles a request's schema
on a worker thread: llguidance drops the GIL while it compiles). docs/structured.md's figures
come from here.
"""
import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

import jsonschema  # noqa: E402

from nano.chat import template  # noqa: E402
from nano.config import EngineConfig  # noqa: E402
from nano.engine import LLMEngine  # noqa: E402
from nano.errors import NanoError  # noqa: E402
from nano.sequence import SamplingParams  # noqa: E402
from nano.structured import Vocabulary, compile_grammar, grammar  # noqa: E402


def obj(props: dict, required=None, **extra) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **extra}


S = {"type": "string", "maxLength": 24}
NAME = {"type": "string", "minLength": 1, "maxLength": 20}
SCHEMAS = {
    "person": obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 130}}),
    "city": obj({"city": NAME, "country": NAME, "population": {"type": "integer", "minimum": 0}}),
    "book": obj({"title": S, "author": NAME, "year": {"type": "integer", "minimum": 1400, "maximum": 2030}}),
    "colour": obj({"colour": {"enum": ["red", "green", "blue", "yellow", "black", "white"]}}),
    "sentiment": obj({"label": {"enum": ["positive", "negative", "neutral"]},
                      "confidence": {"type": "number", "minimum": 0, "maximum": 1}}),
    "point": obj({"x": {"type": "number", "minimum": -100, "maximum": 100},
                  "y": {"type": "number", "minimum": -100, "maximum": 100}}),
    "flags": obj({"active": {"type": "boolean"}, "admin": {"type": "boolean"}}),
    "tags": obj({"tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1,
                          "maxItems": 4}}),
    "scores": obj({"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                              "minItems": 2, "maxItems": 5}}),
    "address": obj({"street": S, "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    "nested": obj({"user": obj({"name": NAME, "email": {"type": "string", "format": "email"}}),
                   "role": {"enum": ["admin", "user", "guest"]}}),
    "deep": obj({"a": obj({"b": obj({"c": obj({"value": {"type": "integer", "minimum": 0, "maximum": 9}})})})}),
    "optional": obj({"name": NAME, "nickname": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 130}},
                    required=["name"]),
    "all_optional": obj({"note": S, "priority": {"enum": ["low", "high"]}}, required=[]),
    "union": obj({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10**6},
                                   {"type": "string", "pattern": "^[a-z]{3}-[0-9]{3}$"}]}}),
    "nullable": obj({"middle_name": {"anyOf": [NAME, {"type": "null"}]}, "last_name": NAME}),
    "date": obj({"event": S, "date": {"type": "string", "format": "date"}}),
    "datetime": obj({"event": S, "at": {"type": "string", "format": "date-time"}}),
    "uuid": obj({"id": {"type": "string", "format": "uuid"}}),
    "ipv4": obj({"host": {"type": "string", "format": "ipv4"}, "port": {"type": "integer", "minimum": 1,
                                                                         "maximum": 65535}}),
    "phone": obj({"phone": {"type": "string", "pattern": "^\\+[0-9]{1,3}-[0-9]{3}-[0-9]{4}$"}}),
    "hex_colour": obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    "list_of_objects": obj({"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                      "items": obj({"name": NAME, "qty": {"type": "integer", "minimum": 1,
                                                                          "maximum": 99}})}}),
    "matrix": obj({"rows": {"type": "array", "minItems": 2, "maxItems": 2,
                            "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                      "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}),
    "recipe": obj({"dish": S, "ingredients": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 5},
                   "minutes": {"type": "integer", "minimum": 1, "maximum": 600}}),
    "weather": obj({"city": NAME, "celsius": {"type": "number", "minimum": -60, "maximum": 60},
                    "sky": {"enum": ["sunny", "cloudy", "rain", "snow"]}}),
    "product": obj({"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"},
                    "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
                    "in_stock": {"type": "boolean"}}),
    "answer": obj({"answer": {"type": "string", "maxLength": 60}, "sources": {"type": "array", "maxItems": 2,
                                                                            "items": {"type": "string", "format": "uri"}}},
                  required=["answer"]),
    "const": obj({"version": {"const": 2}, "kind": {"const": "report"}, "ok": {"type": "boolean"}}),
    "one_of_shapes": obj({"shape": {"anyOf": [obj({"circle": {"type": "number", "minimum": 0, "maximum": 50}}),
                                              obj({"square": {"type": "number", "minimum": 0, "maximum": 50}})]}}),
    "enum_array": obj({"days": {"type": "array", "uniqueItems": True, "minItems": 1, "maxItems": 3,
                                "items": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]}}}),
    "int_array_bounds": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 3,
                         "maxItems": 3},
    "top_enum": {"enum": ["yes", "no", "maybe"]},
    "employee": obj({"name": NAME, "team": obj({"name": NAME, "size": {"type": "integer", "minimum": 1, "maximum": 50}}),
                     "skills": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
                     "manager": {"anyOf": [NAME, {"type": "null"}]}}, required=["name", "team", "skills"]),
}
PROMPTS = ["Reply with a JSON object that follows this schema: {schema}",
           "Give an example, in JSON, of a {name}.",
           "Make up realistic data for a {name}. Answer in JSON only."]


def large_schema(n: int = 300) -> dict:
    """A schema of n properties of mixed kinds, a few nested: as large as a real form's."""
    kinds = [{"type": "string", "maxLength": 40}, {"type": "integer", "minimum": 0, "maximum": 10**6},
             {"enum": [f"option_{i}" for i in range(12)]}, {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
             {"type": "array", "items": {"type": "number"}, "maxItems": 8},
             {"anyOf": [{"type": "string", "format": "date"}, {"type": "null"}]},
             obj({"a": {"type": "boolean"}, "b": {"type": "string", "format": "email"}})]
    return obj({f"field_{i:03d}": kinds[i % len(kinds)] for i in range(n)}, required=[f"field_{i:03d}"
                                                                                       for i in range(0, n, 3)])


def chat(engine, text: str) -> list[int]:
    return template.encode(engine.tokenizer, [{"role": "user", "content": text}])


def part1(engine, vocab, args) -> None:
    grammars, compile_times = {}, []
    for name, schema in SCHEMAS.items():
        t = time.perf_counter()
        try:
            grammars[name] = compile_grammar(vocab, "json", schema, name=name)
        except NanoError as e:  # a keyword llguidance lacks: as strict false takes it (ignored)
            print(f"  strict: {e}; compiled with strict false")
            grammars[name] = compile_grammar(vocab, "json", schema, strict=False, name=name)
        compile_times.append(time.perf_counter() - t)
    prompts, params, which = [], [], []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        for p in PROMPTS[:args.prompts]:
            prompts.append(chat(engine, p.format(schema=json.dumps(schema), name=name.replace("_", " "))))
            params.append(SamplingParams(temperature=0, max_tokens=args.max_tokens, logits_processor=grammars[name]))
            which.append(name)
    free = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i in range(args.free):
        prompts.append(chat(engine, f"Tell me a short story about the number {i}."))
        params.append(free)
    t = time.perf_counter()
    seqs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t
    valid, failures = 0, []
    for name, seq in zip(which, seqs):
        text = engine.detokenize(seq)
        try:
            assert seq.finish_reason == "stop", f"finish_reason {seq.finish_reason}"
            jsonschema.validate(json.loads(text), SCHEMAS[name], format_checker=jsonschema.FormatChecker())
            valid += 1
        except Exception as e:  # noqa: BLE001 (a report, not a test)
            failures.append((name, str(e).splitlines()[0][:100], text[:160]))
    tokens = sum(s.num_output_tokens for s in seqs)
    print(f"part 1: {len(SCHEMAS)} schemas x {args.prompts} prompts = {len(which)} constrained requests "
          f"+ {args.free} unconstrained, one batch: {valid}/{len(which)} valid; {tokens} tokens in {elapsed:.1f} s; "
          f"compile per schema: median {statistics.median(compile_times) * 1e3:.1f} ms, "
          f"max {max(compile_times) * 1e3:.1f} ms")
    for f in failures:
        print("  invalid:", *f)
    for name, seq in list(zip(which, seqs))[::args.prompts][:5]:
        print(f"  e.g. {name}: {engine.detokenize(seq)}")


def itl(engine, tokens: int) -> list[float]:
    """One unconstrained request's gaps between tokens (seconds)."""
    seq = engine.generate([chat(engine, "Count from one to a hundred.")],
                          SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))[0]
    return [b - a for a, b in zip(seq.token_times, seq.token_times[1:])]


def part2(engine, vocab, args) -> None:
    schema = large_schema()
    t = time.perf_counter()
    Vocabulary(engine.tokenizer.hf.to_str(), engine.model_config.vocab_size, sorted(engine.tokenizer.eos_token_ids))
    build = time.perf_counter() - t
    times = []
    for _ in range(3):
        t = time.perf_counter()
        compile_grammar(vocab, "json", schema)
        times.append(time.perf_counter() - t)
    compile_s = statistics.median(times)
    itl(engine, 8)  # warm
    alone = itl(engine, args.itl_tokens)
    stop, compiles = threading.Event(), [0]

    def compiling():
        while not stop.is_set():
            compile_grammar(vocab, "json", schema)
            compiles[0] += 1
    worker = threading.Thread(target=compiling)
    worker.start()
    try:
        during = itl(engine, args.itl_tokens)
    finally:
        stop.set()
        worker.join()

    def ms(gaps):
        gaps = sorted(gaps)
        return (f"median {statistics.median(gaps) * 1e3:.1f} ms, p90 {gaps[int(0.9 * len(gaps))] * 1e3:.1f} ms, "
                f"max {gaps[-1] * 1e3:.1f} ms")
    print(f"part 2: LARGE ({len(schema['properties'])} properties, {len(json.dumps(schema))} bytes): "
          f"compile {compile_s * 1e3:.0f} ms (median of 3); the vocabulary's build {build * 1e3:.0f} ms (once per "
          f"server)")
    print(f"  one unconstrained request's inter-token latency, alone: {ms(alone)}")
    print(f"  the same while LARGE compiles on another thread ({compiles[0]} compiles): {ms(during)}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="weights/SmolLM2-135M-Instruct")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--free", type=int, default=8)
    p.add_argument("--itl-tokens", type=int, default=64)
    p.add_argument("--skip", choices=["1", "2"])
    p.add_argument("--whitespace-flexible", action="store_true",
                   help="any whitespace between JSON tokens, as vLLM allows by default (nano's JSON is compact)")
    args = p.parse_args()
    grammar.JSON_DEFAULTS["whitespace_flexible"] = args.whitespace_flexible  # this process's grammars only
    engine = LLMEngine(EngineConfig(model=args.model, device="cpu"))
    vocab = Vocabulary.of(engine.tokenizer, engine.model_config.vocab_size)
    print(f"{args.model}: {len(SCHEMAS)} schemas")
    if args.skip != "1":
        part1(engine, vocab, args)
    if args.skip != "2":
        part2(engine, vocab, args)


if __name__ == "__main__":
    main()
