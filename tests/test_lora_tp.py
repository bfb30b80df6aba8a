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


@needs_mpi
def test_serving_under_tp2_routes_each_model_as_one_rank(tiny_model, adapters):  # noqa: F811
    """run.py --serve --tp 2 --enable-lora under mpirun: each adapter's and the base model's tokens
    are one rank's; loading an adapter at runtime is a 400 naming why, unloading one works."""
    import os
    import subprocess
    import sys
    import openai
    from test_server import free_port, httpx, wait_healthy
    from test_tp import ROOT, TIMEOUT, ended_by_ctrl_c, mpirun
    from nano.lora import LLM, LoRARequest
    from nano.sequence import SamplingParams
    from nano.server.engine_thread import token_view
    prompt, params = [5, 17, 33, 9, 80, 81], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(tiny_model), enable_lora=True, max_loras=2, max_lora_rank=4, device="cpu", num_blocks=256)
    one = {name: [token_view(llm.engine.tokenizer, t)[0] for t in llm.generate(
        [prompt], params, lora_request=name and LoRARequest(name, i, str(adapters[name])))[0].token_ids]
        for i, name in enumerate([None, "a", "b"])}
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
    job = subprocess.Popen([mpirun(), "-n", "2", "--allow-run-as-root", "--oversubscribe", sys.executable, "run.py",
                            "--serve", "--tp", "2", "--port", str(port), "--model", str(tiny_model), "--device", "cpu",
                            "--num-blocks", "256", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "4",
                            "--lora-modules", f"a={adapters['a']}", f"b={adapters['b']}"],
                           cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with ended_by_ctrl_c(job):
        url = wait_healthy(job, port, TIMEOUT)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        for name, want in one.items():
            out = client.completions.create(model=name or tiny_model.name, prompt=prompt, max_tokens=8, temperature=0,
                                            logprobs=0, extra_body={"ignore_eos": True})
            assert out.choices[0].logprobs.tokens == want, name
        loaded = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["a"])})
        assert loaded.status_code == 400 and "not supported under --tp" in loaded.json()["error"]["message"]
        assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
        assert [m.id for m in client.models.list().data] == [tiny_model.name, "b"]
