"""LoRA adapters on the OpenAI server (nano/server/adapters.py), as vLLM serves them: a request's
model names its adapter and gets the offline engine's tokens under that LoRARequest, two
adapters and the base in concurrent requests, /v1/models' cards (parent, root), the runtime
load and unload routes behind their switch with vLLM's statuses, and vLLM's
vllm:lora_requests_info gauge. The tiny random model: each server starts in about a second."""
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from test_server import Running, httpx  # noqa: E402

from nano.config import EngineConfig, ModelConfig  # noqa: E402
from nano.engine import LLMEngine  # noqa: E402
from nano.lora import LLM, LoRARequest, attach  # noqa: E402
from nano.sequence import SamplingParams  # noqa: E402
from nano.server.adapters import Adapters  # noqa: E402
from nano.server.engine_thread import token_view  # noqa: E402
from nano.server.schemas import BadRequest  # noqa: E402
from nano.telemetry.export import gauges  # noqa: E402
from nano.telemetry.prometheus import EngineExport  # noqa: E402
from test_lora_pool import make_adapter  # noqa: E402

PROMPT = [5, 17, 33, 9, 80, 81, 82, 3, 4, 100]  # token ids: no tokenizer's special tokens in the way
TOKENS = 8
ENGINE = dict(device="cpu", kv_cache_memory=20 * 10**6)


@pytest.fixture(scope="module")
def folders(tiny_model, tmp_path_factory):
    """Three adapters of the tiny model, and one nano refuses (DoRA)."""
    root = tmp_path_factory.mktemp("adapters")
    cfg = ModelConfig.from_hf(json.loads((tiny_model / "config.json").read_text()))
    return {"a": make_adapter(root / "a", seed=1, r=4, alpha=8, cfg=cfg),
            "b": make_adapter(root / "b", seed=2, r=3, alpha=3, cfg=cfg, modules=("q_proj", "v_proj", "down_proj")),
            "c": make_adapter(root / "c", seed=3, r=2, alpha=4, cfg=cfg, modules=("o_proj", "gate_proj")),
            "dora": make_adapter(root / "dora", seed=4, r=2, alpha=4, cfg=cfg, use_dora=True)}


@pytest.fixture(scope="module")
def offline(tiny_model, folders):
    """Each folder's greedy tokens for PROMPT from the Python API (None: the base model), as the
    server's logprobs spell them (token_view)."""
    llm = LLM(str(tiny_model), enable_lora=True, max_loras=2, max_lora_rank=4, num_blocks=256, **ENGINE)
    names = [None, "a", "b", "c"]
    requests = [None if n is None else LoRARequest(n, i, str(folders[n])) for i, n in enumerate(names)]
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    outs = [[token_view(llm.engine.tokenizer, t)[0] for t in llm.generate([PROMPT], params, lora_request=[r])[0]
             .token_ids] for r in requests]
    assert len(set(map(tuple, outs))) == len(outs)  # each adapter changes the answer
    return dict(zip(names, outs))


def serve(tiny_model, folders, runtime_updates: bool) -> Running:
    """A server of the tiny model with adapters a and b (--lora-modules), 2 slots, 2 in host memory."""
    def prepare(engine):
        pool = attach(engine, max_loras=2, max_lora_rank=4)
        modules = {n: pool.resolve(LoRARequest(n, i + 1, str(folders[n]))) for i, n in enumerate("ab")}
        return {"adapters": Adapters(pool, modules, [engine.model_name], runtime_updates)}
    running = Running(max_queued=16, prepare=prepare, model=str(tiny_model), **ENGINE)
    running.pool = running.app.state.server.adapters.pool
    return running


@pytest.fixture(scope="module")
def srv(tiny_model, folders):
    running = serve(tiny_model, folders, runtime_updates=True)
    yield running
    running.stop()


def complete(srv, model: str):
    return srv.client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0, logprobs=0,
                                         extra_body={"ignore_eos": True})


def tokens(srv, model: str) -> list[str]:
    """The greedy tokens of PROMPT under model, as the completion's logprobs spell them."""
    return complete(srv, model).choices[0].logprobs.tokens


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60)


def test_the_model_names_the_adapter_and_the_answer_carries_it(srv, offline):
    """The openai client's own calls: each adapter's tokens are the offline engine's under that
    LoRARequest; the base model's name means no adapter; every API answers with the name asked."""
    for name in ("a", "b"):
        out = complete(srv, name)
        assert out.choices[0].logprobs.tokens == offline[name] and out.model == name
    base = complete(srv, srv.model)
    assert base.choices[0].logprobs.tokens == offline[None] and base.model == srv.model
    chat = srv.client.chat.completions.create(model="b", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert chat.model == "b"
    assert {c.model for c in srv.client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True)} == {"a"}
    assert srv.client.responses.create(model="a", input="Hi", max_output_tokens=2).model == "a"
    tokenized = post(srv, "/tokenize", {"model": "a", "prompt": "Hi"})
    assert tokenized.status_code == 200 and tokenized.json()["tokens"]
    with pytest.raises(openai.NotFoundError, match=f"this server has '{srv.model}', 'a', 'b'"):
        complete(srv, "nope")


def test_two_adapters_and_the_base_in_concurrent_requests(srv, offline):
    """Requests for a, b and the base, several at once: each gets its own model's tokens."""
    names = ["a", "b", srv.model] * 3
    with ThreadPoolExecutor(len(names)) as pool:
        texts = list(pool.map(lambda n: tokens(srv, n), names))
    assert texts == [offline.get(n) for n in ["a", "b", None] * 3]


def test_model_cards_list_each_adapter_under_the_base(srv, folders):
    """vLLM's cards: an adapter's parent is the base model's served name, its root its folder; the
    base model's card keeps parent null."""
    cards = srv.client.models.list().data
    assert [c.id for c in cards] == [srv.model, "a", "b"]
    base, a, b = (c.model_dump() for c in cards)
    assert base["parent"] is None and base["root"] == str(srv.engine.shard.model_dir)
    assert (a["parent"], a["root"]) == (srv.model, str(folders["a"]))
    assert (b["parent"], b["root"]) == (srv.model, str(folders["b"]))
    assert httpx.get(srv.url + "/v1/models/b").json() == httpx.get(srv.url + "/v1/models").json()["data"][2]


def test_load_and_unload_while_serving(srv, folders, offline):
    """vLLM's routes and answers: a loaded adapter serves at once and is listed; a name loaded
    twice, an empty field, a nano refusal (400, named) and a folder with no adapter (404); an
    unloaded name is a 404 for requests and for a second unload; it may be loaded again."""
    loaded = post(srv, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(folders["c"])})
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'c' added successfully."
    assert tokens(srv, "c") == offline["c"]
    assert [c.id for c in srv.client.models.list().data] == [srv.model, "a", "b", "c"]
    for body, status, text in [
        ({"lora_name": "c", "lora_path": str(folders["a"])}, 400, "The lora adapter 'c' has already been loaded."),
        ({"lora_name": "", "lora_path": str(folders["a"])}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
        ({"lora_name": srv.model, "lora_path": str(folders["a"])}, 400, "would hide the base model"),
        ({"lora_name": "d", "lora_path": str(folders["dora"])}, 400, "DoRA (use_dora=True) is not supported"),
        ({"lora_name": "d", "lora_path": "/nowhere"}, 404, "Loading lora d failed: No adapter found for /nowhere"),
        ({"lora_name": "d", "lora_path": "/x", "load_inplace": True}, 400, "load_inplace: an unknown field")]:
        r = post(srv, "/v1/load_lora_adapter", body)
        assert r.status_code == status and text in r.json()["error"]["message"], (body, r.text)
    assert "d" not in [c.id for c in srv.client.models.list().data]
    gone = post(srv, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert gone.status_code == 200 and gone.text == "Success: LoRA adapter 'c' removed successfully."
    with pytest.raises(openai.NotFoundError):
        complete(srv, "c")
    again = post(srv, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert again.status_code == 404 and again.json()["error"]["message"] == "The lora adapter 'c' cannot be found."
    assert post(srv, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(folders["b"])}).status_code == 200
    assert tokens(srv, "c") == offline["b"]  # the name, now another folder's
    assert post(srv, "/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 200


def test_an_unloaded_adapter_ends_its_running_requests_then_is_dropped(srv, folders, offline, monkeypatch):
    """Unloading a name that a running stream uses: the stream ends under the adapter it began
    with, while the name already serves another folder; then the pool holds the old one no more
    (its slot and host memory freed). Host memory keeps 2 of the 3 adapters: the others are
    read again when asked for, never on the engine thread or the event loop."""
    import threading
    from nano.lora import pool as pool_module
    from nano.server import adapters as adapters_module
    readers = []

    def reading(read):
        def recorded(*args):
            readers.append(threading.current_thread().name)
            return read(*args)
        return recorded
    for module in (pool_module, adapters_module):
        monkeypatch.setattr(module, "read_adapter", reading(module.read_adapter))
    assert post(srv, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(folders["c"])}).status_code == 200
    old = srv.app.state.server.adapters.get("x")
    stream = srv.client.completions.create(model="x", prompt=PROMPT, max_tokens=300, temperature=0, stream=True,
                                           logprobs=0, extra_body={"ignore_eos": True})
    chunks = [next(iter(stream))]
    assert post(srv, "/v1/unload_lora_adapter", {"lora_name": "x"}).status_code == 200
    assert post(srv, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(folders["a"])}).status_code == 200
    assert tokens(srv, "x") == offline["a"]
    chunks += list(stream)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert len(streamed) == 300 and streamed[:TOKENS] == offline["c"] and chunks[-1].model == "x"
    assert srv.idle()
    deadline = time.monotonic() + 5
    while old.lora_int_id in srv.pool.leaving:  # forget drops it last
        assert time.monotonic() < deadline, "the unloaded adapter is still held"
        time.sleep(0.02)
    assert all(old.lora_int_id not in held for held in (srv.pool.slots, srv.pool.host, srv.pool.known))
    assert len(srv.pool.host) <= 2
    for name in ("a", "b", "x"):
        assert tokens(srv, name) == offline["a" if name == "x" else name]
    assert readers and not {"nano-engine", srv.thread.name} & set(readers), readers  # the event loop: srv.thread
    assert post(srv, "/v1/unload_lora_adapter", {"lora_name": "x"}).status_code == 200


def test_without_the_switch_there_are_no_load_routes(tiny_model, folders, offline):
    """vLLM's switch off: the routes do not exist (404), while --lora-modules still serve; /metrics
    carries vLLM's LoRA gauge."""
    running = serve(tiny_model, folders, runtime_updates=False)
    try:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            r = post(running, path, {"lora_name": "c", "lora_path": str(folders["c"])})
            assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"
        assert tokens(running, "b") == offline["b"]
        info = [line for line in httpx.get(running.url + "/metrics").text.splitlines()
                if line.startswith("vllm:lora_requests_info{")]
        assert len(info) == 1
        assert info[0].startswith('vllm:lora_requests_info{max_lora="2",running_lora_adapters="",'
                                  'waiting_lora_adapters=""} ')
        assert float(info[0].split()[-1]) == pytest.approx(time.time(), abs=60)
    finally:
        running.stop()


def test_loading_under_tensor_parallelism_is_a_400(srv, folders, monkeypatch):
    """Under --tp only rank 0 would read the folder: refused, with the reason."""
    import asyncio
    from nano.server import adapters as module

    class Two:
        world = 2
    monkeypatch.setattr(module.parallel, "tp_group", lambda: Two())
    with pytest.raises(BadRequest, match="not supported under --tp: every rank would have to read it") as e:
        asyncio.run(Adapters(srv.pool, {}, ["base"], True).load("d", str(folders["c"]), None))
    assert e.value.status == 400


def test_the_lora_gauge_names_running_and_waiting_adapters(tiny_model, folders):
    """vLLM's vllm:lora_requests_info: with 2 slots, requests for a and b run and one for c waits;
    the labels name them, the value is the time; the base model's request is in neither."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model), num_blocks=64, **ENGINE))
    attach(engine, max_loras=2, max_lora_rank=4, max_cpu_loras=3)
    export = EngineExport(engine, max_loras=2)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    requests = {name: LoRARequest(name, i + 1, str(folders[name])) for i, name in enumerate("abc")}
    for name in ["a", "b", None, "c", "a"]:  # the second a waits behind c: first come, first served
        engine.add_request(PROMPT, params, lora_request=requests.get(name))
    engine.step()
    export.update(gauges(engine, engine.clock.now()))
    lines = [line for line in export.text().decode().splitlines() if line.startswith("vllm:lora_requests_info")]
    assert len(lines) == 1
    assert lines[0].startswith('vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",'
                               'waiting_lora_adapters="c,a"} ')
    assert float(lines[0].split()[-1]) == pytest.approx(time.time(), abs=60)


def test_run_py_serves_lora_modules_and_takes_vllms_switch(tiny_model, folders, offline, tmp_path):
    """The command line: run.py --serve --enable-lora --lora-modules, with runtime updating switched
    on by vLLM's environment variable; /metrics is then --metrics-prom's registry, with the gauge."""
    import os
    import signal
    import subprocess
    import sys
    from test_server import free_port, wait_healthy
    from test_tp import ROOT
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
    job = subprocess.Popen([sys.executable, "run.py", "--serve", "--port", str(port), "--model", str(tiny_model),
                            "--device", "cpu", "--kv-cache-memory", "20MB", "--enable-lora", "--max-lora-rank", "4",
                            "--metrics-prom", str(tmp_path / "m.prom"), "--lora-modules", f"a={folders['a']}",
                            json.dumps({"name": "b", "path": str(folders["b"])})],
                           cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = wait_healthy(job, port, 60)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert [(m.id, m.parent) for m in client.models.list().data] == [
            (tiny_model.name, None), ("a", tiny_model.name), ("b", tiny_model.name)]
        out = client.completions.create(model="b", prompt=PROMPT, max_tokens=TOKENS, temperature=0, logprobs=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].logprobs.tokens == offline["b"] and out.model == "b"
        loaded = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(folders["c"])})
        assert loaded.status_code == 200
        assert 'vllm:lora_requests_info{max_lora="4"' in httpx.get(url + "/metrics").text
        assert 'vllm:lora_requests_info{max_lora="4"' in (tmp_path / "m.prom").read_text()
        job.send_signal(signal.SIGTERM)
        _, stderr = job.communicate(timeout=30)
        assert "LoRA dynamic loading & unloading is enabled" in stderr
    finally:
        if job.poll() is None:
            job.kill()
