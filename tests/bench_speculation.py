"""Speculative decoding (n-gram prompt lookup) on and off, side by side, on the CPU.

    python tests/bench_speculation.py [--k 7] [--lookup-max 4] [--lookup-min 2]
                                      [--max-tokens 128] [--batch 32] [--out FILE.json]

The default model, greedy, one engine (warmed up, its KV pool touched; prefix caching off, so
the second run of a prompt computes it afresh too) with speculation attached and detached
between runs. Three parts:
  copy prompts (tests/data/copy_prompts.jsonl): one sequence at a time (B=1), each prompt
      without then with speculation: output tok/s of each run (its prefill included), the
      acceptance rate (accepted / draft tokens) and mean accepted length (1 + accepted / drafts:
      tokens a verify step yields per sequence), from nano/telemetry's Metrics;
  random-token prompts (tests/data/random_prompts.jsonl): the same at B=1, nothing to find;
  --batch sequences at once (the copy prompts, cycled) without vs with.
Every pair of runs must give the same tokens (greedy): the bench fails otherwise. Where
tests/data/copy_prompts_hf.json exists (transformers' plain and prompt-lookup generate,
measured by tests/bench_speculation_hf.py), a column puts nano-with-speculation beside it.
Prints markdown tables; --out writes everything as JSON."""
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import nano  # noqa: E402, F401  (first: nano's BLAS settings, before anything loads NumPy)
from nano.cli.offline import warm_up  # noqa: E402
from nano.config import EngineConfig  # noqa: E402
from nano.engine import LLMEngine  # noqa: E402
from nano.sequence import SamplingParams  # noqa: E402
from nano.speculative import attach  # noqa: E402
from nano.telemetry.metrics import Metrics, reset_metrics  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"


def load_prompts(name: str) -> list[dict]:
    """tests/data/<name>: one JSON object per line ({"name", "kind", "prompt"} or "prompt_ids")."""
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


def hf_figures() -> dict | None:
    """{name: (plain tok/s, prompt-lookup tok/s, plain output ids)} from tests/bench_speculation_hf.py's JSON."""
    path = DATA / "copy_prompts_hf.json"
    if not path.exists():
        return None
    return {r["name"]: (r["plain"]["tok_s"], r["lookup"]["tok_s"], r["plain"].get("ids"))
            for r in json.loads(path.read_text())["prompts"]}


def run(engine, prompts: list, params: SamplingParams, spec: dict | None):
    """One generate call (all prompts at once) with speculation on (spec) or off: tokens, seconds, counts."""
    attach(engine, spec)
    metrics = reset_metrics(engine)  # nano/telemetry's counts of this call's drafts
    start = time.perf_counter()
    seqs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    attach(engine, None)
    return ([s.output_token_ids for s in seqs], seconds,
            dict(drafts=metrics.spec_draft_tokens, accepted=metrics.spec_accepted, verify_rows=metrics.spec_drafts))


def pair(engine, name: str, prompts: list, params, spec) -> dict:
    """The same prompts without, then with speculation; fails loudly if the tokens differ."""
    off_tokens, off_s, _ = run(engine, prompts, params, None)
    on_tokens, on_s, counts = run(engine, prompts, params, spec)
    for i, (a, b) in enumerate(zip(off_tokens, on_tokens)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise SystemExit(f"FAIL {name} (sequence {i}): speculation changed the greedy output at token {at} "
                             f"({a[at:at + 5]} without, {b[at:at + 5]} with)")
    tokens = sum(len(t) for t in off_tokens)
    drafts, accepted = counts["drafts"], counts["accepted"]
    return {"name": name, "output": off_tokens, "tokens": tokens, "off_s": off_s, "on_s": on_s,
            "off_tok_s": tokens / off_s, "on_tok_s": tokens / on_s, "speedup": off_s / on_s,
            "drafts": drafts, "accepted": accepted, "verify_rows": counts["verify_rows"],
            "acceptance": accepted / drafts if drafts else 0.0,
            "mean_accepted_len": 1 + accepted / counts["verify_rows"] if counts["verify_rows"] else 1.0}


def total(rows: list[dict], name="total") -> dict:
    tokens, off_s, on_s = (sum(r[k] for r in rows) for k in ("tokens", "off_s", "on_s"))
    drafts, accepted, verify = (sum(r[k] for r in rows) for k in ("drafts", "accepted", "verify_rows"))
    return {"name": name, "tokens": tokens, "off_s": off_s, "on_s": on_s, "off_tok_s": tokens / off_s,
            "on_tok_s": tokens / on_s, "speedup": off_s / on_s, "drafts": drafts, "accepted": accepted,
            "verify_rows": verify, "acceptance": accepted / drafts if drafts else 0.0,
            "mean_accepted_len": 1 + accepted / verify if verify else 1.0}


def table(rows: list[dict], hf: dict | None = None) -> str:
    head = ["prompt", "kind", "tokens", "off tok/s", "spec tok/s", "speed-up", "acceptance", "mean accepted len"]
    if hf is not None:
        head += ["HF lookup tok/s", "spec / HF lookup"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        bold = "**" if r["name"] == "total" else ""
        cells = [f"{bold}{r['name']}{bold}", r.get("kind", ""), str(r["tokens"]), f"{r['off_tok_s']:.1f}",
                 f"{r['on_tok_s']:.1f}", f"{bold}{r['speedup']:.2f}x{bold}",
                 f"{100 * r['acceptance']:.0f}% ({r['accepted']}/{r['drafts']})",
                 f"{r['mean_accepted_len']:.2f}"]
        if hf is not None:
            h = r.get("hf_lookup_tok_s")
            cells += ["" if h is None else f"{h:.1f}", "" if h is None else f"{bold}{r['on_tok_s'] / h:.2f}x{bold}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=7, help="num_speculative_tokens (k + 1 = 8 rows: the cheapest "
                    "checking step with OpenBLAS's Zen kernels on 2 threads; docs/perf_notes.md)")
    ap.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    ap.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32, help="sequences at once in the batched part (0: skip)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N copy and random prompts (0: all)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min}

    engine = LLMEngine(EngineConfig(model=args.model, device="cpu", seed=0, enable_prefix_caching=False))
    Metrics.attach(engine)
    warm_up(engine)
    attach(engine, spec)  # the speculative step's shapes warmed up too
    engine.generate([list(range(3, 19)) * 2], SamplingParams(max_tokens=8, ignore_eos=True))
    attach(engine, None)

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    copies = load_prompts("copy_prompts.jsonl")
    randoms = load_prompts("random_prompts.jsonl")
    if args.limit:
        copies, randoms = copies[:args.limit], randoms[:args.limit]
    hf = hf_figures()
    print(f"speculation {json.dumps(spec)}, greedy, max_tokens {args.max_tokens}, "
          f"{len(copies)} copy prompts, {len(randoms)} random-token prompts", flush=True)

    copy_rows = []
    for p in copies:
        row = {**pair(engine, p["name"], [p["prompt"]], params, spec), "kind": p.get("kind", "")}
        if hf and p["name"] in hf:
            row["hf_plain_tok_s"], row["hf_lookup_tok_s"], ids = hf[p["name"]]
            row["same_as_hf"] = ids == row.pop("output")[0] if ids is not None else None
        row.pop("output", None)
        copy_rows.append(row)
        print(f"  {p['name']}: {row['off_tok_s']:.1f} -> {row['on_tok_s']:.1f} tok/s, "
              f"acceptance {100 * row['acceptance']:.0f}%", flush=True)
    copy_total = total(copy_rows)
    if hf and all("hf_lookup_tok_s" in r for r in copy_rows):
        hf_s = sum(r["tokens"] / r["hf_lookup_tok_s"] for r in copy_rows)  # the same tokens at HF's rate
        copy_total["hf_lookup_tok_s"] = copy_total["tokens"] / hf_s
    random_rows = [{k: v for k, v in pair(engine, p["name"], [p["prompt_ids"]], params, spec).items() if k != "output"}
                   for p in randoms]
    random_total = total(random_rows) if random_rows else None
    batch_row = None
    if args.batch:
        prompts = [copies[i % len(copies)]["prompt"] for i in range(args.batch)]
        batch_row = pair(engine, f"{args.batch} copy prompts at once", prompts, params, spec)
        batch_row.pop("output")

    print(f"\n### Copy prompts, B=1\n\n{table(copy_rows + [copy_total], hf if hf else None)}")
    if hf:
        print("\nHF lookup tok/s: transformers' generate(prompt_lookup_num_tokens=...), measured by "
              "tests/bench_speculation_hf.py (tests/data/copy_prompts_hf.json); its total is the same "
              "tokens at each prompt's rate.")
        same = [r["same_as_hf"] for r in copy_rows if r.get("same_as_hf") is not None]
        print(f"nano's greedy output equals transformers' on {sum(same)} of {len(same)} prompts.")
    kinds = {}
    for r in copy_rows:
        kinds.setdefault(r["kind"], []).append(r)
    by_kind = [{**total(rows, kind), "kind": f"{len(rows)} prompts"} for kind, rows in kinds.items()]
    print(f"\n### Copy prompts by kind, B=1\n\n{table(by_kind)}")
    if random_rows:
        print(f"\n### Random-token prompts, B=1\n\n{table(random_rows + [random_total])}")
    if batch_row:
        print(f"\n### {args.batch} sequences at once\n\n{table([batch_row])}")
    if args.out:
        Path(args.out).write_text(json.dumps({"spec": spec, "max_tokens": args.max_tokens, "copy": copy_rows,
                                              "copy_total": copy_total,
                                              "copy_by_kind": by_kind, "random": random_rows,
                                              "random_total": random_total, "batch": batch_row,
                                              "date": time.strftime("%Y-%m-%d %H:%M %Z")}, indent=1) + "\n")


if __name__ == "__main__":
    main()
