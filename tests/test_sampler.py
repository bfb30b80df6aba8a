"""The NumPy reference of ops.sample (what the CPU engine runs, and the oracle of the CUDA
kernel): greedy, temperature, top-k, top-p, seeding, and the Sampler around it."""
import numpy as np
import pytest

from nano import ops
from nano.device import Device
from nano.plan import Sample
from nano.sampler import Sampler
from nano.sequence import LogitsProcessor, SamplingParams, Sequence


def draw(logits, n, temperature=1.0, top_k=-1, top_p=1.0, seed=7):
    """n draws from one row: the same seed, counters 0..n-1 (a sequence's n output tokens)."""
    rows = np.repeat(np.asarray(logits, np.float32)[None], n, axis=0)
    return ops.sample(rows, np.full(n, temperature, np.float32), np.full(n, top_k, np.int32),
                      np.full(n, top_p, np.float32), np.full(n, -np.inf, np.float32), np.full(n, seed, np.uint64),
                      np.arange(n, dtype=np.int32))


def softmax(x, t=1.0):
    e = np.exp((x - x.max()) / t)
    return e / e.sum()


def test_greedy_is_argmax_with_ties_to_lowest_index():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 1000)).astype(np.float32)
    logits[1, [700, 90, 999]] = 9.0
    logits[2, :] = -3.0
    got = ops.sample(logits, np.zeros(6, np.float32), np.full(6, 5, np.int32), np.full(6, 0.5, np.float32),
                     np.full(6, np.log(0.5), np.float32), np.arange(6, dtype=np.uint64), np.zeros(6, np.int32))
    np.testing.assert_array_equal(got, logits.argmax(axis=1))
    assert got[1] == 90 and got[2] == 0


def test_temperature_frequencies_match_softmax():
    """Chi-square over 4000 draws on an 8-token vocabulary: 7 degrees of freedom, so a
    statistic above 30 has probability ~1e-4 for a correct sampler (the draws are fixed by
    the seed, so this cannot flake: it either holds for this seed or never)."""
    logits = np.array([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.2, 1.5], np.float32)
    n, t = 4000, 0.8
    counts = np.bincount(draw(logits, n, temperature=t), minlength=8)
    expected = n * softmax(logits, t)
    assert ((counts - expected) ** 2 / expected).sum() < 30, counts


def test_top_k_stays_in_the_top_k_and_keeps_ties():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=500).astype(np.float32)
    top = set(np.argsort(-logits)[:10].tolist())
    got = draw(logits, 2000, temperature=2.0, top_k=10)
    assert set(got.tolist()) == top  # never outside; at temperature 2 every one shows up
    tied = np.zeros(50, np.float32)
    tied[[3, 8]] = 5.0
    tied[[11, 20, 30]] = 4.0  # the 3rd largest value is shared by 3 tokens: all stay allowed
    assert set(draw(tied, 3000, temperature=3.0, top_k=3).tolist()) == {3, 8, 11, 20, 30}


def test_top_p_stays_in_the_nucleus():
    rng = np.random.default_rng(2)
    logits = (2 * rng.normal(size=300)).astype(np.float32)
    p, t = 0.7, 1.3
    probs = softmax(logits, t)
    order = np.argsort(-probs)
    nucleus = set(order[:int(np.searchsorted(np.cumsum(probs[order]), p)) + 1].tolist())
    got = draw(logits, 3000, temperature=t, top_p=p)
    assert set(got.tolist()) == nucleus


def test_top_k_then_top_p():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.05, 0.05], np.float32))
    # top-k 3 renormalises to 4/9, 3/9, 2/9: a nucleus of 0.7 needs the first two.
    assert set(draw(logits, 500, top_k=3, top_p=0.7).tolist()) == {0, 1}


def test_same_seed_and_counter_same_token_whatever_the_rest_of_the_batch():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(5, 200)).astype(np.float32)
    args = (np.full(5, 1.0, np.float32), np.array([-1, 5, -1, 50, 0], np.int32),
            np.array([1.0, 1.0, 0.9, 0.8, 1.0], np.float32), np.float32([-np.inf, -np.inf, np.log(0.05), -np.inf, -1]),
            np.array([1, 2, 3, 2**63 + 5, 9], np.uint64),
            np.array([0, 4, 4, 100, 7], np.int32))
    batch = ops.sample(logits, *args)
    for r in range(5):
        alone = ops.sample(logits[r:r + 1], *(a[r:r + 1] for a in args))
        assert alone[0] == batch[r]
    assert len(set(draw(logits[0], 40).tolist())) > 1   # counters change the draw
    np.testing.assert_array_equal(draw(logits[0], 40, seed=11), draw(logits[0], 40, seed=11))


def test_float_keys_order_like_floats():
    x = np.array([-np.inf, -3e38, -1.0, -1e-30, -0.0, 0.0, 1e-30, 0.5, 1.0, 3e38, np.inf], np.float32)
    assert (np.diff(ops.float_keys(x).astype(np.int64)) >= 0).all()
    assert np.all(np.diff(ops.float_keys(x[[0, 1, 2, 3, 5, 6, 7, 8, 9, 10]]).astype(np.int64)) > 0)


# Draws pinned to literal values: a change to the hash, its constants or the thresholds shows
# here. tests/test_kernels.py asserts that cuda/sampling.cu gives the same tokens.
PINNED_LOGITS = np.repeat((np.arange(64, dtype=np.float32) / 16 - 2)[None], 8, axis=0)  # exact in float16
PINNED_ARGS = (np.float32([1.0, 0.7, 1.0, 0.8, 1.3, 1.0, 0.5, 2.0]),          # temperature
               np.int32([-1, -1, 10, -1, 3, -1, -1, 5]),                      # top_k
               np.float32([1, 1, 1, 0.9, 1, 0.5, 1, 0.8]),                    # top_p
               np.full(8, -np.inf, np.float32),                               # log_min_p: off
               np.array([0, 1, 7, 2**32 + 1, 2**63, 2**64 - 1, 12345, 99], np.uint64),  # seeds
               np.int32([0, 3, 6, 9, 12, 15, 18, 2**31 - 1]))                 # counters
PINNED_TOKENS = [62, 57, 62, 61, 61, 60, 59, 63]


def test_draws_are_pinned():
    np.testing.assert_array_equal(ops.sample(PINNED_LOGITS, *PINNED_ARGS), PINNED_TOKENS)
    u = ops.uniforms(0x0123456789ABCDEF, 5, 6)
    np.testing.assert_array_equal(u.view(np.uint32), [1033321640, 1055463570, 1064463239,
                                                      1046039420, 1004789120, 1063697259])


def test_uniforms_are_open_unit_interval_and_fixed():
    u = ops.uniforms(2**64 - 1, 2**31 - 1, 100_000)
    assert u.dtype == np.float32 and 0 < u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.01
    np.testing.assert_array_equal(ops.uniforms(0, 0, 3), ops.uniforms(0, 0, 5)[:3])
    assert not np.array_equal(ops.uniforms(0, 0, 3), ops.uniforms(0, 1, 3))
    assert not np.array_equal(ops.uniforms(1, 0, 3), ops.uniforms(2**32 + 1, 0, 3))


def test_sampler_rows_params_and_logits():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(3, 64)).astype(np.float32)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_k=5, return_logits=True),
              SamplingParams(temperature=1.0, top_p=0.5, seed=-3)]
    seqs = [Sequence(i, "", [1, 2, 3], p, 0.0, seed=-3 if i == 2 else 10 + i) for i, p in enumerate(params)]
    seqs[1].token_ids.append(4)  # one output token so far: counter 1
    samples = [Sample(seq, [i], [], seq.num_output_tokens) for i, seq in enumerate(seqs)]
    tokens, kept = Sampler(Device("cpu"), ops.REFERENCE).sample(logits, samples)
    tokens = [t for (t,) in tokens]
    kept = {i: rows[0] for i, rows in enumerate(kept) if rows}
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[1] == ops.sample(logits[1:2], np.float32([0.9]), np.int32([5]), np.float32([1.0]), np.float32([-np.inf]),
                                   np.uint64([11]), np.int32([1]))[0]
    assert tokens[2] == ops.sample(logits[2:3], np.float32([1.0]), np.int32([-1]), np.float32([0.5]), np.float32([-np.inf]),
                                   np.uint64([2**64 - 3]), np.int32([0]))[0]
    assert list(kept) == [1] and not any(seq.logits for seq in seqs)  # the engine appends them
    np.testing.assert_array_equal(kept[1], logits[1])


@pytest.mark.parametrize("vocab", [1, 2, 49152])
def test_edge_vocab_sizes(vocab):
    logits = np.random.default_rng(5).normal(size=(2, vocab)).astype(np.float32)
    got = ops.sample(logits, np.float32([0.7, 1.0]), np.int32([1, vocab]), np.float32([1.0, 1e-6]),
                     np.float32([-np.inf, -np.inf]), np.uint64([1, 2]), np.int32([0, 0]))
    assert got[0] == logits[0].argmax() and got[1] == logits[1].argmax()  # top-1 and a tiny nucleus


def test_min_p_keeps_exactly_the_tokens_within_min_p_of_the_likeliest():
    """min_p 0.2 at temperature 0.8: p_i >= 0.2 * p_max after temperature, as vLLM defines it.
    Every such token shows up in 3000 draws and no other one does."""
    logits = np.log(np.array([0.3, 0.25, 0.2, 0.1, 0.08, 0.05, 0.02], np.float32))
    probs = softmax(logits, 0.8)
    rows = np.repeat(logits[None], 3000, axis=0)
    got = ops.sample(rows, np.full(3000, 0.8, np.float32), np.full(3000, -1, np.int32), np.ones(3000, np.float32),
                     np.full(3000, np.log(0.2), np.float32), np.full(3000, 5, np.uint64), np.arange(3000, dtype=np.int32))
    assert set(got.tolist()) == set(np.flatnonzero(probs >= 0.2 * probs.max()).tolist()) == {0, 1, 2, 3}


def test_edit_logits_and_mask_logits():
    logits = np.array([[2.0, -2.0, 1.0, 0.0], [3.0, 3.0, 3.0, 3.0]], np.float32)
    ops.edit_logits(logits, np.int32([0, 0, 1, 1]), np.int32([0, 1, 3, 0]), np.float32([0.0, 0.0, 0.0, -4.0]),
                    np.float32([2.0, 2.0, 1.0, 2.0]), np.float32([0.5, 0.0, -np.inf, 0.0]))
    np.testing.assert_array_equal(logits, [[1.5, -4.0, 1.0, 0.0], [-2.0, 3.0, 3.0, -np.inf]])  # (3 - 4) * 2
    masks = np.array([[0b1010]], np.int32)  # tokens 1 and 3 allowed
    np.testing.assert_array_equal(ops.mask_logits(logits, np.int32([1]), masks)[1], [-np.inf, 3.0, -np.inf, -np.inf])
    logits = np.zeros((1, 40), np.float32)
    ops.mask_logits(logits, np.int32([0]), np.array([[-2**31, 1]], np.int32))  # bit 31 of word 0, bit 0 of word 1
    assert np.flatnonzero(logits[0] == 0).tolist() == [31, 32]


class BanAndAllow(LogitsProcessor):
    """A stand-in processor: bans one token and allows only the first `allowed` tokens."""
    def __init__(self, ban, allowed):
        self.ban, self.allowed = ban, allowed

    def edits(self, seq, ahead):
        seq.processor_state = (seq.processor_state or 0) + 1  # its own per-sequence state
        return np.int32([self.ban]), np.float32([0.0]), np.float32([1.0]), np.float32([-np.inf])

    def mask(self, seq, ahead):
        return np.packbits(np.arange(64) < self.allowed, bitorder="little").view(np.int32)


def test_a_processor_changes_its_own_rows_only_and_logits_are_kept_raw():
    logits = np.zeros((3, 64), np.float32)
    logits[:, 10] = 5.0  # every row's argmax ...
    logits[:, 12] = 4.0  # ... and runner-up
    params = [SamplingParams(temperature=0, return_logits=True),
              SamplingParams(temperature=0, return_logits=True, logits_processor=BanAndAllow(10, 64)),
              SamplingParams(temperature=0, logits_processor=BanAndAllow(0, 12))]
    seqs = [Sequence(i, "", [1, 2], p, 0.0, seed=i) for i, p in enumerate(params)]
    samples = [Sample(seq, [i], [], 0) for i, seq in enumerate(seqs)]
    tokens, kept = Sampler(Device("cpu"), ops.REFERENCE).sample(logits.copy(), samples)
    tokens = [t for (t,) in tokens]
    kept = {i: rows[0] for i, rows in enumerate(kept) if rows}
    assert tokens == [10, 12, 10]  # row 1: 10 banned; row 2: 12 masked out, 10 kept
    np.testing.assert_array_equal(kept[1], logits[1])  # raw, as return_logits and logprobs report them
    assert [s.processor_state for s in seqs] == [None, 1, 1]
