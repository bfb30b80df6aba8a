"""The OpenAI-compatible server (nano/server/): the real server on a loopback port, the
real `openai` client (and plain HTTP for what a client library hides), the default model."""
import asyncio
import json
import re
import socket
import threading
import time

import numpy as np
import pytest

fastapi = pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
try:
    import httpx
except ImportError:  # openai's client from version 3 uses its fork, httpx2
    httpx = pytest.importorskip("httpx2")
uvicorn = pytest.importorskip("uvicorn")

from nano.config import EngineConfig  # noqa: E402
from nano.engine import LLMEngine  # noqa: E402
from nano.llm import LLM  # noqa: E402
from nano.sequence import SamplingParams  # noqa: E402
from nano.server.app import create_app  # noqa: E402

PROMPT = "The three primary colors are"


def wait_healthy(job, port: int, timeout: float) -> str:
    """The URL of a server started as subprocess `job`, once its /health answers 200."""
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    while True:
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return url
        except httpx.HTTPError:
            time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """A server on a loopback port in this process (its engine reachable for checks)."""

    def __init__(self, max_queued: int = 256, app: dict | None = None, sndbuf: int | None = None, prepare=None,
                 **engine_args):
        """app: create_app's keyword arguments (limits, api_key, hosts); sndbuf: the kernel's send
        buffer for each connection (its own default grows to megabytes); prepare(engine): more of
        create_app's keyword arguments, made from the engine (a LoRA pool's adapters)."""
        self.engine = LLMEngine(EngineConfig(**{"kv_cache_memory": 300 * 10**6, **engine_args}))
        app = {**(app or {}), **(prepare(self.engine) if prepare else {})}
        # IPPROTO_TCP named: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say so,
        # else each small response waits for a delayed ACK (40 ms).
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        if sndbuf:  # accepted connections inherit it
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        listener.bind(("127.0.0.1", 0))
        self.port = listener.getsockname()[1]
        self.app = create_app(self.engine, max_queued, **app)
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [listener]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = self.engine.shard.model_dir.name
        self.key = app.get("api_key") or "none"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=self.key, max_retries=0, timeout=120)

    def idle(self, timeout: float = 10) -> bool:
        """Wait until the engine holds no request and no block."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s, bm = self.engine.scheduler, self.engine.block_manager
            if not (s.running or s.waiting or s.swapped) and bm.num_free_blocks == bm.num_blocks:
                return True
            time.sleep(0.02)
        return False

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        forget_endpoints()


def forget_endpoints():
    """Empty FastAPI's caches of the endpoints it has inspected (functools.lru_cache, 4,096
    entries): each endpoint's closure holds its app's engine, so a stopped server's engine, its
    weights and KV pool stay in memory as long as it is cached, over a gigabyte per few servers."""
    from fastapi.dependencies import models
    for cache in vars(models).values():
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()


@pytest.fixture(scope="module")
def srv():
    running = Running()
    yield running
    running.stop()




# ---- what clients see ----------------------------------------------------------------------------------
def test_models_health_and_greedy_completion_match_the_engine(srv):
    assert [m.id for m in srv.client.models.list().data] == [srv.model]
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    out = srv.client.completions.create(model=srv.model, prompt=PROMPT, max_tokens=12, temperature=0)
    expected = LLM().generate([PROMPT], SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.prompt_tokens == expected.num_prompt_tokens
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_served_model_names_are_listed_taken_and_the_first_answered():
    """--served-model-name (vLLM's): a card per name, a request may name any, every response
    (completions, chat, Responses API) carries the first; the folder's name is then not one."""
    running = Running(app={"served_names": ["nano-chat", "gpt-4o-mini"]})
    try:
        client = running.client
        assert [m.id for m in client.models.list().data] == ["nano-chat", "gpt-4o-mini"]
        assert client.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
        assert client.completions.create(model="gpt-4o-mini", prompt=PROMPT, max_tokens=1).model == "nano-chat"
        chat = client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=1)
        assert chat.model == "nano-chat"
        assert client.responses.create(model="gpt-4o-mini", input="Hi", max_output_tokens=1).model == "nano-chat"
        with pytest.raises(openai.NotFoundError, match="this server has 'nano-chat', 'gpt-4o-mini'"):
            client.completions.create(model=running.model, prompt=PROMPT, max_tokens=1)
        assert scrape(running.url, "nano-chat")[1][("vllm:request_success_total", (("finished_reason", "length"),))]
    finally:
        running.stop()


def test_model_cards_carry_vllms_fields(srv):
    """vLLM's ModelCard: the context length, root (the folder the weights came from), parent
    (none: a base model) and one ModelPermission."""
    card = httpx.get(srv.url + "/v1/models").json()["data"][0]
    assert card["max_model_len"] == srv.engine.max_model_len == 8192
    assert card["root"] == str(srv.engine.shard.model_dir) and card["parent"] is None
    assert card["owned_by"] == "nano" and card["object"] == "model"
    permission = card["permission"][0]
    assert permission["id"].startswith("modelperm-") and permission["object"] == "model_permission"
    assert {k: permission[k] for k in ("allow_sampling", "allow_logprobs", "allow_fine_tuning", "organization")} == \
        {"allow_sampling": True, "allow_logprobs": True, "allow_fine_tuning": False, "organization": "*"}
    assert httpx.get(srv.url + f"/v1/models/{srv.model}").json() == card


def test_generation_config_defaults_fill_what_a_request_leaves_out(caplog):
    """--generation-config's defaults (vLLM's): a request's own field wins; null is left out;
    logged once at startup."""
    import logging
    caplog.set_level(logging.INFO, "nano.server")
    running = Running(app={"generation_defaults": {"temperature": 0.0, "max_tokens": 3}})
    try:
        assert "generation config" in caplog.text and "'max_tokens': 3" in caplog.text
        chat = {"model": running.model, "messages": [{"role": "user", "content": "Tell me a long story."}]}
        by_default = httpx.post(running.url + "/v1/chat/completions", json={**chat, "temperature": None}).json()
        greedy = httpx.post(running.url + "/v1/chat/completions", json={**chat, "temperature": 0}).json()
        assert by_default["usage"]["completion_tokens"] == 3 and by_default["choices"][0]["finish_reason"] == "length"
        assert by_default["choices"][0]["message"] == greedy["choices"][0]["message"]
        assert httpx.post(running.url + "/v1/chat/completions",
                          json={**chat, "max_tokens": 5}).json()["usage"]["completion_tokens"] == 5
        response = running.client.responses.create(model=running.model, input="Tell me a long story.")
        assert response.usage.output_tokens == 3
    finally:
        running.stop()


def test_generation_config_reads_the_keys_vllm_takes(tmp_path):
    from nano.errors import NanoError
    from nano.server.generation_config import read
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "temperature": 0.6, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.0, "max_new_tokens": 64,
        "do_sample": True, "eos_token_id": [1, 2]}))
    expected = {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64}  # top_k 50, penalty 1.0: transformers' defaults
    assert read(str(tmp_path), None) == read("auto", tmp_path) == expected
    assert read("vllm", tmp_path) == {} and read("auto", tmp_path / "none") == {}
    for text, error in (("{", "is not JSON"), ("[]", "holds list, not a JSON object"),
                        ('{"top_p": 2}', "generation_config.json: top_p must be a number in (0, 1], got 2")):
        (tmp_path / "generation_config.json").write_text(text)
        with pytest.raises(NanoError, match=re.escape(error)):
            read(str(tmp_path), None)


def test_chat_uses_the_template(srv):
    out = srv.client.chat.completions.create(model=srv.model, 
        messages=[{"role": "system", "content": "Answer in one sentence."},
                                         {"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=20)
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].message.role == "assistant" and out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("chat", [False, True])
def test_stream_equals_the_whole_text_and_ends_with_usage(srv, chat):
    args = dict(model=srv.model, max_tokens=24, temperature=0.9, seed=11)
    if chat:
        create, args["messages"] = srv.client.chat.completions.create, [{"role": "user", "content": "Tell me a joke."}]
    else:
        create, args["prompt"] = srv.client.completions.create, PROMPT
    whole = create(**args)
    chunks = list(create(**args, stream=True, stream_options={"include_usage": True}))
    with_usage = [c for c in chunks if c.usage is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1].choices == []
    if chat:
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
    else:
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_stream_text_is_whole_characters(srv):
    """Deltas are valid UTF-8 text: a character split over tokens arrives whole."""
    prompt = "Emoji list: 🍎 🍌 🍇 🍓 "  # continued in emoji, most split over two or more tokens
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": 40, "temperature": 1.0, "seed": 3, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    deltas = [json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]]
    assert not any("\ufffd" in d for d in deltas)
    whole = srv.client.completions.create(model=srv.model, prompt=prompt, max_tokens=40, temperature=1.0, seed=3)
    assert "".join(deltas) == whole.choices[0].text
    assert any(ord(ch) > 127 for ch in whole.choices[0].text)  # the case this test is for did occur


def test_n_choices_each_seeded(srv):
    args = dict(model=srv.model, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=5, n=3,
                extra_body={"ignore_eos": True})
    out = srv.client.completions.create(**args)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in srv.client.completions.create(**args).choices] == [c.text for c in out.choices]
    assert len({c.text for c in out.choices}) > 1
    assert out.usage.completion_tokens == 30  # over all choices; the prompt counted once
    chunks = list(srv.client.completions.create(**args, stream=True))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)]
    assert texts == [c.text for c in out.choices]


def test_stop_strings_end_the_text_before_them_even_mid_token(srv):
    whole = srv.client.completions.create(model=srv.model, prompt=PROMPT, max_tokens=30, temperature=0).choices[0].text
    # a stop string starting inside a word: mid-token, and likely spanning two tokens
    at = len(whole) // 2
    stop = whole[at:at + 4]
    assert stop.strip(), whole
    out = srv.client.completions.create(model=srv.model, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop, "zzzz"])
    assert out.choices[0].text == whole[:whole.index(stop)] and out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in srv.client.completions.create(model=srv.model, 
        prompt=PROMPT, max_tokens=30, temperature=0, stop=stop, stream=True))
    assert streamed == out.choices[0].text
    assert srv.idle()


def test_stop_reason_says_what_ended_a_choice_as_vllm(srv):
    """vLLM's stop_reason: the stop string that matched, the stop_token_ids id that ended it, or
    null (EOS, length), on each choice and on the stream's chunk that carries finish_reason."""
    whole = srv.client.completions.create(model=srv.model, prompt=PROMPT, max_tokens=30, temperature=0).choices[0].text
    stop = whole[len(whole) // 2:len(whole) // 2 + 4]
    body = {"model": srv.model, "prompt": PROMPT, "max_tokens": 30, "temperature": 0}
    choice = httpx.post(srv.url + "/v1/completions", json={**body, "stop": ["zzzz", stop]}).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    chunks = list(srv.client.completions.create(**body, stop=stop, stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].stop_reason == stop
    ids = httpx.post(srv.url + "/tokenize", json={"prompt": whole}).json()["tokens"]
    choice = httpx.post(srv.url + "/v1/completions", json={**body, "stop_token_ids": ids}).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] in ids
    length = httpx.post(srv.url + "/v1/completions", json={**body, "max_tokens": 2}).json()["choices"][0]
    assert (length["finish_reason"], length["stop_reason"]) == ("length", None)
    chat = {"model": srv.model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 40, "temperature": 0}
    eos = httpx.post(srv.url + "/v1/chat/completions", json=chat).json()["choices"][0]
    assert (eos["finish_reason"], eos["stop_reason"]) == ("stop", None)
    chunks = list(srv.client.chat.completions.create(**chat, stop=["!"], stream=True))
    assert [c.choices[0].stop_reason for c in chunks if c.choices[0].finish_reason] == ["!"]


def test_logprobs(srv):
    out = srv.client.completions.create(model=srv.model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == out.usage.completion_tokens
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the chosen token is the top one
    assert "".join(lp.tokens) == out.choices[0].text
    chat = srv.client.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                              temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


# ---- bad requests: OpenAI-style errors, and the server stays up ----------------------------------------
@pytest.mark.parametrize("body,status,text", [
    ({"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "stop": 5}, 400, "stop"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [1, 2, 99999999]}, 400, "token ids"),
    ({"prompt": "word " * 9000}, 400, "maximum context length"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "does not exist"),
    ({}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors(srv, body, status, text):
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert text in error["message"] and error["type"]
    assert httpx.get(srv.url + "/health").status_code == 200


def test_unknown_fields_are_refused_and_the_client_raises_on_errors(srv):
    out = srv.client.completions.create(model=srv.model, prompt="hi", max_tokens=2, extra_body={"user": "u"})
    assert out.choices[0].text is not None
    with pytest.raises(openai.BadRequestError, match="frequency_penalty_x: an unknown field"):
        srv.client.completions.create(model=srv.model, prompt="hi", max_tokens=2, extra_body={"frequency_penalty_x": 1})
    with pytest.raises(openai.BadRequestError):
        srv.client.completions.create(model=srv.model, prompt="hi", max_tokens=-3)
    r = httpx.post(srv.url + "/v1/chat/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def scrape(url: str, model: str, timeout: float = 10) -> tuple[dict, dict]:
    """GET /metrics, parsed by Prometheus's own parser (test_metrics.parse)."""
    from test_metrics import parse
    r = httpx.get(url + "/metrics", timeout=timeout)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return parse(r.text, model)


def test_metrics_use_vllms_names_and_count_what_clients_were_told(srv):
    """What a dashboard or autoscaler built for vLLM reads: the counters move by the usage the
    responses reported, each request is one observation of each per-request histogram."""
    from test_metrics import NANO, PER_REQUEST, VLLM
    assert srv.idle()
    _, before = scrape(srv.url, srv.model)
    outs = [srv.client.completions.create(model=srv.model, prompt=f"{PROMPT} {i}", max_tokens=n, temperature=0)
            for i, n in enumerate((3, 6, 1))]
    outs.append(srv.client.chat.completions.create(model=srv.model, max_tokens=40, temperature=0,
                                                   messages=[{"role": "user", "content": "Say hi."}]))
    assert srv.idle()
    types, after = scrape(srv.url, srv.model)
    assert {**VLLM, **NANO}.items() <= types.items()

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0)

    assert moved("vllm:prompt_tokens_total") == sum(o.usage.prompt_tokens for o in outs)
    assert moved("vllm:generation_tokens_total") == sum(o.usage.completion_tokens for o in outs)
    assert moved("vllm:request_prompt_tokens_sum") == sum(o.usage.prompt_tokens for o in outs)
    reasons = [o.choices[0].finish_reason for o in outs]
    assert "stop" in reasons and "length" in reasons
    for reason in ("stop", "length"):
        assert moved("vllm:request_success_total", finished_reason=reason) == reasons.count(reason)
    for name in PER_REQUEST:
        assert moved(name + "_count") == len(outs), name
    assert moved("vllm:inter_token_latency_seconds_count") == sum(o.usage.completion_tokens - 1 for o in outs)
    assert moved("nano_requests_arrived_total") == len(outs)
    assert after[("vllm:num_requests_running", ())] == after[("nano_queue_depth_tokens", ())] == 0


def test_metrics_answer_at_once_while_a_step_runs(srv, monkeypatch):
    """A step held for as long as the test likes: /metrics answers in milliseconds from the
    snapshot the engine thread published before the step, which already counts the request."""
    entered, release, step = threading.Event(), threading.Event(), srv.engine.step

    def held():
        entered.set()
        release.wait(60)
        return step()
    monkeypatch.setattr(srv.engine, "step", held)
    assert srv.idle()
    _, before = scrape(srv.url, srv.model)
    request = threading.Thread(target=srv.client.completions.create,
                               kwargs=dict(model=srv.model, prompt=PROMPT, max_tokens=2))
    request.start()
    try:
        assert entered.wait(60)
        start = time.perf_counter()
        _, during = scrape(srv.url, srv.model, timeout=5)
        took = time.perf_counter() - start
    finally:
        release.set()
        request.join(60)
    assert took < 0.5, took
    assert during[("nano_requests_arrived_total", ())] == before[("nano_requests_arrived_total", ())] + 1
    assert during[("vllm:num_requests_waiting", ())] == 1


def test_the_metrics_prom_file_is_what_metrics_serves(tmp_path):
    """run.py --serve --metrics-prom F: the file and GET /metrics come from one registry, whose
    model_name label is the first --served-model-name (as vLLM's)."""
    import os
    import subprocess
    import sys

    from test_tp import ROOT, TIMEOUT
    port, prom = free_port(), tmp_path / "nano.prom"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    job = subprocess.Popen([sys.executable, "run.py", "--serve", "--port", str(port), "--kv-cache-memory", "300MB",
                            "--metrics-prom", str(prom), "--served-model-name", "nano-chat", "gpt-4o-mini"],
                           cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        url = wait_healthy(job, port, TIMEOUT)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["nano-chat", "gpt-4o-mini"]
        model = "nano-chat"
        outs = [client.completions.create(model=name, prompt=PROMPT, max_tokens=n)
                for name, n in (("gpt-4o-mini", 2), (model, 5))]
        assert {o.model for o in outs} == {model}
        _, samples = scrape(url, model)  # answered between the engine's steps: after the file's last write
        from test_metrics import parse
        assert parse(prom.read_text(), model)[1] == samples
        assert samples[("vllm:generation_tokens_total", ())] == sum(o.usage.completion_tokens for o in outs)
        assert samples[("vllm:e2e_request_latency_seconds_count", ())] == 2
    finally:
        job.terminate()
        job.communicate(timeout=60)


# ---- load, saturation, disconnects, the bounded queue -------------------------------------------------
def test_health_stays_fast_while_the_engine_is_saturated(srv):
    async def main():
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
        work = [asyncio.create_task(client.completions.create(model=srv.model, prompt=f"{PROMPT} {i}", max_tokens=48,
                                                              extra_body={"ignore_eos": True}))
                for i in range(24)]
        await asyncio.sleep(1.0)  # the engine busy with all of them
        times = []
        async with httpx.AsyncClient() as http:
            for _ in range(40):
                start = time.perf_counter()
                assert (await http.get(srv.url + "/health")).status_code == 200
                times.append(time.perf_counter() - start)
                await asyncio.sleep(0.02)
        busy = bool(srv.engine.scheduler.running)
        done = await asyncio.gather(*work)
        return times, busy, done
    times, busy, done = asyncio.run(main())
    assert busy and all(d.usage.completion_tokens == 48 for d in done)
    print(f"/health p50 {1e3 * np.percentile(times, 50):.1f} ms, p99 {1e3 * np.percentile(times, 99):.1f} ms")
    assert np.percentile(times, 99) < 0.5  # a blocked event loop would take steps (~100s of ms) to answer


def test_clients_that_disconnect_mid_stream_leave_nothing_behind(srv):
    """Many streams, each dropped after a random number of chunks: every request leaves the
    engine (no running request, every block free) within moments, not at its max_tokens."""
    rng = np.random.default_rng(0)

    async def one(i, http):
        keep = int(rng.integers(1, 12))
        async with http.stream("POST", srv.url + "/v1/completions", json={
                "prompt": f"{PROMPT} {i}", "max_tokens": 4000, "stream": True, "ignore_eos": True}) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= keep:
                    return  # closing the response drops the connection

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            await asyncio.gather(*(one(i, http) for i in range(16)))
    asyncio.run(main())
    # Left running, 16 x 4000 tokens would take minutes.
    assert srv.idle(timeout=5), srv.engine.scheduler.running


def test_a_full_queue_answers_503():
    small = Running(max_queued=2)
    try:
        async def main():
            client = openai.AsyncOpenAI(base_url=small.url + "/v1", api_key="none", max_retries=0, timeout=120)
            calls = [client.completions.create(model=small.model, prompt=PROMPT, max_tokens=24, extra_body={"ignore_eos": True})
                     for _ in range(6)]
            return await asyncio.gather(*calls, return_exceptions=True)
        results = asyncio.run(main())
        errors = [r for r in results if isinstance(r, Exception)]
        assert errors and all(isinstance(e, openai.APIStatusError) and e.status_code == 503 for e in errors)
        assert sum(not isinstance(r, Exception) for r in results) >= 2
        assert small.idle()
    finally:
        small.stop()


def test_a_few_hundred_concurrent_requests_all_complete(srv):
    """Bounded load: 200 requests from 32 concurrent clients, each answered in full; the
    server's throughput is printed next to LLM.generate's on the same prompts (the
    benchmark figure is in docs/results.md; timing is not asserted here)."""
    prompts = [f"Request {i}: name a fruit that is" for i in range(200)]

    async def main():
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
        gate = asyncio.Semaphore(32)

        async def one(p):
            async with gate:
                return await client.completions.create(model=srv.model, prompt=p, max_tokens=8, temperature=0,
                                                       extra_body={"ignore_eos": True})
        start = time.perf_counter()
        outs = await asyncio.gather(*(one(p) for p in prompts))
        return outs, time.perf_counter() - start
    outs, wall = asyncio.run(main())
    assert all(o.usage.completion_tokens == 8 and o.choices[0].finish_reason == "length" for o in outs)
    assert srv.idle()
    print(f"server: {200 * 8 / wall:.1f} output tok/s over {wall:.1f} s")


# ---- under mpirun: rank 0 serves ----------------------------------------------------------------------
def test_serving_under_tp2_gives_the_one_rank_tokens(srv):
    from test_tp import ROOT, TIMEOUT, ended_by_ctrl_c, have_mpi, mpirun
    if not have_mpi():
        pytest.skip("needs mpi4py and mpirun")
    import os
    import subprocess
    import sys
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    job = subprocess.Popen([mpirun(), "-n", "2", "--allow-run-as-root", "--oversubscribe", sys.executable, "run.py",
                            "--serve", "--tp", "2", "--port", str(port), "--kv-cache-memory", "300MB"],
                           cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with ended_by_ctrl_c(job):
        url = wait_healthy(job, port, TIMEOUT)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        tp = client.completions.create(model=srv.model, prompt=PROMPT, max_tokens=12, temperature=0)
        one = srv.client.completions.create(model=srv.model, prompt=PROMPT, max_tokens=12, temperature=0)
        assert tp.choices[0].text == one.choices[0].text
        scored = [c.completions.create(model=srv.model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
                  .choices[0].logprobs for c in (client, srv.client)]  # prompt logprobs: the same on two ranks
        assert scored[0].token_logprobs[1:] == pytest.approx(scored[1].token_logprobs[1:], abs=1e-4)
        chunks = list(client.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=6, temperature=0, stream=True))
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        for i in range(4):  # streams dropped after a few chunks: aborted on both ranks' pools
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "prompt": f"{PROMPT} {i}", "max_tokens": 4000, "stream": True, "ignore_eos": True}) as r:
                next(line for n, line in enumerate(r.iter_lines()) if n >= 2 * (i + 1))
        deadline = time.monotonic() + 10
        while (now := scrape(url, srv.model)[1])[("vllm:num_requests_running", ())] or \
                now[("vllm:kv_cache_usage_perc", ())]:
            assert time.monotonic() < deadline, now
            time.sleep(0.1)


@pytest.mark.parametrize("args,message", [
    (["--serve", "--port", "70000"], "--port must be an integer in [0, 65535], got 70000"),
    (["--serve", "--max-queued-requests", "0"], "--max-queued-requests must be an integer >= 1, got 0"),
    (["--serve", "--bench"], "--serve takes its prompts over HTTP: drop --prompt-file, --bench and --disagg"),
    (["--serve", "--max-stop-strings", "0"], "--max-stop-strings must be an integer >= 1, got 0"),
    (["--serve", "--shutdown-timeout", "-1"], "--shutdown-timeout must be a number >= 0, got -1.0"),
    (["--serve", "--api-key", ""], "--api-key is empty (or NANO_API_KEY is set but empty)"),
    (["--serve", "--allowed-origins", "*"],
     "--allowed-origins: a JSON list of strings, as '[\"https://app.example\"]', got '*'"),
    (["--capacity", "--allowed-origins", '["*"]'], "--allowed-origins: the HTTP server's, which needs --serve"),
    (["--serve", "--generation-config", "/nowhere"], "--generation-config: /nowhere/generation_config.json does "
     "not exist (give a model folder that has one, auto or vllm)"),
])
def test_bad_serve_flags_are_one_line(args, message):
    from test_tp import assert_one_line_error, launch
    assert_one_line_error(launch(["run.py", *args]), message)


def test_an_engine_failure_is_reported_not_hung():
    """A bug in a step: waiting clients get an error, /health and new requests a 503."""
    broken = Running()
    try:
        def fail():
            raise RuntimeError("injected")
        broken.engine.step = fail
        r = httpx.post(broken.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        assert r.status_code == 500 and "engine failed: RuntimeError: injected" in r.json()["error"]["message"]
        health = httpx.get(broken.url + "/health")
        assert health.status_code == 503 and "injected" in health.json()["error"]["message"]
        again = httpx.post(broken.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert again.status_code == 503
    finally:
        broken.stop()
