"""The server's engine in a process of its own (nano/server/engine_process.py): the same answers
as the engine thread's, steps in the child only, clients that leave aborted there, /metrics from
the child's registry, a child that dies failing its requests, and run.py --serve ending then."""
import os
import pickle
import signal
import subprocess
import sys
import time
from collections import OrderedDict

import pytest

pytest.importorskip("fastapi")
from test_server import PROMPT, Running, free_port, httpx, wait_healthy  # noqa: E402

from nano import structured  # noqa: E402
from nano.sequence import SamplingParams  # noqa: E402
from nano.server import engine_process  # noqa: E402
from nano.structured.compose import Chain  # noqa: E402
from nano.server.engine_thread import Job, StopStrings  # noqa: E402
from nano.telemetry.export import metrics_of  # noqa: E402


@pytest.fixture(scope="module")
def srv():
    running = Running(app={"own_process": True})
    yield running
    running.stop()


def metric(url: str, name: str) -> float:
    lines = httpx.get(url + "/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


def until(condition, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_answers_equal_the_engine_s_and_every_step_runs_in_the_child(srv):
    out = srv.client.completions.create(model=srv.model, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = srv.client.completions.create(model=srv.model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    streamed = "".join(c.choices[0].text for c in chunks)
    child = srv.app.state.server.thread.process
    assert child.is_alive() and child.pid != os.getpid()
    assert metrics_of(srv.engine).steps == 0  # the server's copy of the engine never stepped
    assert metric(srv.url, "vllm:request_success_total") >= 2  # the child's registry, sent back
    # The server's copy, run here now, gives what the child gave.
    expected = srv.engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12))[0]
    text = srv.engine.tokenizer.decode(expected.output_token_ids)
    assert out.choices[0].text == streamed == text and out.usage.completion_tokens == expected.num_output_tokens


def test_a_request_s_grammar_is_compiled_again_in_the_child_for_all_its_choices(srv):
    r = httpx.post(srv.url + "/v1/completions", json={
        "model": srv.model, "prompt": "Pick one:", "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 1,
        "structured_outputs": {"choice": ["red", "green", "blue"]}}, timeout=60)
    assert r.status_code == 200, r.text
    assert {c["text"] for c in r.json()["choices"]} <= {"red", "green", "blue"}


def test_a_client_that_leaves_is_aborted_in_the_child(srv):
    before = metric(srv.url, "nano_requests_aborted_total")
    body = {"model": srv.model, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 4:
                break
    assert until(lambda: metric(srv.url, "nano_requests_aborted_total") == before + 1)


def test_the_child_ignores_ctrl_c_which_the_terminal_sends_the_whole_group(srv):
    child = srv.app.state.server.thread.process
    os.kill(child.pid, signal.SIGINT)
    time.sleep(0.3)
    assert child.is_alive()
    assert srv.client.completions.create(model=srv.model, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_a_child_that_dies_fails_its_open_requests_health_and_calls_on_death(tiny_model):
    running = Running(app={"own_process": True}, model=str(tiny_model), num_blocks=256)
    try:
        thread = running.app.state.server.thread
        died = []
        thread.on_death = lambda: died.append(True)
        body = {"model": running.model, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", running.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            os.kill(thread.process.pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert any("engine failed: the engine's process ended (exit status -9)" in line for line in rest), rest[-3:]
        assert rest[-1] == "data: [DONE]"
        health = httpx.get(running.url + "/health")
        assert health.status_code == 503 and "exit status -9" in health.text
        assert died == [True]
    finally:
        running.stop()


def test_run_py_serve_ends_with_one_error_line_when_its_engine_process_dies(tiny_model):
    port = free_port()
    job = subprocess.Popen([sys.executable, "run.py", "--serve", "--port", str(port), "--model", str(tiny_model),
                            "--num-blocks", "64", "--log-level", "warning"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(job, port, 120)
        children = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 1, children  # the engine's process
        os.kill(int(children[0]), signal.SIGKILL)
        _, err = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 1, err
    assert err.strip().splitlines()[-1] == "error: engine stopped: the engine's process ended (exit status -9)"


def test_messages_carry_what_both_processes_hold_as_a_reference_and_jobs_without_their_queue():
    held, job = object(), Job([1, 2], SamplingParams(), StopStrings(), None, events="queue", loop="loop")
    shared = {id(held): held}
    back = engine_process._loads(engine_process._dumps(("add", 7, [held, job]), shared), shared)
    assert back[2][0] is held  # not a copy
    assert back[2][1].events is None and back[2][1].loop is None and back[2][1].prompt == [1, 2]
    assert engine_process._loads(engine_process._dumps([held], {}), {})[0] is not held


def test_the_feeder_compiles_each_grammar_source_once_and_shares_it(srv):
    vocabulary = srv.app.state.server.vocabulary or structured.Vocabulary.of(
        srv.engine.tokenizer, srv.engine.model_config.vocab_size)
    grammar = structured.compile_grammar(vocabulary, "choice", ["yes", "no"], False, "structured_outputs.choice")
    first, second = pickle.loads(pickle.dumps(grammar)), pickle.loads(pickle.dumps(grammar))
    assert first._compiled is None  # a pickle leaves llguidance's compiled form out
    known, chain = OrderedDict(), Chain(second)
    assert engine_process._compiled(first, known) is first and first._compiled is not None
    assert engine_process._compiled(chain, known) is chain and chain.parts == [first]
