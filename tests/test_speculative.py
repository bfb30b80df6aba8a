"""Speculative decoding (nano/speculative on the engine's proposer seam): drafts are checked in
the normal step and leave no trace. Greedy outputs and every token's logits are those of a
plain dense forward pass however the engine schedules (the equivalence configs: chunked,
preempted by swap and by recompute, prefix hits), a cached block never holds an unchecked
token, and with sampling the output distribution is the target model's."""
import json

import numpy as np
import pytest

from nano.chat.template import render as render_chat
from nano.config import EngineConfig
from nano.engine import LLMEngine
from nano.errors import NanoError
from nano.sequence import SamplingParams, Sequence
from nano.speculative import NgramProposer, attach, parse
from nano.telemetry.metrics import Metrics, metrics_of
from test_equivalence import CHAT, CONFIGS, LOGIT_RTOL, check_against_dense, shared_prefix_prompts

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


class Checked:
    """An observer that counts each step's drafts and accepted drafts, and after every step
    checks the rollback: a running sequence has computed at most all its tokens but the last,
    and each of its blocks in the prefix cache holds its own tokens (never a rejected draft)."""

    def __init__(self, engine):
        self.engine, self.drafts, self.accepted, self.rejected = engine, 0, 0, 0
        self.accepted_at: dict[int, set[int]] = {}  # seq id -> output positions that were accepted drafts

    def on_step(self, plan, *_):
        for sample in plan.samples:
            seq, drafts = sample.seq, sample.drafts
            new = seq.output_token_ids[sample.output_count:]
            n = 0
            while n < min(len(drafts), len(new)) and new[n] == drafts[n]:
                n += 1
            self.drafts += len(drafts)
            self.accepted += n
            self.rejected += len(drafts) > n and len(new) > n  # a draft the target model replaced
            self.accepted_at.setdefault(seq.seq_id, set()).update(sample.output_count + j for j in range(n))
        bm, size = self.engine.block_manager, self.engine.config.block_size
        for seq in self.engine.scheduler.running:
            assert seq.num_computed_tokens <= seq.num_tokens - 1 and not seq.draft_token_ids
            for b, block_id in enumerate(seq.block_table):
                block = bm.blocks[block_id]
                if block.hash is not None:
                    assert block.token_ids == tuple(seq.token_ids[b * size:(b + 1) * size]), \
                        f"a cached block of seq {seq.seq_id} holds tokens it does not have"

    def on_finish(self, seq):
        pass

    def on_abort(self, seq):
        pass


def speculating(model_dir, **engine_args) -> tuple[LLMEngine, Checked]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", **{"num_blocks": 4096, **engine_args}))
    attach(engine, SPEC)
    checked = Checked(engine)
    engine.observers.append(checked)
    Metrics.attach(engine)
    return engine, checked


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, return_logits=True)


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_and_logits_match_dense(tiny_model, tiny_dense, name):
    prompts = shared_prefix_prompts(512, np.random.default_rng(1))
    engine, checked = speculating(tiny_model, **CONFIGS[name])
    seqs = engine.generate(prompts, GREEDY)
    check_against_dense(tiny_dense, prompts, seqs)  # tokens, and each token's logits row
    assert checked.accepted > 0 and checked.rejected > 0, "drafts both accepted and rejected"
    m = metrics_of(engine)
    if name.startswith("preempt"):
        assert sum(m.preemptions.values()) > 0


def test_prefix_hits_after_speculation_are_its_verified_blocks(tiny_model, tiny_dense):
    """A second batch of the same prompts finds the first's blocks (written with drafts in the
    step): its outputs are still the dense ones."""
    prompts = shared_prefix_prompts(512, np.random.default_rng(2))
    engine, _ = speculating(tiny_model, num_blocks=4096)
    full = [p + s.output_token_ids[:12] for p, s in zip(prompts, engine.generate(prompts, GREEDY))]
    seqs = engine.generate(full, GREEDY)
    check_against_dense(tiny_dense, full, seqs)
    assert metrics_of(engine).prefix_hits > 0


@pytest.mark.parametrize("pool", [{"kv_cache_dtype": "int8"}, {"batch_invariant": True}])
def test_batch_invariant_runs_keep_every_logit_bit(tiny_model, pool):
    """Batch-invariant on the CPU (the default for an int8 KV pool): a row's logits do not
    depend on the rows beside it, so speculation changes no token and no logit bit (the
    logprobs of accepted tokens are those without speculation, exactly)."""
    prompts = shared_prefix_prompts(512, np.random.default_rng(3))
    plain = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", num_blocks=4096, **pool))
    engine, checked = speculating(tiny_model, num_blocks=4096, **pool)
    want, got = plain.generate(prompts, GREEDY), engine.generate(prompts, GREEDY)
    assert [s.output_token_ids for s in got] == [s.output_token_ids for s in want]
    assert all(np.array_equal(np.stack(a.logits), np.stack(b.logits)) for a, b in zip(got, want))
    assert checked.accepted > 0


COPY = ('Repeat this JSON exactly: {"name": "Ada Lovelace", "born": 1815, "city": "London", '
        '"languages": ["English", "French"], "notes": "first programmer"}')


@pytest.fixture(scope="module")
def default_engines(default_model):
    """The default model without and with speculation (and the latter's Checked observer)."""
    return LLMEngine(EngineConfig(model=str(default_model), device="cpu", num_blocks=1024)), \
        *speculating(default_model, num_blocks=1024)


def test_default_model_and_a_stop_token_inside_an_accepted_run(default_engines):
    """The default model's chat answers and a copying answer are token for token those without
    speculation, each token's logits too; a stop token that arrives as an accepted draft ends
    the output there, as without speculation; so does max_tokens (no draft runs past it)."""
    plain, engine, checked = default_engines
    prompts = [plain.tokenizer.encode(render_chat(plain.tokenizer, text)) for text in (*CHAT[:2], COPY)]
    params = SamplingParams(temperature=0, max_tokens=40, return_logits=True)
    want, got = plain.generate(prompts, params), engine.generate(prompts, params)
    assert [s.output_token_ids for s in got] == [s.output_token_ids for s in want]
    for a, b in zip(got, want):
        assert np.abs(np.stack(a.logits) - np.stack(b.logits)).max() <= LOGIT_RTOL * np.abs(np.stack(b.logits)).max()
    out, accepted = got[2].output_token_ids, checked.accepted_at[got[2].seq_id]
    assert len(accepted) > len(out) / 3, "the copying answer is mostly accepted drafts"
    p = next(p for p in sorted(accepted) if out.index(out[p]) == p and p + 1 < len(out))
    seq = engine.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[out[p]]))[0]
    assert (seq.output_token_ids, seq.finish_reason) == (out[:p + 1], "stop")
    seq = engine.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=p + 1))[0]
    assert (seq.output_token_ids, seq.finish_reason) == (out[:p + 1], "length")


def test_drafts_stay_within_the_model_context(tiny_model):
    engine, checked = speculating(tiny_model, num_blocks=4096, max_model_len=40)
    prompts = [[5, 6, 7] * 10, [9, 8] * 12]
    seqs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    assert all(s.num_tokens == 40 and s.finish_reason == "length" for s in seqs)
    assert checked.drafts > 0


def chi_square(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic that two token-count histograms come from one distribution, tokens
    expected fewer than 5 times pooled into one cell; (statistic, degrees of freedom)."""
    table = np.stack([a, b]).astype(float)
    expected = table.sum(0) * table.sum(1)[:, None] / table.sum()
    small = expected.min(0) < 5
    table = np.column_stack([table[:, ~small], table[:, small].sum(1)]) if small.any() else table
    table = table[:, table.sum(0) > 0]
    expected = table.sum(0) * table.sum(1)[:, None] / table.sum()
    return float(((table - expected) ** 2 / expected).sum()), table.shape[1] - 1


def chi_square_bound(df: int, z: float = 3.09) -> float:
    """The statistic exceeded with probability ~1e-3 (z = 3.09) under the null: Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def test_sampling_keeps_the_target_distribution(tiny_model):
    """With sampling, a draft is accepted when the row draws it: with probability p(draft),
    and otherwise the token drawn is p's with the draft excluded, renormalised — the target
    distribution. Spec-on and spec-off runs (different seeds) give the same token frequencies
    at every output position, by a chi-square test at the 1e-3 level; a wrong accept rule
    (always accepting, or redrawing from all of p after a rejection) fails it."""
    n, positions = 2000, 6
    plain = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", num_blocks=8192))
    engine, checked = speculating(tiny_model, num_blocks=8192)

    def params(seed):
        return SamplingParams(temperature=1.0, top_k=4, max_tokens=positions, ignore_eos=True, seed=seed)

    # A context full of the tokens the model samples here, so that lookups find drafts it may accept.
    start = [7, 11, 13] * 4
    context = start + sum((s.output_token_ids for s in plain.generate([start] * 8, [params(s) for s in range(8)])), [])
    off = plain.generate([context] * n, [params(s) for s in range(100, 100 + n)])
    on = engine.generate([context] * n, [params(s) for s in range(10**6, 10**6 + n)])
    statistic, df = 0.0, 0
    for p in range(positions - 1):  # each position's tokens, and each pair of neighbours
        for key in (lambda q: q[p], lambda q: q[p] * 512 + q[p + 1]):
            s, d = chi_square(*(np.bincount([key(q.output_token_ids) for q in run], minlength=512 ** 2)
                                for run in (off, on)))
            statistic, df = statistic + s, df + d
    assert statistic < chi_square_bound(df), (statistic, df, checked.accepted, checked.rejected, checked.drafts)
    assert checked.accepted > 0.1 * n and checked.rejected > 0.1 * n  # the rule was put to the test


def test_a_bad_config_is_one_line():
    for config, words in [({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                          ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "at most"),
                          ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle'"),
                          ({"num_speculative_tokens": 2, "draft_model": "x"}, "'draft_model'"),
                          ("{not json", "not valid JSON"), ("[4]", "JSON object")]:
        with pytest.raises(NanoError, match=words) as e:
            parse(config)
        assert "\n" not in str(e.value)
    assert parse({}) is None and parse('{"num_speculative_tokens": 2}').prompt_lookup_max == 5


def test_a_seeded_request_draws_what_it_draws_without_speculation(tiny_model):
    """Each row draws with its sequence's seed and output count as key, so a seeded request
    samples the very tokens it samples without speculation (the accept rule then only decides
    how many of them one step yields)."""
    plain = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", num_blocks=4096))
    engine, checked = speculating(tiny_model, num_blocks=4096)
    context = [7, 11, 13] * 4 + [(5 * i) % 37 + 3 for i in range(40)] * 2
    params = [SamplingParams(temperature=1.0, top_k=4, max_tokens=8, ignore_eos=True, seed=s) for s in range(300)]
    want, got = plain.generate([context] * 300, params), engine.generate([context] * 300, params)
    assert [s.output_token_ids for s in got] == [s.output_token_ids for s in want]
    assert checked.accepted > 30 and checked.rejected > 30, (checked.accepted, checked.rejected)


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "born", "city", "languages"],
          "properties": {"name": {"type": "string"}, "born": {"type": "integer"}, "city": {"type": "string"},
                         "languages": {"type": "array", "items": {"type": "string"}}}}


def test_grammars_and_controls_check_the_drafts(default_engines):
    """A JSON schema (llguidance's mask), with a repetition penalty and bad words (edits) on
    top: each row's processors see its sequence as if the drafts before it were accepted, so
    a draft the grammar refuses is rejected and the output is token for token the one
    without speculation, valid against the schema."""
    jsonschema = pytest.importorskip("jsonschema")
    from nano.controls import sampling_params
    from nano.structured import Vocabulary, chain, compile_grammar
    plain, engine, checked = default_engines
    accepted, rejected = checked.accepted, checked.rejected
    grammar = compile_grammar(Vocabulary.of(plain.tokenizer, plain.model_config.vocab_size), "json", PERSON)
    prompt = plain.tokenizer.encode(render_chat(plain.tokenizer, COPY + " Drop the notes."))

    def params():
        p = sampling_params(plain, temperature=0, max_tokens=60, repetition_penalty=1.05, bad_words=["Paris"])
        p.logits_processor = chain(p.logits_processor, grammar)
        return p

    want, got = plain.generate([prompt], params())[0], engine.generate([prompt], params())[0]
    assert got.output_token_ids == want.output_token_ids and got.finish_reason == "stop"
    jsonschema.validate(json.loads(engine.detokenize(got)), PERSON)
    assert checked.accepted - accepted > 10 and checked.rejected > rejected


@pytest.mark.parametrize("tokens,drafts", [
    ([1, 2, 3, 4, 1, 2], [3, 4, 1, 2, 3]),   # the latest match of [1, 2]; then the text repeats
    ([7, 35, 35, 35], [35] * 5),              # a repeat of one token drafts it k times
    ([1, 2, 3], []),                          # nothing found: no drafts
    ([9, 4, 5, 6, 1, 4, 5, 6, 2, 5, 6], [2, 5, 6, 2, 5]),  # the longest n first: [5, 6] at its latest
])
def test_ngram_lookup(tokens, drafts):
    proposer = NgramProposer(parse({"num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 3}))
    seq = Sequence(0, "", tokens, SamplingParams(), 0.0, 0)
    assert proposer.propose(seq) == drafts
