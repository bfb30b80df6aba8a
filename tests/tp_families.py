"""Run under `mpirun -n 2` by test_families.py: each CASE=FOLDER argument's reference prompts
(tests/data/families/CASE.json) generated with --tp 2. Rank 0 writes what it got to OUT, the
first argument, as JSON: per case, per prompt, the prompt logprobs, the greedy tokens and the
logits behind them; the test holds them to transformers' numbers."""
import json
import sys
from pathlib import Path

from nano import parallel
from nano.config import EngineConfig
from nano.engine import LLMEngine
from nano.sequence import SamplingParams
from nano.fleet.worker import Worker

DATA = Path(__file__).resolve().parent / "data" / "families"
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, return_logits=True, prompt_logprobs=0)

out, results = sys.argv[1], {}
for case, folder in (arg.split("=", 1) for arg in sys.argv[2:]):
    config = EngineConfig(model=folder, device="cpu", tp=2)
    if parallel.tp_group().rank > 0:
        Worker(config).run()
        continue
    engine = LLMEngine(config)
    prompts = [p["prompt_ids"] for p in json.loads((DATA / f"{case}.json").read_text())["prompts"]]
    seqs = engine.generate(prompts, PARAMS)
    engine.stop_workers()
    results[case] = [{"prompt_logprobs": [None] + [s[0] for s in seq.prompt_logprobs[1:]],
                      "token_ids": seq.output_token_ids, "logits": [row.tolist() for row in seq.logits]}
                     for seq in seqs]
if parallel.tp_group().rank == 0:
    Path(out).write_text(json.dumps(results))
