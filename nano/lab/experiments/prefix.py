"""prefix: automatic prefix caching. A full block of computed tokens is registered under a hash
chained over its prefix; a later prompt that starts with the same full blocks shares them
instead of computing them again, and a freed block stays cached until the pool needs it for
something else, least recently freed first (nano/block_manager.py: match_prefix,
register_full_blocks, _take_free). With a pool smaller than the working set of prefixes,
blocks are evicted before they are hit again, and the saving falls with the number of
distinct prefixes."""
import numpy as np

from nano.config import EngineConfig
from nano.lab.experiment import Experiment, Size, engine, serve
from nano.sequence import SamplingParams
from nano.telemetry.metrics import metrics_of, ttft_of

BLOCK = EngineConfig().block_size
SUFFIX, OUTPUT = 32, 4


def scale(size: Size) -> dict:
    if size.quick:
        return dict(prefixes=(64, 256), requests=12, distinct=(1, 3, 6))
    return dict(prefixes=(192,), requests=8, distinct=(1, 2, 4))


def measure(size: Size, prefix: int, distinct: int, caching: bool) -> dict:
    requests = scale(size)["requests"]
    resident = 3 * -(-(prefix + SUFFIX + OUTPUT) // BLOCK)  # blocks for three requests at once
    eng = engine(size, num_blocks=resident, enable_prefix_caching=caching, watermark=0.0)
    vocab = eng.model_config.vocab_size
    rng = np.random.default_rng(size.seed)
    prefixes = [rng.integers(3, vocab, prefix).tolist() for _ in range(distinct)]
    which = rng.integers(0, distinct, requests)
    seqs = serve(eng, [(prefixes[k] + rng.integers(3, vocab, SUFFIX).tolist(),
                        SamplingParams(temperature=0, ignore_eos=True, max_tokens=OUTPUT)) for k in which])
    computed = sum(s.num_prompt_tokens - s.num_cached_tokens for s in seqs)
    # prefix blocks an earlier request had computed, that this one computed again (evicted, or
    # still being computed when it was admitted)
    shareable = prefix // BLOCK
    missed = sum(shareable - min(s.num_cached_tokens // BLOCK, shareable)
                 for i, s in enumerate(seqs) if which[i] in which[:i])
    m = metrics_of(eng)
    return {"prefix": prefix, "distinct": distinct, "requests": requests, "caching": "on" if caching else "off",
            "pool_blocks": resident, "working_set_blocks": distinct * shareable,
            "prefill_tokens": computed, "prompt_tokens": sum(s.num_prompt_tokens for s in seqs),
            "hit_rate": round(m.prefix_hits / m.prefix_queried, 3) if m.prefix_queried else 0.0,
            "missed_prefix_blocks": missed,
            "ttft_mean_ms": round(1e3 * float(np.mean([ttft_of(s) for s in seqs])), 1)}


def run(size: Size) -> list[dict]:
    rows = []
    s = scale(size)
    for prefix in s["prefixes"]:
        rows.append(measure(size, prefix, max(s["distinct"]), False))
        rows += [measure(size, prefix, k, True) for k in s["distinct"]]
    for r in rows:
        r["saved_pct"] = round(100 * (1 - r["prefill_tokens"] / r["prompt_tokens"]), 1)
    return rows


def plot(rows: list[dict], fig) -> None:
    a, b, c = fig.subplots(1, 3)
    for i, prefix in enumerate(sorted({r["prefix"] for r in rows})):
        on = [r for r in rows if r["prefix"] == prefix and r["caching"] == "on"]
        off = next(r for r in rows if r["prefix"] == prefix and r["caching"] == "off")
        k = [r["distinct"] for r in on]
        a.plot(k, [r["prefill_tokens"] for r in on], "o-", color=f"C{i}", label=f"{prefix}-token prefix, cached")
        a.axhline(off["prefill_tokens"], color=f"C{i}", ls=":", label=f"{prefix}-token prefix, no caching")
        b.plot(k, [r["ttft_mean_ms"] for r in on], "o-", color=f"C{i}", label=f"{prefix}-token prefix, cached")
        b.axhline(off["ttft_mean_ms"], color=f"C{i}", ls=":", label=f"{prefix}-token prefix, no caching")
        c.plot(k, [100 * r["hit_rate"] for r in on], "o-", color=f"C{i}", label=f"{prefix}: hit rate %")
        c.plot(k, [r["missed_prefix_blocks"] for r in on], "s--", color=f"C{i}",
               label=f"{prefix}: prefix blocks computed again")
    titles = ("prefill tokens computed (pool: 3 requests' blocks)", "TTFT mean (ms)",
              "hit rate (%); prefix blocks computed again")
    for ax, title in zip((a, b, c), titles):
        ax.set_xticks(k)
        ax.set_xlabel(f"distinct prefixes among {rows[0]['requests']} requests")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    c.set_ylim(0, 1.5 * c.get_ylim()[1])  # room for the legend above the lines


def check(rows: list[dict]) -> str | None:
    for prefix in {r["prefix"] for r in rows}:
        off = next(r for r in rows if r["prefix"] == prefix and r["caching"] == "off")
        for r in (r for r in rows if r["prefix"] == prefix and r["caching"] == "on" and r["distinct"] < r["requests"]):
            if not r["prefill_tokens"] < off["prefill_tokens"]:
                return (f"{prefix}-token prefix, {r['distinct']} distinct: {r['prefill_tokens']} prefill "
                        f"tokens with caching, not fewer than {off['prefill_tokens']} without")
    return None


EXPERIMENT = Experiment(
    name="prefix",
    claim="Prefix caching computes fewer prefill tokens and cuts TTFT when prompts share prefixes; "
          "with a pool smaller than the prefixes' working set, evictions eat the saving as the "
          "distinct prefixes grow.",
    varies="shared-prefix length (64, 256 quick; 192 full); distinct prefixes (1, 3, 6 quick; 1, 2, 4 "
           "full) among the requests; prefix caching on / off",
    fixed=f"12 (quick) or 8 requests: a prefix drawn at random + a {SUFFIX}-token unique suffix, {OUTPUT} "
          "greedy output tokens; a pool of three requests' blocks, watermark 0, all arriving at once",
    measures="prefill tokens computed (and saved), hit rate, prefix blocks computed again though "
             "computed before (evicted, or in flight), TTFT mean",
    run=run, plot=plot, check=check)
