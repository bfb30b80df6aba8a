"""Throughput through the HTTP server against LLM.generate on the same prompts.

    python tests/bench_server.py [--num 200] [--max-tokens 32] [--concurrency 200]

The same default-model engine settings both ways, greedy, EOS ignored: first the prompts
through `LLM.generate` (one call, the engine batching them as it likes), then through the
server on a loopback port from `--concurrency` concurrent `openai` clients. Prints both
figures and their ratio; docs/results.md's figure comes from here.
"""
import argparse
import asyncio
import gc
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import openai  # noqa: E402
from test_server import Running  # noqa: E402

from nano.llm import LLM  # noqa: E402
from nano.sequence import SamplingParams  # noqa: E402

KV = 300 * 10**6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=200)
    args = p.parse_args()
    prompts = [f"Request {i}: name a fruit that is" for i in range(args.num)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    llm = LLM(kv_cache_memory=KV)
    llm.generate(prompts[:4], params)  # warm up
    start = time.perf_counter()
    direct = llm.generate(prompts, params)
    direct_wall = time.perf_counter() - start
    del llm
    gc.collect()

    server = Running(kv_cache_memory=KV)

    async def through_server():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        gate = asyncio.Semaphore(args.concurrency)

        async def one(prompt):
            async with gate:
                return await client.completions.create(model=server.model, prompt=prompt, temperature=0,
                                                       max_tokens=args.max_tokens, extra_body={"ignore_eos": True})
        await asyncio.gather(*(one(p) for p in prompts[:4]))  # warm up
        start = time.perf_counter()
        outs = await asyncio.gather(*(one(p) for p in prompts))
        return outs, time.perf_counter() - start
    outs, served_wall = asyncio.run(through_server())
    server.stop()
    assert [o.choices[0].text for o in outs] == [d.text for d in direct], "server and LLM.generate disagree"
    tokens = args.num * args.max_tokens
    print(f"{args.num} prompts x {args.max_tokens} tokens, {args.concurrency} concurrent clients")
    print(f"LLM.generate  {direct_wall:6.1f} s  {tokens / direct_wall:7.1f} output tok/s")
    print(f"server        {served_wall:6.1f} s  {tokens / served_wall:7.1f} output tok/s  "
          f"({100 * direct_wall / served_wall:.0f}% of LLM.generate)")


if __name__ == "__main__":
    main()
