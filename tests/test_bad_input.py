"""Bad input of every kind gets one clean answer and costs no finished work: one `error:` line
and exit code 2 from the CLI (before the model loads, where the input allows), a NanoError
from the Python API that leaves the LLM usable. Each class of bad input: JSONL
fields and flags, model folders, output paths, resource requests, the API; a fuzz test of
malformed JSONL. Signals under mpirun are in test_tp.py, the default model's repair and
stale downloads in test_weights.py."""
import json
import math
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest
from test_cli import ROOT, assert_one_line_error, run_cli
from test_weights import edit_header, never_waiting_on

import run
from nano import LLM, SamplingParams
from nano.cli import prompts
from nano.deadline.policy import Deadline
from nano.errors import NanoError
from test_stress import check_invariants

FAST = ["--no-chat", "--num-blocks", "256"]  # a small pool starts quickly
GOOD = '{"prompt": "hello"}'


def main_error(*args) -> str:
    """run.main in this process, which must raise a NanoError of one line: the CLI prints
    it as `error: ...` and exits 2 (checked through a real subprocess below)."""
    with pytest.raises(NanoError) as e:
        run.main([str(a) for a in args])
    message = str(e.value)
    assert "\n" not in message and message
    return message


# ---- 1. JSONL fields and flags ----------------------------------------------------------
@pytest.mark.parametrize("field,message", [
    ('"ttft_slo_ms": "fast"', "field ttft_slo_ms must be a number > 0, got 'fast'"),
    ('"tpot_slo_ms": -1e999', "field tpot_slo_ms must be a number > 0, got -inf"),
    ('"seed": "abc"', "field seed must be an integer, got 'abc'"),
    ('"seed": 1.0', "field seed must be an integer, got 1.0"),
    ('"max_tokens": "5"', "field max_tokens must be an integer in [1, 2147483647], got '5'"),
    ('"max_tokens": null', "field max_tokens must be an integer in [1, 2147483647], got None"),
    ('"max_tokens": 4.5', "field max_tokens must be an integer in [1, 2147483647], got 4.5"),
    ('"max_tokens": 1e400', "field max_tokens must be an integer in [1, 2147483647], got inf"),
    ('"temperature": NaN', "field temperature must be a number >= 0, got nan"),
    ('"temperature": true', "field temperature must be a number >= 0, got True"),
    ('"top_p": Infinity', "field top_p must be a number in (0, 1], got inf"),
    ('"top_k": [5]', "field top_k must be an integer in [-1, 2147483647], got [5]"),
    ('"seed": ' + "9" * 5000, "a number too long to read"),
    ('"prompt": 5', "field prompt must be a string, got 5"),
    ('"prompt": "\\udc80 lone"', "field prompt is not valid Unicode text (it holds a lone surrogate)"),
])
def test_jsonl_field_of_the_wrong_type_or_value(tmp_path, field, message):
    path = tmp_path / "p.jsonl"
    line = f"{{{field}}}" if field.startswith('"prompt"') else f'{{"prompt": "hi", {field}}}'
    path.write_text(f"{GOOD}\n{line}\n")
    assert main_error("--prompt-file", path) == f"{path} line 2: {message}"


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "nan"], "--temperature must be a number >= 0, got nan"),
    (["--top-p", "inf"], "--top-p must be a number in (0, 1], got inf"),
    (["--ttft-slo", "inf"], "--ttft-slo must be a number > 0, got inf"),
    (["--tpot-slo=-5"], "--tpot-slo must be a number > 0, got -5.0"),
    (["--watermark", "nan"], "--watermark must be a number in [0, 1), got nan"),
    (["--kv-cache-memory", "inf"], "cannot read a byte size from 'inf' (e.g. 2GB, 512MiB)"),
    (["--swap-space", "nan"], "cannot read a byte size from 'nan' (e.g. 2GB, 512MiB)"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype must be auto or int8, got 'fp8'"),
    (["--kv-cache-dtype", "int8", "--kv-int8-keys", "hadamard"],
     "--kv-int8-keys must be token or rotate, got 'hadamard'"),
    (["--kv-int8-keys", "rotate"], "--kv-int8-keys needs --kv-cache-dtype int8"),
    (["--max-tokens", "1e3"], "argument --max-tokens: invalid int value: '1e3'"),
    (["--max-tokens", str(2**40)], f"--max-tokens must be an integer in [1, 2147483647], got {2**40}"),
])
def test_bad_flag_values(tmp_path, flags, message):
    (tmp_path / "p.txt").write_text("hi\n")
    assert main_error("--prompt-file", tmp_path / "p.txt", *flags) == message


@pytest.mark.parametrize("flags,message", [
    (["--output", "p.txt"], "--output p.txt is also --prompt-file: give each its own file"),
    (["--output", "o.jsonl", "--metrics-file", "./o.jsonl"],
     "--metrics-file ./o.jsonl is also --output: give each its own file"),
])
def test_no_output_over_the_prompts_or_another_output(tmp_path, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.txt").write_text("hi\n")
    assert main_error("--prompt-file", "p.txt", *flags) == message
    assert (tmp_path / "p.txt").read_text() == "hi\n"


def test_bad_bench_flags():
    assert main_error("--bench", "--request-rate", "inf") == "--request-rate must be a number > 0, got inf"
    assert main_error("--bench", "--policy-compare", "--seeds", "0") == "--seeds must be an integer >= 1, got 0"
    assert main_error("--policy-compare") == ("--policy-compare, --request-rate, --tenants, --dp-compare and "
                                              "--disagg-compare are --bench modes: add --bench")
    assert main_error("--prefix-len", "64") == main_error("--policy-compare")
    assert main_error("--bench", "--tenants", "4") == ("--tenants and --prefix-len go together: N tenants, each with "
                                                       "a system prompt of LEN tokens")
    assert main_error("--bench", "--num-seqs", "0") == "--num-seqs must be an integer >= 1, got 0"
    assert main_error("--prompt-file", "p.txt", "--num-seqs", "5", "--seeds", "2") == (
        "--num-seqs, --seeds: --bench's workload, which needs --bench")
    assert main_error("--capacity", "--input-len", "5:10") == "--input-len: --bench's workload, which needs --bench"


def test_server_flags_without_serve():
    assert main_error("--prompt-file", "p.txt", "--port", "9000") == "--port: the HTTP server's, which needs --serve"
    assert main_error("--bench", "--api-key", "k", "--log-level", "debug") == (
        "--api-key, --log-level: the HTTP server's, which needs --serve")


def test_endless_or_blocking_prompt_files(tmp_path):
    """/dev/zero is one endless line; a FIFO that nothing writes to would block open() for ever
    (under mpirun, every rank with it): each is one line, at once."""
    fifo = tmp_path / "p.txt"
    os.mkfifo(fifo)
    assert main_error("--prompt-file", "/dev/zero") == \
        "/dev/zero line 1: longer than a prompt file's bound of 16 Mi characters"
    with never_waiting_on(fifo):
        assert main_error("--prompt-file", fifo) == f"prompt file {fifo} has no prompts"


def test_prompt_file_bounds(tmp_path, monkeypatch):
    """A line, the whole file and the number of prompts are each bounded (here with small bounds)."""
    monkeypatch.setattr(prompts, "MAX_LINE", 10)
    monkeypatch.setattr(prompts, "MAX_CHARS", 30)
    monkeypatch.setattr(prompts, "MAX_PROMPTS", 3)
    path = tmp_path / "p.txt"
    for text, message in [("ok\n0123456789a\n", "line 2: longer than"),
                          ("0123456789\n" * 3, "line 3: the file passes"),
                          ("a\n\nb\nc\nd\n", "line 5: more than a prompt file's bound of 3 prompts")]:
        path.write_text(text)
        assert main_error("--prompt-file", path).startswith(f"{path} {message}")
    path.write_text("a\n\nb\nc\n")
    assert len(prompts.read_requests(str(path), SamplingParams())) == 3


def test_prompts_from_a_pipe():
    """--prompt-file <(cmd) and /dev/stdin are pipes, read as any file is."""
    r, w = os.pipe()
    os.write(w, b"one\r\n\ntwo\n")
    os.close(w)
    try:
        assert [req.prompt for req in prompts.read_requests(f"/dev/fd/{r}", SamplingParams())] == ["one", "two"]
    finally:
        os.close(r)


def test_cli_prints_one_line_and_exits_2_before_loading_the_model(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(f'{GOOD}\n{{"prompt": "hi", "max_tokens": 4.5}}\n')
    r = run_cli("--prompt-file", path, "--model", tmp_path / "no-such-model")  # never reached
    assert_one_line_error(r, f"{path} line 2: field max_tokens must be an integer")


def test_a_key_scheme_nano_no_longer_has_exits_2_with_one_line(tmp_path):
    """The int8 "channel" key scheme was measured and dropped (docs/int8-kv.md): asking for it
    is refused with the schemes there are, before the model loads."""
    (tmp_path / "p.txt").write_text("hi\n")
    r = run_cli("--prompt-file", tmp_path / "p.txt", "--model", tmp_path / "no-such-model",
                "--kv-cache-dtype", "int8", "--kv-int8-keys", "channel")
    assert_one_line_error(r, "--kv-int8-keys must be token or rotate, got 'channel'")


def test_negative_seed_flag_runs(tmp_path, tiny_model):
    (tmp_path / "p.txt").write_text("hi\n")
    r = run_cli("--prompt-file", tmp_path / "p.txt", "--model", tiny_model, *FAST, "--max-tokens", 3,
                "--seed", -7)
    assert r.returncode == 0, r.stderr


# ---- 2. model folders ------------------------------------------------------------------
def damage(folder, name, edit):
    path = folder / name
    path.write_bytes(edit(path.read_bytes()))


@pytest.mark.parametrize("name,edit,message", [
    ("config.json", lambda b: b[:len(b) // 2], "config.json is not valid JSON"),
    ("model.safetensors", edit_header(lambda h: json.dumps(h).replace('"shape": [512, 64]', '"shape": [1e999, 64]')),
     "model.safetensors is damaged or truncated: bad header entry for model.embed_tokens.weight"),
    ("tokenizer_config.json", lambda b: b'{"chat_template": 42}',
     "tokenizer_config.json chat_template must be a string"),
    ("model.safetensors", lambda b: b[:100], "model.safetensors is damaged or truncated: its header says"),
    ("model.safetensors", lambda b: b[:len(b) - 1000], "model.safetensors is damaged or truncated: tensor"),
    ("tokenizer_config.json", lambda b: b"{", "tokenizer_config.json is not valid JSON"),
])
def test_damaged_model_folder(tmp_path, tiny_model, name, edit, message):
    folder = shutil.copytree(tiny_model, tmp_path / "m")
    damage(folder, name, edit)
    (tmp_path / "p.txt").write_text("hi\n")
    assert_one_line_error(run_cli("--prompt-file", tmp_path / "p.txt", "--model", folder, *FAST), message)


def test_tensor_of_the_wrong_shape(tmp_path, tiny_model):
    folder = shutil.copytree(tiny_model, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    damage(folder, "config.json", lambda _: json.dumps({**config, "intermediate_size": 96}).encode())
    with pytest.raises(NanoError, match=r"tensor model.layers.0.mlp.gate_proj.weight has shape \(128, 64\), "
                                        r"config.json implies \(96, 64\)"):
        LLM(model=str(folder), num_blocks=16)


@pytest.mark.parametrize("edit,message", [
    ({"num_attention_heads": "4"}, "config.json num_attention_heads must be an integer >= 1, got '4'"),
    ({"num_key_value_heads": 3}, "config.json num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
    ({"rms_norm_eps": None}, "config.json rms_norm_eps must be a number in (0, 0.1], got None"),
    ({"rope_scaling": {"rope_type": "llama3"}}, "config.json rope_scaling factor must be a number in [1, 1024], got None"),
])
def test_config_fields_of_the_wrong_type_or_value(tmp_path, tiny_model, edit, message):
    folder = shutil.copytree(tiny_model, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    damage(folder, "config.json", lambda _: json.dumps({**config, **edit}).encode())
    with pytest.raises(NanoError) as e:
        LLM(model=str(folder), num_blocks=16)
    assert str(e.value) == message


def test_an_architecture_nano_does_not_run_is_refused_before_any_weights(tmp_path, tiny_model):
    """A Gemma 2 folder: one line naming it and what nano runs, exit 2, before the checkpoint is
    read (its file here is damaged, which would be the error otherwise)."""
    folder = shutil.copytree(tiny_model, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    damage(folder, "config.json", lambda _: json.dumps({**config, "architectures": ["Gemma2ForCausalLM"],
                                                        "model_type": "gemma2"}).encode())
    damage(folder, "model.safetensors", lambda b: b[:100])
    (tmp_path / "p.txt").write_text("hi\n")
    assert_one_line_error(run_cli("--prompt-file", tmp_path / "p.txt", "--model", folder, *FAST),
                          "config.json architectures ['Gemma2ForCausalLM'] is not one nano runs: it runs "
                          "LlamaForCausalLM (model_type llama), Qwen2ForCausalLM (model_type qwen2), "
                          "Qwen3ForCausalLM (model_type qwen3), MistralForCausalLM (model_type mistral), "
                          "Gemma3ForCausalLM (model_type gemma3_text)")


# ---- 3. output and metrics paths --------------------------------------------------------
def test_unwritable_metrics_and_output_paths_refused_first(tmp_path):
    (tmp_path / "p.txt").write_text("hi\n")
    args = ["--prompt-file", tmp_path / "p.txt", "--model", tmp_path / "no-such-model"]  # never reached
    assert main_error(*args, "--metrics-file", tmp_path) == f"cannot write --metrics-file {tmp_path}: it is a folder"
    missing = tmp_path / "no" / "m.prom"
    assert main_error(*args, "--metrics-prom", missing) == \
        f"cannot write --metrics-prom {missing}: no folder {missing.parent}"
    assert main_error(*args, "--output", tmp_path) == f"cannot write --output {tmp_path}: it is a folder"
    # --metrics-prom is rewritten by renaming a new file over it: a device there (as root,
    # /dev/null itself) or a FIFO would be replaced by a regular file
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/null"):
        assert main_error(*args, "--metrics-prom", path) == \
            f"cannot write --metrics-prom {path}: not a regular file (it is replaced whole at every snapshot)"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.parametrize("flag", ["--output", "--metrics-file", "--summary-json"])
def test_a_full_disk_is_one_line(tmp_path, tiny_model, flag):
    """A write that fails (/dev/full: no space left) is one error, the closing of --output's
    file at the end included (a second failure there must not replace the first)."""
    (tmp_path / "p.txt").write_text("hi\nthere\n")
    full = tmp_path / "full"
    full.symlink_to("/dev/full")
    assert main_error("--prompt-file", tmp_path / "p.txt", "--model", tiny_model, *FAST, "--max-tokens", 2,
                      flag, full) == f"cannot write {full}: No space left on device"


def test_output_to_a_pipe_is_written_in_place(tmp_path, tiny_model):
    """A pipe or a device (/dev/stdout) gets each record as it finishes, and is never renamed
    over with a file in input order, as a regular --output file is."""
    (tmp_path / "p.txt").write_text("hi\nthere\n")
    fifo = tmp_path / "out.jsonl"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()))
    reader.start()
    assert run.main([str(a) for a in ("--prompt-file", tmp_path / "p.txt", "--model", tiny_model, *FAST,
                                      "--max-tokens", 2, "--output", fifo)]) == 0
    reader.join(30)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(json.loads(line)["index"] for line in received[0].splitlines()) == [0, 1]


def test_output_untouched_when_nothing_was_generated(tmp_path):
    (tmp_path / "p.txt").write_text("hi\n")
    out = tmp_path / "out.jsonl"
    out.write_text("yesterday's results\n")
    main_error("--prompt-file", tmp_path / "p.txt", "--model", tmp_path / "no-such-model", "--output", out)
    assert out.read_text() == "yesterday's results\n"


def test_ctrl_c_keeps_every_finished_completion(tmp_path, tiny_model):
    """SIGINT once a few of 40 long requests have finished: one error line, exit 130, and the
    finished ones in the file, in input order, with the tokens an uninterrupted run gives."""
    prompts = [f"prompt number {i}" for i in range(40)]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    out = tmp_path / "out.jsonl"
    out.write_text("yesterday's results\n")
    proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), "--prompt-file", str(tmp_path / "p.txt"),
                             "--model", str(tiny_model), *FAST, "--output", str(out), "--temperature", "0",
                             "--ignore-eos", "--max-tokens", "400", "--max-num-seqs", "1"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # as from a terminal, even where the tests run as a background job (whose
                            # shell starts it with SIGINT ignored, which Python then keeps)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_for_records(out, 3, proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == ["error: interrupted"], stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert 3 <= len(records) < len(prompts)
    assert [r["index"] for r in records] == list(range(len(records)))  # input order, none missing
    llm = LLM(model=str(tiny_model), num_blocks=256, max_num_seqs=1)
    expected = llm.generate(prompts[:len(records)], SamplingParams(temperature=0, ignore_eos=True, max_tokens=400))
    assert [r["token_ids"] for r in records] == [o.token_ids for o in expected]
    assert [r["prompt"] for r in records] == prompts[:len(records)]


def wait_for_records(path, n: int, proc, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().count('"index"') >= n):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)


# ---- 4. resource requests ---------------------------------------------------------------
def test_kv_pool_or_swap_larger_than_the_machine(tmp_path, tiny_model):
    with pytest.raises(NanoError, match=r"a KV cache of 1000000.00 GB does not fit: [\d.]+ GB of host memory "
                                        r"is available \(give a smaller --kv-cache-memory or --num-blocks\)"):
        LLM(model=str(tiny_model), kv_cache_memory=10**15)
    with pytest.raises(NanoError, match=r"swap space of 1000000.00 GB does not fit: this machine has [\d.]+ GB"):
        LLM(model=str(tiny_model), num_blocks=16, swap_space=10**15)
    (tmp_path / "p.txt").write_text("hi\n")
    assert_one_line_error(run_cli("--prompt-file", tmp_path / "p.txt", "--model", tiny_model,
                                  "--num-blocks", 10**12), "does not fit")


# ---- 6. the Python API ------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(model=str(tiny_model), num_blocks=64)


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7], "hello there", [300, 2, 9, 9]]


@pytest.mark.parametrize("prompts,params,message", [
    ([[5, 512]], GREEDY, "request 0: prompt token 1 must be an integer in [0, 511], got 512"),
    ([[3], [-3, 4]], GREEDY, "request 1: prompt token 0 must be an integer in [0, 511], got -3"),
    ([[3, 4.0]], GREEDY, "request 0: prompt token 1 must be an integer in [0, 511], got 4.0"),
    ([{"a": 1}], GREEDY, "request 0: prompt must be a string or a list of token ids, got {'a': 1}"),
    (["\ud800"], GREEDY, "request 0: prompt is not valid Unicode text (it holds a lone surrogate)"),
    ("hello", GREEDY, "prompts must be a list of strings or token-id lists, got str"),
    ([[3]], {"temperature": 0}, "request 0: params must be a SamplingParams, got dict"),
    ([[3], [4], [5]], [GREEDY, GREEDY], "3 prompts but 2 SamplingParams"),
    ([[3]], SamplingParams(seed="abc"), "request 0: seed must be an integer, got 'abc'"),
    ([[3], [4]], [GREEDY, SamplingParams(max_tokens=0)], "request 1: max_tokens must be an integer in [1, 2147483647], got 0"),
    ([[3]], SamplingParams(top_p=math.nan), "request 0: top_p must be a number in (0, 1], got nan"),
    ([[3]], SamplingParams(max_tokens=10**5000), "request 0: max_tokens must be an integer in [1, 2147483647], "
                                                 "got an integer too long to print"),
])
def test_api_bad_input_raises_and_leaves_the_llm_usable(llm, prompts, params, message):
    before = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    with pytest.raises(NanoError) as e:
        llm.generate(prompts, params)
    assert str(e.value) == message
    check_invariants(llm.engine)
    assert not llm.engine.has_unfinished()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == before


def test_api_failure_inside_a_step_drops_only_that_call(llm, monkeypatch):
    """Anything raising mid-generate (here: a forward pass that fails once, as an interrupt
    would) frees that call's requests; the next call gives what a fresh one would."""
    before = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    forward = llm.engine.forward
    calls = []

    def fail_on_third(batch):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return forward(batch)

    monkeypatch.setattr(llm.engine, "forward", fail_on_third)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS * 3, GREEDY)
    check_invariants(llm.engine)
    assert not llm.engine.has_unfinished()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == before


def test_api_unknown_engine_argument(tiny_model):
    with pytest.raises(NanoError, match="unknown engine argument 'num_blockz'"):
        LLM(model=str(tiny_model), num_blockz=16)
    with pytest.raises(NanoError, match="--num-blocks must be an integer >= 1, got '16'"):
        LLM(model=str(tiny_model), num_blocks="16")


def test_api_key_scheme_must_be_one_nano_has(tiny_model):
    with pytest.raises(NanoError, match="^--kv-int8-keys must be token or rotate, got 'channel'$"):
        LLM(model=str(tiny_model), kv_cache_dtype="int8", kv_int8_keys="channel")


def test_rotated_int8_keys_need_a_power_of_two_head_dim(tmp_path):
    """The Hadamard key rotation (int8's default) needs a power-of-two head dim: a model of
    another is refused as it loads, naming the way out, not met mid-step."""
    from reference import make_random_model
    model = str(make_random_model(tmp_path / "m", hidden=48, layers=1, intermediate=32))
    with pytest.raises(NanoError, match=r"^--kv-int8-keys rotate needs a power-of-two head dim, the model's is "
                                        r"12 \(give --kv-int8-keys token\)$"):
        LLM(model=model, kv_cache_dtype="int8", num_blocks=8)
    out = LLM(model=model, kv_cache_dtype="int8", kv_int8_keys="token", num_blocks=8).generate(
        [[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))
    assert len(out[0].token_ids) == 2


def test_api_policy_is_a_class_not_a_name(tiny_model):
    """The scheduling policy is chosen as its class (nano/policy.py); a name is refused before
    the model loads, not met as a TypeError after."""
    with pytest.raises(NanoError, match="policy must be a policy class \\(nano/policy.py\\), got 'deadline'"):
        LLM(model=str(tiny_model), policy="deadline")
    assert type(LLM(model=str(tiny_model), num_blocks=16, policy=Deadline).engine.scheduler.policy) is Deadline


# ---- fuzz: random malformed JSONL --------------------------------------------------------
VALUES = [None, True, False, "", "5", "\udc80", 0, -1, 1, 7, 4.5, -0.0, 2**70, -2**70, 1e308,
          math.nan, math.inf, -math.inf, [], [1], {}, {"a": [1, {"b": None}]}]
FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "ttft_slo_ms", "tpot_slo_ms"]


def fuzz_line(rng: random.Random) -> bytes:
    record = {"prompt": rng.choice(["hi", "", "é ü 你好", "a\u0000b", "x" * 300])}
    for name in rng.sample(FIELDS[1:], rng.randrange(3)):
        record[name] = rng.choice([1, 0.5, 100, 3])
    kind = rng.randrange(8)
    if kind == 0:    # a field of a random type or value
        record[rng.choice(FIELDS)] = rng.choice(VALUES)
    elif kind == 1:  # an unknown field
        record[rng.choice(["Prompt", "max-tokens", "", "stop"])] = rng.choice(VALUES)
    elif kind == 2:  # nested one level deeper
        record = {"prompt": record} if rng.random() < 0.5 else [record]
    elif kind == 3:  # not an object at all
        record = rng.choice(VALUES)
    text = json.dumps(record, ensure_ascii=rng.random() < 0.5)
    if kind == 4:    # cut short
        text = text[:rng.randrange(len(text))]
    elif kind == 5:  # nested very deeply
        text = "[" * rng.choice([10, 10**4, 10**5]) + text
    data = text.encode("utf-8", "surrogatepass")
    if kind == 6:    # another encoding, a byte-order mark, or bytes that are not UTF-8
        data = rng.choice([text.encode("utf-16"), b"\xef\xbb\xbf" + data, data + b"\xff\xfe", text.encode("latin-1", "replace")])
    return data  # kind 7: left as it is


def test_fuzz_malformed_jsonl(tmp_path, tiny_model):
    """Random malformed lines: each run either ends with one NanoError line (exit 2) or runs
    normally; never another exception (a traceback). A few through the real CLI."""
    rng = random.Random(11)
    outcomes = {"error": 0, "ran": 0}
    for case in range(200):
        path = tmp_path / f"{case}.jsonl"
        path.write_bytes(b"\n".join([GOOD.encode()] * rng.randrange(2) + [fuzz_line(rng)]) + b"\n")
        args = ["--prompt-file", path, "--model", tiny_model, "--no-chat", "--num-blocks", 32, "--max-tokens", 2]
        if case < 4:
            r = run_cli(*args)
            assert "Traceback" not in r.stderr and r.returncode in (0, 2), r.stderr
            if r.returncode == 2:
                assert_one_line_error(r, "")
            continue
        try:
            assert run.main([str(a) for a in args]) == 0
            outcomes["ran"] += 1
        except NanoError as e:
            assert str(e) and "\n" not in str(e), repr(e)
            outcomes["error"] += 1
    assert outcomes["ran"] >= 10 and outcomes["error"] >= 100, outcomes
