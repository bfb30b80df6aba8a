"""LoRA adapters under tensor parallelism: run.py with --enable-lora under mpirun -n 2 --tp 2
(each rank holds its share of every adapter, nano/lora/pool.py) gives one rank's greedy
tokens for requests of two adapters and of the base model in one batch, with and without
n-gram speculation."""
import json

import pytest
from test_lora_cli import adapters  # noqa: F401  (the fixture)
from test_tp import launch, needs_mpi

LINES = [{"prompt": "hello there", "lora": "a"}, {"prompt": "hello there"},
         {"prompt": "the sea the sea the sea", "lora": "b"}, {"prompt": "one two three one two", "lora": "a"}]


@needs_mpi
def test_two_ranks_give_one_ranks_tokens(tmp_path, tiny_model, adapters):  # noqa: F811
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    flags = ["--model", str(tiny_model), "--no-chat", "--num-blocks", "256", "--temperature", "0",
             "--max-tokens", "12", "--ignore-eos", "--enable-lora", "--max-loras", "2",
             "--max-lora-rank", "4", "--lora-modules", f"a={adapters['a']}", f"b={adapters['b']}"]
    speculate = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']

    def tokens(ranks, *more):
        out = tmp_path / f"out-{ranks}-{len(more)}.jsonl"
        tp = ["--tp", str(ranks)] if ranks else []
        done = launch(["run.py", "--prompt-file", str(prompts), "--output", str(out), *flags, *tp,
                       *more], ranks)
        assert done.returncode == 0, done.stderr[-3000:]
        return [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]

    one = tokens(None)
    assert one[0] != one[1]  # the adapter changes the answer
    assert tokens(2) == one
    assert tokens(2, *speculate) == one
