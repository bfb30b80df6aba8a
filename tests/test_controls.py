"""nano/controls: vLLM's sampling controls on the sampler's logits-processor seam. Each
control's definition on hand-made sequences and logits; greedy runs on the tiny model
(logit_bias, stop_token_ids, min_tokens, rows without controls untouched by rows with them);
the JSONL prompt file's fields; and the server's fields, honoured, with vLLM's range checks."""
import json

import numpy as np
import pytest

from nano import ops
from nano.cli import prompts
from nano.config import EngineConfig
from nano.controls import Controls, ControlError, sampling_params
from nano.engine import LLMEngine
from nano.errors import NanoError
from nano.sequence import SamplingParams, Sequence

V = 16


def seq_of(prompt, output):
    seq = Sequence(0, "", list(prompt), SamplingParams(), 0.0, seed=0)
    seq.token_ids += list(output)
    return seq


def applied(controls: Controls, seq, logits):
    """The logits after the processor's edits, as the sampler applies them (ops.edit_logits)."""
    out = np.array([logits], np.float32)
    if (edit := controls.edits(seq, [])) is not None:
        tokens = edit[0]
        assert len(np.unique(tokens)) == len(tokens)  # distinct, as the seam requires
        ops.edit_logits(out, np.zeros(len(tokens), np.int32), *edit)
    return out[0]


LOGITS = np.linspace(-4, 4, V).astype(np.float32)  # negative and positive logits both


def test_repetition_penalty_counts_prompt_and_output_tokens():
    got = applied(Controls(repetition_penalty=2.0), seq_of([1, 14], [3, 3, 12]), LOGITS)
    want = LOGITS.copy()
    for t in (1, 14, 3, 12):
        want[t] = want[t] / 2 if want[t] > 0 else want[t] * 2
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_frequency_and_presence_penalties_count_output_tokens_only():
    got = applied(Controls(frequency_penalty=0.5, presence_penalty=0.25), seq_of([1, 2, 2], [2, 5, 5, 5]), LOGITS)
    want = LOGITS.copy()
    want[2] -= 0.5 * 1 + 0.25  # once in the output (the prompt's two do not count)
    want[5] -= 0.5 * 3 + 0.25
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert Controls(frequency_penalty=1.0).edits(seq_of([1, 2], []), []) is None  # nothing output yet: nothing to do


def test_logit_bias_comes_before_the_penalties_as_in_vllm():
    """vLLM's sampler adds logit_bias, then applies the repetition penalty (to the biased
    logit: its sign decides), then subtracts the frequency and presence penalties."""
    got = applied(Controls(repetition_penalty=2.0, presence_penalty=1.0, logit_bias={15: 3.0, 0: -1.0, 9: -5.0}),
                  seq_of([0, 9], [15]), LOGITS)
    want = LOGITS.copy()
    assert LOGITS[15] > 0 and LOGITS[0] < 0 and 0 < LOGITS[9] < 5
    want[15] = (LOGITS[15] + 3.0) / 2 - 1.0
    want[0] = (LOGITS[0] - 1.0) * 2
    want[9] = (LOGITS[9] - 5.0) * 2  # positive before its bias, negative after: multiplied
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_min_tokens_bans_the_stop_tokens_until_reached():
    controls = Controls(min_tokens=3, stop_ids={7, 9})
    for output, banned in (([], True), ([1, 1], True), ([1, 1, 1], False)):
        got = applied(controls, seq_of([1], output), LOGITS)
        assert np.isneginf(got[[7, 9]]).all() == banned and np.isfinite(np.delete(got, [7, 9])).all()


def test_bad_words_ban_a_words_last_token_after_its_start():
    controls = Controls(bad_words_ids=[[4], [8, 9, 10]])
    for output, banned in (([], [4]), ([8], [4]), ([3, 8, 9], [4, 10]), ([8, 9, 3], [4])):
        got = applied(controls, seq_of([8, 9], output), LOGITS)  # the prompt's 8, 9 do not start the word
        assert np.flatnonzero(np.isneginf(got)).tolist() == banned, output


def test_the_builder_checks_each_field_by_name(tiny_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu"))
    assert sampling_params(engine, temperature=0).logits_processor is None  # no control: no processor
    assert sampling_params(engine, presence_penalty=0.0, logit_bias={}, bad_words=[]).logits_processor is None
    assert isinstance(sampling_params(engine, logit_bias={"5": 1}).logits_processor, Controls)
    for fields, field in (({"frequency_penalty": 5}, "frequency_penalty"),
                          ({"repetition_penalty": 0}, "repetition_penalty"),
                          ({"repetition_penalty": 1e-300}, "repetition_penalty"),  # 0 in float32
                          ({"repetition_penalty": 1e308}, "repetition_penalty"),  # inf in float32
                          ({"presence_penalty": -2.5}, "presence_penalty"), ({"logit_bias": {512: 1}}, "logit_bias"),
                          ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {3: 101}}, "logit_bias"),
                          ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"), ({"bad_words": "x"}, "bad_words"),
                          ({"stop_token_ids": [512]}, "stop_token_ids")):
        with pytest.raises(ControlError, match=field) as e:
            sampling_params(engine, **fields)
        assert e.value.field == field and "\n" not in str(e.value)
    with pytest.raises(NanoError, match="unknown sampling field 'colour'"):
        sampling_params(engine, colour=1)
    with pytest.raises(NanoError, match="min_p"):
        sampling_params(engine, min_p=1.5)


# ---- greedy runs on the tiny model ----
PROMPTS = [[5, 9, 33, 17], [100, 3, 250, 7, 7], [40, 41, 42]]


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(EngineConfig(model=str(tiny_model), device="cpu"))


def run(engine, params, prompts=PROMPTS[:1]):
    seqs = engine.generate(prompts, params)
    return [s.output_token_ids for s in seqs], [s.finish_reason for s in seqs]


def test_logit_bias_forces_and_forbids(engine):
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    [base], _ = run(engine, SamplingParams(**greedy))
    [forced], _ = run(engine, sampling_params(engine, **greedy, logit_bias={"300": 100}))
    assert forced == [300] * 6
    [other], _ = run(engine, sampling_params(engine, **greedy, logit_bias={base[0]: -100}))
    assert other[0] != base[0]


def test_stop_token_ids_and_min_tokens(engine):
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    [base], _ = run(engine, SamplingParams(**greedy))
    [out], [reason] = run(engine, SamplingParams(**greedy, stop_token_ids=[base[1]]))
    assert out == base[:2] and reason == "stop"
    [out], [reason] = run(engine, sampling_params(engine, **greedy, stop_token_ids=[base[0]], min_tokens=4))
    assert len(out) >= 4 and base[0] not in out[:4]


def test_rows_without_controls_get_what_they_get_alone(engine):
    plain = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    alone = [run(engine, plain, [p])[0][0] for p in (PROMPTS[0], PROMPTS[2])]
    controlled = sampling_params(engine, temperature=0, max_tokens=5, ignore_eos=True, presence_penalty=2.0,
                                 repetition_penalty=1.5, logit_bias={"300": 5, "301": -100}, bad_words=["ab"])
    mixed, _ = run(engine, [plain, controlled, plain], PROMPTS)
    assert [mixed[0], mixed[2]] == alone


def test_a_jsonl_prompt_files_controls(engine, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a", "temperature": 0, "logit_bias": {"300": 100}, "min_p": 0.1,
                                "stop_token_ids": [2], "presence_penalty": 1}) + "\n" + json.dumps({"prompt": "b"}))
    first, second = prompts.read_requests(str(path), SamplingParams())
    pending, plain = first.params, second.params
    bound = prompts.bound(engine, [first, second])
    assert isinstance(bound[0].logits_processor, Controls) and bound[0].min_p == 0.1 and bound[0].stop_token_ids == [2]
    assert bound[1] is plain
    for record, text in (({"frequency_penalty": 5}, "line 1: field frequency_penalty must be"),
                         ({"colour": 1}, "unknown field 'colour'")):
        path.write_text(json.dumps({"prompt": "a", **record}))
        with pytest.raises(NanoError, match=text):
            prompts.read_requests(str(path), SamplingParams())
    path.write_text(json.dumps({"prompt": "a", "logit_bias": {"999": 1}}))
    requests = prompts.read_requests(str(path), SamplingParams())
    with pytest.raises(NanoError, match="line 1: field logit_bias: token id 999 is out of the vocabulary"):
        prompts.bound(engine, requests)


# ---- the server ----
def test_the_servers_controls(tiny_model):
    test_server = pytest.importorskip("test_server")
    from test_server_abuse import assert_openai_error
    srv = test_server.Running(max_queued=8, model=str(tiny_model), device="cpu")
    try:
        def post(**fields):
            body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0,
                    **fields}
            return test_server.httpx.post(srv.url + "/v1/completions", json=body, timeout=60)

        def tokens(**fields):
            r = post(**fields)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["logprobs"]["tokens"]

        base = tokens()
        assert tokens(logit_bias={"300": 100}) != base
        assert tokens(presence_penalty=-2, frequency_penalty=-2, repetition_penalty=0.5) != base
        # every token "a" (logit_bias), "a" a stop string: the text cut before it, or after it
        # (include_stop_str_in_output), or, with min_tokens, not before that many tokens
        [a] = srv.engine.tokenizer.encode("a", plain=True)[-1:]
        assert srv.engine.tokenizer.decode([a]) == "a"
        text = lambda **f: post(stop=["a"], logit_bias={str(a): 100}, **f).json()["choices"][0]["text"]  # noqa: E731
        assert (text(), text(include_stop_str_in_output=True)) == ("", "a")
        assert (text(min_tokens=3), text(min_tokens=3, include_stop_str_in_output=True)) == ("aa", "aaa")
        for fields, param in (({"frequency_penalty": 5}, "frequency_penalty"),
                              ({"repetition_penalty": 0}, "repetition_penalty"),
                              ({"min_p": 1.5}, "min_p"), ({"logit_bias": {"abc": 1}}, "logit_bias"),
                              ({"logit_bias": {"512": 1}}, "logit_bias"), ({"min_tokens": 7}, "min_tokens")):
            r = post(**fields)
            assert_openai_error(r, 400, "")
            assert r.json()["error"]["param"] == param, r.text
    finally:
        srv.stop()
