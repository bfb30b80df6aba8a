"""Logprobs through the server: echo (the prompt scored by the engine, as lm-evaluation-harness
asks for log-likelihoods), max_tokens 0, vLLM's prompt_logprobs, and top logprobs keyed so that
no two tokens collide. The real server on loopback, the `openai` client, the default model."""
import json

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_prompt_logprobs import reference
from test_server import Running, httpx

PROMPT = "The capital of France is"
# A finished chat turn: after its last "<|im_end|>\n" both "<|im_start|>" and "<|im_end|>"
# are among the five most likely tokens (they used to share one key, "").
TURNS = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"


@pytest.fixture(scope="module")
def srv():
    running = Running()
    yield running
    running.stop()


def test_echo_returns_the_prompt_scored_as_the_dense_forward(srv, default_dense):
    """lm-eval's kind of request (token ids, echo, logprobs, max_tokens > 0): the prompt's
    logprobs are the reference's log-softmax, the first null, then the completion's."""
    ids = srv.engine.tokenizer.encode(PROMPT)
    out = srv.client.completions.create(model=srv.model, prompt=ids, max_tokens=2, temperature=0, logprobs=3, echo=True)
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference(default_dense, ids + [0])  # rows 0..len(ids)-1 score tokens 1.. and the first output
    expected = [ref[i - 1, t] for i, t in enumerate(ids) if i]
    assert np.abs(np.array(lp.token_logprobs[1:len(ids)]) - expected).max() < 1e-4
    assert all(len(top) == 3 and max(top.values()) >= logprob - 1e-6
               for logprob, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]))
    plain = srv.client.completions.create(model=srv.model, prompt=ids, max_tokens=2, temperature=0, logprobs=3)
    assert choice.text == PROMPT + plain.choices[0].text
    # the plain request hits the prefix cache: its attention sums in another order
    assert lp.token_logprobs[len(ids):] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert "".join(lp.tokens) == choice.text  # plain text: each token's text, at its offset
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]


def test_max_tokens_zero_with_echo_scores_the_prompt_only(srv):
    ids = srv.engine.tokenizer.encode(PROMPT)
    out = srv.client.completions.create(model=srv.model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                        extra_body={"prompt_logprobs": 2})
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    assert len(choice.logprobs.tokens) == len(ids)
    # vLLM's prompt_logprobs: None, then per token {id: {logprob, rank, decoded_token}}, its own and the top 2
    vllm = choice.model_extra["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(ids)
    for i, (token, scores) in enumerate(zip(ids[1:], vllm[1:]), 1):
        own = scores[str(token)]
        assert own["logprob"] == choice.logprobs.token_logprobs[i]
        ranked = sorted(scores.values(), key=lambda s: s["rank"])
        assert [s["rank"] for s in ranked][:2] == [1, 2] and ranked[0]["logprob"] >= own["logprob"]
        assert own["decoded_token"] == choice.logprobs.tokens[i]
    echo_only = srv.client.completions.create(model=srv.model, prompt=PROMPT, max_tokens=0, echo=True)
    assert echo_only.choices[0].text == PROMPT and echo_only.choices[0].logprobs is None
    # a request with no token has no latencies, but it is a served request of its lengths
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)}
    generated = [s for s in families["vllm:request_generation_tokens"].samples if s.name.endswith("_bucket")]
    assert next(s.value for s in generated if s.labels["le"] == "1.0") >= 2  # both max_tokens 0 requests


@pytest.mark.parametrize("body,message", [
    ({"prompt": "hi", "max_tokens": 0}, "allowed with echo"),
    ({"prompt": "hi", "max_tokens": -1, "echo": True}, "max_tokens"),
    ({"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
])
def test_bad_scoring_requests_are_400(srv, body, message):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_a_stream_with_echo_sends_the_prompt_first(srv):
    kwargs = dict(model=srv.model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, echo=True)
    whole = srv.client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in srv.client.completions.create(stream=True, **kwargs) if c.choices]
    assert chunks[0].text.startswith(PROMPT)
    assert "".join(c.text for c in chunks) == whole.text
    assert sum((c.logprobs.tokens for c in chunks if c.logprobs), []) == whole.logprobs.tokens
    assert sum((c.logprobs.text_offset for c in chunks if c.logprobs), []) == whole.logprobs.text_offset


def test_top_logprobs_keep_every_token_special_ones_as_themselves(srv):
    ids = srv.engine.tokenizer.encode(TURNS)
    out = srv.client.completions.create(model=srv.model, prompt=ids, max_tokens=1, temperature=0, logprobs=5, echo=True)
    lp = out.choices[0].logprobs
    assert all(len(top) == 5 for top in lp.top_logprobs[1:])
    assert {"<|im_start|>", "<|im_end|>"} <= set(lp.top_logprobs[-1])  # the first output's
    assert lp.tokens[0] == "<|im_start|>" and lp.tokens[len(ids) - 2:len(ids)] == ["<|im_end|>", "\n"]
    chat = srv.client.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=40, temperature=0, logprobs=True, top_logprobs=5)
    content = chat.choices[0].logprobs.content
    assert all(len({t.token for t in c.top_logprobs}) == 5 for c in content)
    assert content[-1].token == "<|im_end|>" and chat.choices[0].finish_reason == "stop"
    assert bytes(content[-1].bytes) == b"<|im_end|>"


def test_a_piece_of_a_character_shows_as_its_bytes(srv):
    """A character split over tokens: each piece as OpenAI writes it, bytes:\\xNN; their bytes
    make the character."""
    ids = srv.engine.tokenizer.encode("🙂")
    out = srv.client.completions.create(model=srv.model, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    tokens = out.choices[0].logprobs.tokens
    assert len(tokens) == len(ids) > 1 and all(t.startswith("bytes:\\x") for t in tokens)
    raw = b"".join(bytes.fromhex(t.removeprefix("bytes:").replace("\\x", "")) for t in tokens)
    assert raw.decode() == "🙂" == out.choices[0].text


def test_two_tokens_of_the_same_text_get_two_keys():
    from nano.server.completions import top_by_token
    top = [{"token": "the", "id": 5, "logprob": -1.0}, {"token": "the", "id": 9, "logprob": -2.0}]
    assert top_by_token(top) == {"the": -1.0, "token_id:9": -2.0}


def test_prompt_logprobs_on_chat(srv):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()
    scores = r["choices"][0]["prompt_logprobs"]
    assert scores[0] is None and len(scores) == r["usage"]["prompt_tokens"]
    assert all(len(s) == 1 and json.dumps(s) for s in scores[1:])  # the token's own, rank included
