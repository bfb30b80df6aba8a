"""run.py end to end: the real model's answer, JSONL output, and one-line errors for bad input."""
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(result, fragment):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert fragment in lines[0]


def test_paris_and_rejections_reported_in_order(tmp_path, default_model):
    prompts = tmp_path / "prompts.txt"
    long_prompt = "word " * 400                # far past --max-model-len 256
    prompts.write_text(f"What is the capital of France?\n\n{long_prompt}\nName a colour.\n")
    out = tmp_path / "out.jsonl"
    r = run_cli("--prompt-file", prompts, "--temperature", 0, "--max-tokens", 24,
                "--max-model-len", 256, "--output", out, "--device", "cpu")  # float32 KV, below
    assert r.returncode == 0, r.stderr
    assert "The capital of France is Paris." in r.stdout
    assert "[1] rejected: prompt of" in r.stderr and "model context" in r.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [rec["finish_reason"] for rec in records] == ["stop", "rejected", "stop"]
    assert records[0]["text"] == "The capital of France is Paris."
    assert records[0]["token_ids"][-1] == 2 and records[0]["num_prompt_tokens"] == 37
    assert records[2]["text"]
    assert "requests            3 (1 rejected)" in r.stdout
    assert "KV cache 46080 bytes/token" in r.stderr and "batch ceiling" in r.stderr


def test_request_that_never_fits_the_pool(tmp_path, default_model):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\n" + "word " * 100 + "\n")
    r = run_cli("--prompt-file", prompts, "--no-chat", "--temperature", 0, "--max-tokens", 4,
                "--num-blocks", 4, "--watermark", 0)
    assert r.returncode == 0, r.stderr
    assert "[1] rejected:" in r.stderr and "KV blocks" in r.stderr
    assert "[0] hello there" in r.stdout


def test_bench_small(default_model):
    r = run_cli("--bench", "--num-seqs", 4, "--input-len", "8:16", "--output-len", "4:8")
    assert r.returncode == 0, r.stderr
    assert "bench:" in r.stdout and "output tokens/s" in r.stdout


@pytest.mark.parametrize("tenants", [0, 2])
def test_bench_workload_is_drawn_from_seed(tenants):
    """--seed picks --bench's prompts, their sampling seeds and their arrival times: the same
    seed gives the same workload, another seed another one."""
    from argparse import Namespace
    from types import SimpleNamespace

    from nano.bench.cli import bench_arrivals, bench_requests
    from nano.sequence import SamplingParams
    engine = SimpleNamespace(max_model_len=256, model_config=SimpleNamespace(vocab_size=1000))

    def draw(seed):
        args = Namespace(seed=seed, num_seqs=6, input_len="4:32", output_len="2:9", tenants=tenants,
                         prefix_len=16, request_rate=3.0)
        prompts, params = bench_requests(args, engine, SamplingParams())
        return prompts, [(p.seed, p.max_tokens) for p in params], bench_arrivals(args, 6).tolist()

    assert draw(None) == draw(0) == draw(0)
    assert all(a != b for a, b in zip(draw(0), draw(1)))


@pytest.mark.parametrize("args,fragment", [
    (["--prompt-file", "/nonexistent/prompts.txt"], "cannot read prompt file"),
    (["--prompt-file", "EMPTY"], "has no prompts"),
    (["--prompt-file", "PROMPTS", "--model", "/nonexistent/model"], "model folder not found"),
    (["--prompt-file", "PROMPTS", "--max-tokens", -5], "--max-tokens"),
    (["--prompt-file", "PROMPTS", "--top-p", 0], "--top-p"),
    (["--prompt-file", "PROMPTS", "--top-p", 1.5], "--top-p"),
    (["--prompt-file", "PROMPTS", "--temperature", -1], "--temperature"),
    (["--prompt-file", "PROMPTS", "--block-size", 12], "power of two"),
    (["--prompt-file", "PROMPTS", "--kv-cache-memory", "lots"], "byte size"),
    (["--prompt-file", "PROMPTS", "--preemption", "never"], "--preemption"),
    (["--prompt-file", "PROMPTS", "--dtype", "half"], "--dtype must be auto, bfloat16, float16 or float32, got 'half'"),
    (["--prompt-file", "PROMPTS", "--max-num-batched-tokens", 0], "max-num-batched-tokens"),
    (["--prompt-file", "PROMPTS", "--no-such-flag"], "unrecognized arguments"),
    (["--bench", "--input-len", "10:5"], "--input-len"),
    (["--bench", "--request-rate", "-2"], "--request-rate"),
    (["--prompt-file", "PROMPTS", "--drop-late"], "--drop-late needs --policy deadline"),
    (["--prompt-file", "PROMPTS", "--policy", "edf"], "--policy"),
    (["--prompt-file", "PROMPTS", "--ttft-slo", "0"], "--ttft-slo"),
    (["--prompt-file", "BADJSONL"], "line 2: not JSON"),
    (["--prompt-file", "BADFIELD"], "line 1: unknown field 'colour'"),
    (["--prompt-file", "BADVALUE"], "line 1: field top_p must be a number in (0, 1], got 7"),
    ([], "--prompt-file"),
    (["--prompt-file", "PROMPTS", "--speculative-config", '{"num_speculative_tokens": 0}'],
     "--speculative-config: num_speculative_tokens must be an integer in [1, 64], got 0"),
    (["--prompt-file", "PROMPTS", "--speculative-config",
      '{"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}'],
     "prompt_lookup_min (4) must be at most prompt_lookup_max (2)"),
    (["--prompt-file", "PROMPTS", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'],
     "method 'eagle' is not supported"),
    (["--prompt-file", "PROMPTS", "--speculative-config", '{"num_speculative_tokens": 2, "model": "x"}'],
     "key 'model' is not supported"),
    (["--prompt-file", "PROMPTS", "--speculative-config", "ngram"], "--speculative-config is not valid JSON"),
    *[(["--prompt-file", "PROMPTS", "--speculative-config", value], "--speculative-config must be a JSON object, got")
      for value in ("[]", "false", "0", "null")],  # none of them is a config, not even an empty one
    (["--serve", "--model", "/nonexistent/model", "--speculative-config", "{'k': 2}"],
     "--speculative-config is not valid JSON"),  # before the model's folder is looked at
    (["--capacity", "--speculative-config", '{"num_speculative_tokens": 2}'], "drop --speculative-config"),
])
def test_bad_input_one_line_error(tmp_path, args, fragment):
    (tmp_path / "empty.txt").write_text("\n  \n\n")
    (tmp_path / "prompts.txt").write_text("hi\n")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "hi"}\n{prompt: hi}\n')
    (tmp_path / "field.jsonl").write_text('{"prompt": "hi", "colour": "red"}\n')
    (tmp_path / "value.jsonl").write_text('{"prompt": "hi", "top_p": 7}\n')
    names = {"EMPTY": tmp_path / "empty.txt", "PROMPTS": tmp_path / "prompts.txt",
             "BADJSONL": tmp_path / "bad.jsonl", "BADFIELD": tmp_path / "field.jsonl",
             "BADVALUE": tmp_path / "value.jsonl"}
    r = run_cli(*[names.get(a, a) if isinstance(a, str) else a for a in args])
    assert_one_line_error(r, fragment)


def test_jsonl_prompts_with_targets_and_capacity(tmp_path, default_model):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "What is the capital of France?", "ttft_slo_ms": 60000, "max_tokens": 12}\n'
                       '{"prompt": "Name a colour.", "tpot_slo_ms": 60000, "temperature": 0.5, "seed": 3}\n')
    r = run_cli("--prompt-file", prompts, "--temperature", 0, "--policy", "deadline")
    assert r.returncode == 0, r.stderr
    assert "The capital of France is Paris." in r.stdout
    assert "SLO attainment      100.0% of requests" in r.stdout
    report = run_cli("--capacity", "--kv-cache-memory", "1GB", "--device", "cpu")  # float32 KV
    assert report.returncode == 0, report.stderr
    assert "KV cache per token  46080 bytes" in report.stdout and "without GQA it would be 138240" in report.stdout
    assert "8192" in report.stdout


def test_broken_model_folder_and_output_path(tmp_path, default_model):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"hidden_size": 8}')
    (tmp_path / "p.txt").write_text("hi\n")
    assert_one_line_error(run_cli("--prompt-file", tmp_path / "p.txt", "--model", tmp_path / "m"),
                          "not a Llama-family config")
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "m" / name).unlink(missing_ok=True)
        (tmp_path / "m" / name).symlink_to(default_model / name)
    assert_one_line_error(run_cli("--prompt-file", tmp_path / "p.txt", "--model", tmp_path / "m"),
                          "tokenizer.json")
    assert_one_line_error(run_cli("--prompt-file", tmp_path / "p.txt", "--output", tmp_path / "no" / "o.jsonl"),
                          "cannot write")


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("stderr", [_Terminal, io.StringIO])
def test_progress_is_a_tqdm_bar_on_a_terminal_and_nothing_elsewhere(monkeypatch, stderr):
    from nano.cli.output import Progress
    monkeypatch.setattr(sys, "stderr", stderr())
    progress = Progress(3)
    for finished, generated in ((0, 0), (1, 10), (2, 30)):
        progress.update(finished, generated)
    shown = sys.stderr.getvalue()
    if stderr is _Terminal:
        assert "3/3" in shown and "req" in shown and "tok/s" in shown and shown.endswith("\n"), shown
    else:
        assert shown == ""


def test_a_reader_that_leaves_ends_the_run_quietly(tmp_path, tiny_model):
    """`run.py ... | head -1`: the pipe closes while completions are printed; the run ends at
    once with SIGPIPE's status (141), as cat would, and no traceback."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n" * 8)
    job = subprocess.Popen([sys.executable, str(ROOT / "run.py"), "--prompt-file", prompts, "--model", tiny_model,
                            "--max-tokens", "4", "--no-chat"], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    job.stdout.readline()
    job.stdout.close()
    assert job.wait(timeout=120) == 141
    assert "Traceback" not in job.stderr.read()


SPECULATIVE = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}'


@pytest.fixture(scope="module")
def looping(tmp_path_factory, tiny_model):
    """Prompts for the tiny random model, whose greedy answers soon repeat themselves (drafts
    to accept), and their tokens from one engine without speculation."""
    path = tmp_path_factory.mktemp("spec")
    prompts = path / "prompts.txt"
    prompts.write_text("The list: apples, pears, plums.\nName a colour.\n")
    args = ["--model", tiny_model, "--prompt-file", prompts, "--temperature", 0, "--max-tokens", 40, "--device", "cpu"]
    r = run_cli(*args, "--output", path / "plain.jsonl", "--summary-json", path / "plain.json")
    assert r.returncode == 0, r.stderr
    plain = [json.loads(line)["token_ids"] for line in (path / "plain.jsonl").read_text().splitlines()]
    return args, plain, json.loads((path / "plain.json").read_text()), r.stdout


def test_speculative_config_keeps_the_greedy_output(tmp_path, looping, tiny_model):
    """--speculative-config: the same greedy tokens as without, in fewer steps, and the
    summary's acceptance line; --bench runs with it too."""
    args, plain, plain_summary, plain_out = looping
    out = tmp_path / "spec.jsonl"
    r = run_cli(*args, "--output", out, "--summary-json", tmp_path / "spec.json", "--speculative-config", SPECULATIVE)
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "spec.json").read_text())
    assert [json.loads(line)["token_ids"] for line in out.read_text().splitlines()] == plain
    assert summary["steps"] < plain_summary["steps"]
    assert summary["spec_decode_num_accepted_tokens"] > 0 and "spec_decode_num_drafts" not in plain_summary
    assert summary["spec_decode_mean_acceptance_length"] == pytest.approx(
        1 + summary["spec_decode_num_accepted_tokens"] / summary["spec_decode_num_drafts"])
    assert "speculative decoding" in r.stdout and "speculative decoding" not in plain_out
    bench = run_cli("--model", tiny_model, "--bench", "--num-seqs", 2, "--input-len", "8", "--output-len", "8",
                    "--speculative-config", SPECULATIVE)
    assert bench.returncode == 0, bench.stderr


@pytest.mark.parametrize("flags,ranks", [(["--tp", "2"], 2)])
def test_speculative_config_under_mpirun(tmp_path, looping, flags, ranks):
    """A run over ranks gives its engines the proposer (under --tp, rank 0's): the tokens of
    one engine without it, and drafts accepted (disaggregated serving with speculation:
    tests/test_disagg.py, in one process)."""
    from test_tp import have_mpi, launch
    if not have_mpi():
        pytest.skip("needs mpi4py and mpirun")
    args, plain, _, _ = looping
    proc = launch(["run.py", *map(str, args), *flags, "--output", str(tmp_path / "spec.jsonl"), "--summary-json",
                   str(tmp_path / "spec.json"), "--speculative-config", SPECULATIVE], ranks)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [json.loads(line)["token_ids"] for line in (tmp_path / "spec.jsonl").read_text().splitlines()] == plain
    summary = json.loads((tmp_path / "spec.json").read_text())
    assert summary["spec_decode_num_accepted_tokens"] > 0, proc.stdout
