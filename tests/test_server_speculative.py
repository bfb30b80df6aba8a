"""The server with speculative decoding on (--speculative-config): a step may add several
tokens to a sequence; streams still carry every token's text once and in order, and a stop
string inside an accepted run of drafts ends the output where it ends without drafts."""
import json

import pytest

from test_server import Running, httpx, openai  # noqa: F401 (it skips without the server's packages)

from nano.speculative import attach  # noqa: E402
from nano.telemetry.metrics import metrics_of  # noqa: E402

SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
RECORD = '{"name": "Ada Lovelace", "born": 1815, "city": "London", "field": "mathematics"}'
MESSAGES = [{"role": "user", "content": f"Repeat exactly: {RECORD}"}]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def servers():
    """(without drafts, with them): the same model and engine settings; the second's finished
    sequences kept (ended), to see how many tokens each step really gave."""
    plain, speculative = Running(), Running()
    attach(speculative.engine, SPECULATIVE)
    speculative.ended = []
    metrics_of(speculative.engine).request_observers.append(speculative.ended.append)
    yield plain, speculative
    plain.stop()
    speculative.stop()


def chat(srv, **body):
    return srv.client.chat.completions.create(model=srv.model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                              temperature=0, **body)


def accepted(srv) -> int:
    return metrics_of(srv.engine).spec_accepted


def stream(srv, **body) -> tuple[list[str], list[str], object]:
    """A streamed chat: its text deltas, its logprobs' tokens, its last chunk's usage."""
    deltas, tokens, usage = [], [], None
    for chunk in chat(srv, stream=True, stream_options={"include_usage": True}, logprobs=True, **body):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            deltas.append(choice.delta.content or "")
            tokens += [entry.token for entry in (choice.logprobs.content if choice.logprobs else None) or []]
    return deltas, tokens, usage


def test_the_answer_is_the_same_and_drafts_were_accepted(servers):
    plain, speculative = servers
    before = accepted(speculative)
    a, b = chat(plain), chat(speculative)
    assert "1815" in a.choices[0].message.content  # the model copies from the prompt: drafts have a chance
    assert b.choices[0].message.content == a.choices[0].message.content
    assert b.usage.completion_tokens == a.usage.completion_tokens
    assert accepted(speculative) - before >= 5


def test_a_stream_carries_every_tokens_text_once_in_order(servers):
    plain, speculative = servers
    want = chat(plain)
    before = accepted(speculative)
    deltas, tokens, usage = stream(speculative)
    assert accepted(speculative) - before >= 5  # steps that added several tokens
    assert "".join(deltas) == want.choices[0].message.content
    assert "".join(tokens).removesuffix("<|im_end|>") == want.choices[0].message.content  # a logprob per token
    assert len(tokens) == usage.completion_tokens == want.usage.completion_tokens
    plain_deltas, plain_tokens, _ = stream(plain)
    assert "".join(plain_deltas) == "".join(deltas) and plain_tokens == tokens


def test_a_stop_string_inside_an_accepted_run_ends_the_output_where_it_would(servers):
    """The text, the token count and the logprobs stop at the token that completes the stop
    string, although the step that gave it gave more (checked: at least one stop string
    falls inside an accepted run)."""
    plain, speculative = servers
    inside = []
    for stop in ("1815", "math"):  # "1815" falls inside an accepted run
        for streaming in (False, True):
            results = []
            for srv in servers:
                if streaming:
                    deltas, tokens, usage = stream(srv, stop=[stop])
                    results.append(("".join(deltas), usage.completion_tokens, len(tokens)))
                else:
                    out = chat(srv, stop=[stop])
                    results.append((out.choices[0].message.content, out.usage.completion_tokens,
                                    out.choices[0].finish_reason))
            assert results[1] == results[0], (stop, streaming)
            assert stop not in results[0][0]
            inside.append(speculative.ended[-1].num_output_tokens > results[0][1])
    assert any(inside)


def test_completion_logprobs_have_each_tokens_own_text_offset(servers):
    """/v1/completions logprobs: one entry per token, each at its own offset in the text, as
    without drafts (a step's several tokens do not share one)."""
    plain, speculative = servers
    before = accepted(speculative)
    outs = [srv.client.completions.create(model=srv.model, prompt=f"{RECORD}\n{RECORD[:20]}", max_tokens=24,
                                          temperature=0, logprobs=1) for srv in servers]
    assert accepted(speculative) - before >= 5
    a, b = (out.choices[0] for out in outs)
    assert b.text == a.text and b.logprobs.tokens == a.logprobs.tokens
    assert b.logprobs.text_offset == a.logprobs.text_offset
    assert len(set(a.logprobs.text_offset)) == len(a.logprobs.text_offset)
