"""Tensor parallelism: the shard plan (unit tests), then real runs under mpirun on this CPU:
greedy tokens identical to one rank, the collectives' known answers, and errors that end
every rank with one line instead of a hang."""
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nano.config import ModelConfig
from nano.errors import NanoError
from nano.tp import partition

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain in one sentence what a KV cache is.", "What is 12 times 7?"]
GREEDY = ["--temperature", "0", "--max-tokens", "20"]
TIMEOUT = 180  # seconds for one launch: far above a normal run, well below "hung"


# ---- the shard plan ------------------------------------------------------------------
def config(num_heads: int, num_kv_heads: int, intermediate: int = 1536) -> ModelConfig:
    return ModelConfig(hidden_size=64 * num_heads, intermediate_size=intermediate, num_layers=2,
                       num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64, vocab_size=100,
                       rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
                       max_position_embeddings=128, tie_word_embeddings=True, eos_token_ids=(),
                       windows=(None, None))


@pytest.mark.parametrize("nq,nkv", [(9, 3), (32, 8), (12, 4), (8, 1), (6, 6), (14, 2)])
def test_plan_covers_every_head_once_and_keeps_groups_together(nq, nkv):
    cfg, group = config(nq, nkv), nq // nkv
    for world in range(1, nq + 1):
        plans = [partition(cfg, r, world) for r in range(world)]
        q_heads = [h for p in plans for h in p.q_heads]
        assert q_heads == list(range(nq)), (world, q_heads)  # each once, contiguous, in rank order
        assert {h for p in plans for h in p.kv_heads} == set(range(nkv))
        for p in plans:
            assert p.num_heads >= 1 and p.num_kv_heads >= 1
            assert {h // group for h in p.q_heads} == set(p.kv_heads), (world, p)
            assert p.num_heads % p.num_kv_heads == 0  # the model's local GQA grouping
            if world <= nkv:  # KV heads split, never copied
                assert p.num_heads == group * p.num_kv_heads
        inter = [i for p in plans for i in range(cfg.intermediate_size)[p.inter]]
        assert inter == list(range(cfg.intermediate_size))


def test_uneven_split_gives_first_ranks_the_extra_kv_group():
    plans = [partition(config(9, 3), r, 2) for r in range(2)]
    assert [list(p.kv_heads) for p in plans] == [[0, 1], [2]]
    assert [list(p.q_heads) for p in plans] == [[0, 1, 2, 3, 4, 5], [6, 7, 8]]


def test_more_ranks_than_kv_heads_replicates_kv_and_splits_query_heads():
    plans = [partition(config(9, 3), r, 4) for r in range(4)]
    assert [list(p.kv_heads) for p in plans] == [[0], [0], [1], [2]]
    assert [list(p.q_heads) for p in plans] == [[0, 1], [2], [3, 4, 5], [6, 7, 8]]
    plans = [partition(config(9, 3), r, 9) for r in range(9)]
    assert [p.kv_heads.start for p in plans] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_more_ranks_than_query_heads_is_an_error():
    with pytest.raises(NanoError, match="--tp 10 is more ranks than the model's 9 query heads"):
        partition(config(9, 3), 0, 10)


# ---- runs under mpirun ---------------------------------------------------------------
def mpirun() -> str | None:
    local = Path(sys.executable).parent / "mpirun"
    return str(local) if local.exists() else shutil.which("mpirun")


def have_mpi() -> bool:
    try:
        import mpi4py  # noqa: F401  (the import alone does not start MPI)
    except ImportError:
        return False
    return mpirun() is not None


needs_mpi = pytest.mark.skipif(not have_mpi(), reason="needs mpi4py and mpirun")


def launch(args: list[str], ranks: int | None = None) -> subprocess.CompletedProcess:
    """python ARGS, under `mpirun -n RANKS` unless ranks is None. One BLAS thread per
    process: 3 ranks on 2 cores are slow enough without threads fighting over them."""
    cmd = [sys.executable, *args]
    if ranks is not None:
        cmd = [mpirun(), "-n", str(ranks), "--allow-run-as-root", "--oversubscribe", *cmd]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def generate(prompt_file, tmp_path, ranks: int | None, *flags) -> tuple[list[list[int]], str]:
    """Token ids per prompt and the summary text of one run.py run."""
    out = tmp_path / f"out-{ranks}-{len(list(tmp_path.iterdir()))}.jsonl"
    tp = ["--tp", str(ranks)] if ranks else []
    proc = launch(["run.py", "--prompt-file", str(prompt_file), "--output", str(out),
                   *GREEDY, *tp, *flags], ranks)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line)["token_ids"] for line in out.read_text().splitlines()], proc.stdout


@pytest.fixture(scope="module")
def one_rank_tokens(prompt_file, tmp_path_factory):
    tokens, _ = generate(prompt_file, tmp_path_factory.mktemp("tp1"), None)
    assert all(len(t) > 1 for t in tokens)
    return tokens


@needs_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_collectives_known_answers(ranks):
    proc = launch(["tests/tp_collectives.py"], ranks)
    assert proc.returncode == 0 and proc.stdout.strip() == f"ok {ranks}", proc.stderr[-3000:]


@needs_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_greedy_tokens_match_one_rank(prompt_file, tmp_path, one_rank_tokens, ranks):
    tokens, summary = generate(prompt_file, tmp_path, ranks)
    assert tokens == one_rank_tokens
    # Two all-reduces per layer of (tokens, hidden) float32: at least one decode row per step.
    per_step = float(re.search(r"all-reduce .* and ([\d.]+) MB per step", summary).group(1))
    assert per_step >= 2 * 30 * 576 * 4 / 1e6


@needs_mpi
@pytest.mark.parametrize("flags,evidence", [
    # A 16-token budget chunks every prompt, and later prompts hit the first one's
    # cached system-prompt block.
    (["--max-num-batched-tokens", "16"], r"prefix cache hits   [1-9]"),
    (["--num-blocks", "8", "--preemption", "swap"], r"preemptions         [1-9]\d* swap"),
    (["--num-blocks", "8", "--preemption", "recompute"], r"[1-9]\d* recompute"),
])
def test_scheduling_features_under_tp2_keep_greedy_tokens(prompt_file, tmp_path, one_rank_tokens,
                                                          flags, evidence):
    tokens, summary = generate(prompt_file, tmp_path, 2, *flags)
    assert re.search(evidence, summary), summary
    assert tokens == one_rank_tokens


@needs_mpi
@pytest.mark.parametrize("scheme", ["rotate"])  # the default; "token" keys run the same collectives
def test_int8_kv_under_tp2_keeps_greedy_tokens(prompt_file, tmp_path, scheme):
    """Each rank quantizes its own KV heads and swaps their scales: the one-rank int8 tokens.
    Six of them: the seventh answer to "What is 12 times 7?" is a near-tie (logits 3e-4 of
    their scale apart) that one int8 step, from TP's other summation order, may flip."""
    int8 = ["--kv-cache-dtype", "int8", "--kv-int8-keys", scheme, "--max-tokens", "6"]
    one_rank, _ = generate(prompt_file, tmp_path, None, *int8)
    # 8-token blocks: four ~40-token prompts grow a block while decoding, and 11 hold two
    tokens, summary = generate(prompt_file, tmp_path, 2, *int8, "--block-size", "8", "--num-blocks", "11",
                               "--preemption", "swap")
    assert re.search(r"preemptions         [1-9]\d* swap", summary), summary
    assert tokens == one_rank


# ---- errors: one line, non-zero exit, every rank ends --------------------------------
def assert_one_line_error(proc, message: str):
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and errors == [f"error: {message}"], proc.stderr[-3000:]
    assert proc.stdout == ""


def test_tp_without_mpirun_is_an_error(prompt_file):
    proc = launch(["run.py", "--tp", "2", "--prompt-file", str(prompt_file)])
    assert_one_line_error(proc, "--tp 2 needs 2 MPI ranks: run mpirun -n 2 python run.py --tp 2 ...")


@needs_mpi
def test_ranks_without_matching_tp_is_an_error(prompt_file):
    proc = launch(["run.py", "--prompt-file", str(prompt_file)], 2)
    assert_one_line_error(proc, "--tp 1 but mpirun started 2 ranks: give --tp 2 or mpirun -n 1")


@needs_mpi
def test_more_ranks_than_query_heads_ends_every_rank(prompt_file):
    proc = launch(["run.py", "--tp", "10", "--prompt-file", str(prompt_file)], 10)
    assert_one_line_error(proc, "--tp 10 is more ranks than the model's 9 query heads")


@needs_mpi
def test_a_failure_on_rank_0_alone_ends_every_rank(tmp_path):
    # Only rank 0 reads the prompts: the other ranks must not wait for it forever.
    missing = tmp_path / "missing.txt"
    proc = launch(["run.py", "--tp", "2", "--prompt-file", str(missing)], 2)
    assert_one_line_error(proc, f"cannot read prompt file {missing}: No such file or directory")


@needs_mpi
def test_a_failure_on_every_rank_is_printed_once(prompt_file, tmp_path):
    proc = launch(["run.py", "--tp", "2", "--prompt-file", str(prompt_file),
                   "--model", str(tmp_path / "nowhere")], 2)
    assert_one_line_error(proc, f"model folder not found: {tmp_path / 'nowhere'}")


@needs_mpi
def test_bad_jsonl_field_and_damaged_model_end_every_rank(tmp_path, tiny_model):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "hi"}\n{"prompt": "hi", "seed": "abc"}\n')
    proc = launch(["run.py", "--tp", "2", "--prompt-file", str(bad), "--model", str(tiny_model)], 2)
    assert_one_line_error(proc, f"{bad} line 2: field seed must be an integer, got 'abc'")
    model = shutil.copytree(tiny_model, tmp_path / "m")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    good = tmp_path / "p.txt"
    good.write_text("hi\n")
    proc = launch(["run.py", "--tp", "2", "--prompt-file", str(good), "--model", str(model)], 2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: {weights} is damaged or truncated: tensor")


@needs_mpi
@pytest.mark.parametrize("rank", [1, 0])
def test_ctrl_c_on_one_rank_ends_every_rank_and_keeps_finished_work(tmp_path, tiny_model, rank):
    """SIGINT to one rank mid-run: every rank ends within seconds (before, SIGINT on rank 1
    hung the job), one error line, and the completions that finished are in the file."""
    interrupt_one_rank(tmp_path, tiny_model, rank, ["--tp", "2"])


def interrupt_one_rank(tmp_path, tiny_model, rank: int, flags: list[str], ranks: int = 2) -> None:
    """`ranks` ranks generating 120 completions two at a time, the first long, the rest short
    (so they finish out of input order) and enough that the job is far from done when the
    first finishes, however many replicas share them; then SIGINT to `rank`: all end within
    10 s with one error line, the finished ones kept, in input order."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"prompt number {i}", "max_tokens": 40 if i else 400}) + "\n"
                               for i in range(120)))
    out = tmp_path / "out.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    job = subprocess.Popen([mpirun(), "-n", str(ranks), "--allow-run-as-root", "--oversubscribe", sys.executable,
                            "run.py", *flags, "--prompt-file", str(prompts), "--model", str(tiny_model),
                            "--no-chat", "--num-blocks", "256", "--output", str(out), "--temperature", "0",
                            "--ignore-eos", "--max-num-seqs", "2"],
                           cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + TIMEOUT
    while not (out.exists() and '"index": 0,' in out.read_text()):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.05)
    os.kill(rank_pid(job.pid, rank), signal.SIGINT)
    start = time.monotonic()
    _, stderr = job.communicate(timeout=TIMEOUT)
    assert time.monotonic() - start < 10 and job.returncode != 0
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == \
        [f"error: rank {rank}: interrupted"], stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) >= 2 and all(len(r["token_ids"]) == (40 if r["index"] else 400) for r in records)
    assert [r["index"] for r in records] == sorted(r["index"] for r in records)


@contextlib.contextmanager
def ended_by_ctrl_c(job):
    """Run the body while the mpirun server `job` serves; then Ctrl-C to the serving rank (rank
    0), on which every rank must end cleanly: exit 0, no error line. A body that fails kills it."""
    try:
        yield
        os.kill(rank_pid(job.pid, 0), signal.SIGINT)
        _, stderr = job.communicate(timeout=60)
        assert job.returncode == 0 and "error:" not in stderr, stderr[-3000:]
    finally:
        if job.poll() is None:
            job.kill()


def rank_pid(root: int, rank: int) -> int:
    """The process of MPI rank `rank` among the descendants of process `root` (mpirun)."""
    def parent(pid: int) -> int:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])

    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            pid = int(proc.name) if f"OMPI_COMM_WORLD_RANK={rank}".encode() in env else 0
            while pid > 1 and pid != root:
                pid = parent(pid)
        except (ValueError, OSError):  # not a process, or one that has just ended
            continue
        if pid == root:
            return int(proc.name)
    raise AssertionError(f"no rank {rank} under process {root}")
