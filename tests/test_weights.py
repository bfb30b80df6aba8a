"""Default model conversion, checkpoint reading, tokenizer, and the dense reference."""

import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import weakref
from contextlib import contextmanager, nullcontext

import numpy as np
import pytest
from safetensors.numpy import save_file
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from nano.chat.template import encode as encode_chat
from nano.chat.template import render as render_chat
from nano.default_model import MODELS, ensure
from nano.default_model.convert import _unpermute
from nano.default_model.fetch import download_gguf
from nano.errors import NanoError
from nano.tokenizer import Tokenizer
from nano.weights import CheckpointReader, load_config, open_model, resolve_model
from reference import DenseLlama, make_random_model

NORM = "model.norm.weight"

CHATML_FRANCE = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def smol():
    return resolve_model(None)


def _llama_cpp_permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf permute (HF rotate-half rows -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------- conversion


def test_conversion_files_and_config(smol):
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (smol / f).is_file()
    cfg = load_config(smol)
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (576, 30, 9)
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]) == (3, 64, 49152)
    assert cfg["rope_theta"] == 100000.0 and cfg["max_position_embeddings"] == 8192
    assert cfg["tie_word_embeddings"] is True and cfg["eos_token_id"] == 2
    names = CheckpointReader(smol).names()
    assert len(names) == 2 + 30 * 9 and "lm_head.weight" not in names
    assert resolve_model("SmolLM2-135M-Instruct") == smol  # second call reuses the folder


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(3 * 64 * 5, dtype=np.float32).reshape(3 * 64, 5)
    assert np.array_equal(_unpermute(_llama_cpp_permute(w, 3), 3), w)


def test_safetensors_equal_gguf_dequantized(smol, tmp_path):
    gguf = pytest.importorskip("gguf")
    name = "SmolLM2-135M-Instruct"
    reader = gguf.GGUFReader(download_gguf(name, MODELS[name], tmp_path))
    gguf_tensors = {t.name: t for t in reader.tensors}
    ckpt = CheckpointReader(smol)
    checks = [  # (gguf name, HF name, heads the rows were permuted with)
        ("token_embd.weight", "model.embed_tokens.weight", None),
        ("output_norm.weight", "model.norm.weight", None),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", 9),
        ("blk.7.attn_k.weight", "model.layers.7.self_attn.k_proj.weight", 3),
        ("blk.29.attn_v.weight", "model.layers.29.self_attn.v_proj.weight", None),
        ("blk.12.ffn_down.weight", "model.layers.12.mlp.down_proj.weight", None),
        ("blk.3.attn_norm.weight", "model.layers.3.input_layernorm.weight", None),
    ]
    for gname, hname, heads in checks:
        t = gguf_tensors[gname]
        expected = gguf.quants.dequantize(t.data, t.tensor_type)
        got = ckpt.get(hname)
        if heads:
            got = _llama_cpp_permute(got, heads)
        assert got.dtype == np.float32 and np.array_equal(got, expected), hname


def test_real_model_answers_paris(smol):
    tok = Tokenizer(smol)
    prompt = render_chat(tok, "What is the capital of France?")
    out = DenseLlama(smol).greedy(tok.encode(prompt), 30, tok.eos_token_ids)
    assert tok.decode(out).startswith("The capital of France is Paris.")


def test_chat_template_renders_chatml_with_default_system_prompt(smol):
    tok = Tokenizer(smol)
    assert render_chat(tok, "What is the capital of France?") == CHATML_FRANCE
    ids = tok.encode(CHATML_FRANCE)
    assert ids[0] == 1 and ids[-4:] == [1, 520, 9531, 198]  # <|im_start|> is one token; no BOS added
    assert tok.eos_token_ids == {2}


# ---------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("text", ["Hello, world!", "  two  spaces\tand\ttabs\n", "2024-11-30 12:00",
                                  "naïve café 東京 🙂", ""])
def test_tokenizer_round_trip(smol, text):
    tok = Tokenizer(smol)
    assert tok.decode(tok.encode(text)) == text


def test_tokenizer_digits_and_specials(smol):
    tok = Tokenizer(smol)
    assert len(tok.encode("2024")) == 4  # digits are split one by one
    assert tok.encode("<|im_end|>") == [2]
    assert tok.decode(tok.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


def test_byte_tokenizer_of_random_model(tmp_path):
    tok = Tokenizer(make_random_model(tmp_path, vocab=300))
    text = "héllo 123 <x>"
    assert tok.decode(tok.encode(text)) == text
    assert tok.hf.get_vocab_size() == 300 and tok.eos_token_ids == {2}
    assert render_chat(tok, "hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_message_hides_the_special_tokens_of_its_own_tokenizer(tmp_path):
    """The chat template keeps special-token text in a message plain with the special tokens of
    the tokenizer it is given, which it remembers per tokenizer and lets go of with it: a second
    tokenizer's own special token, after the first's conversation, is text too."""
    folder = make_random_model(tmp_path, vocab=300)
    first = Tokenizer(folder)
    hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    hf.add_special_tokens([AddedToken("<|tool|>", special=True, normalized=False)])
    hf.save(str(folder / "tokenizer.json"))
    second = Tokenizer(folder)
    messages = [{"role": "user", "content": "a <|tool|> b <|im_end|>"}]
    specials = {second.hf.token_to_id(t) for t in ("<|tool|>", "<|im_end|>")}
    for tok in (first, second):
        ids = encode_chat(tok, messages)
        assert sum(i in specials for i in ids) == 1  # the template's own <|im_end|>
        assert tok.decode(ids, skip_special_tokens=False) == render_chat(tok, messages)
    gone = weakref.ref(second)
    del second, tok
    gc.collect()
    assert gone() is None


# ---------------------------------------------------------------- checkpoint reader


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_checkpoint_reader_dtypes_and_slices(tmp_path, dtype):
    ref = CheckpointReader(make_random_model(tmp_path / "f32", seed=3))
    ckpt = CheckpointReader(make_random_model(tmp_path / dtype, dtype=dtype, seed=3))
    assert sorted(ckpt.names()) == sorted(ref.names())
    for name in ckpt.names():
        full = ckpt.get(name)
        assert full.dtype == np.float32 and full.flags.c_contiguous
        assert full.shape == ckpt.shape(name) == ref.shape(name)
        exact = ref.get(name)
        if dtype == "bfloat16":  # no numpy bfloat16: check the rounding bound and the zero low half
            assert np.all(np.abs(full - exact) <= 2**-8 * np.abs(exact))
            assert not np.any(full.view(np.uint32) & 0xFFFF)
        else:
            assert np.array_equal(full, exact.astype(dtype).astype(np.float32))
    w = "model.layers.1.self_attn.q_proj.weight"
    full = ckpt.get(w)
    for rows, cols in [(slice(16, 48), None), (None, slice(8, 40)), (slice(0, 32), slice(32, 64))]:
        part = ckpt.get(w, rows=rows, cols=cols)
        assert part.flags.c_contiguous
        assert np.array_equal(part, full[rows or slice(None), cols or slice(None)])
    assert np.array_equal(ckpt.get("model.norm.weight", rows=slice(5, 9)), ckpt.get("model.norm.weight")[5:9])


def test_checkpoint_reader_errors(tmp_path):
    save_file({"x": np.zeros((2, 2), np.int32)}, str(tmp_path / "model.safetensors"))
    ckpt = CheckpointReader(tmp_path)
    with pytest.raises(NanoError, match="dtype"):
        ckpt.get("x")
    with pytest.raises(NanoError, match="not found"):
        ckpt.get("y")


def test_sharded_checkpoint(tmp_path):
    model = make_random_model(tmp_path / "m")
    full = CheckpointReader(model)
    tensors = {n: full.get(n) for n in full.names()}
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for fname, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(sharded / fname))
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = CheckpointReader(sharded)
    assert sorted(ckpt.names()) == names
    for n in names:
        assert np.array_equal(ckpt.get(n), tensors[n])
    w = "model.layers.0.mlp.down_proj.weight"
    assert np.array_equal(ckpt.get(w, rows=slice(10, 20)), tensors[w][10:20])


def edit_header(edit):
    """A safetensors file's damage: its header's JSON text replaced by edit(header as a dict),
    the tensor bytes kept. Takes and returns the file's bytes."""
    def apply(data: bytes) -> bytes:
        n = int.from_bytes(data[:8], "little")
        text = edit(json.loads(data[8:8 + n])).encode()
        return len(text).to_bytes(8, "little") + text + data[8 + n:]
    return apply


@pytest.mark.parametrize("key,value", [("shape", "[1e999, 64]"), ("data_offsets", "[0, 1e999]"),
                                       ("dtype", '["F32"]')])
def test_damaged_header_entry(tmp_path, tiny_model, key, value):
    """A size of 1e999 (a float to JSON) or a dtype that is not a string: damage, not a traceback."""
    path = shutil.copytree(tiny_model, tmp_path / "m") / "model.safetensors"

    def edit(header):
        header[NORM][key] = "MARK"
        return json.dumps(header).replace('"MARK"', value)

    path.write_bytes(edit_header(edit)(path.read_bytes()))
    with pytest.raises(NanoError, match=f"model.safetensors is damaged or truncated: bad header entry for {NORM}: "):
        CheckpointReader(path.parent)


def test_safetensors_header_past_the_formats_cap(tmp_path):
    """The format caps a header at 100 MB: a larger one is damage, refused before it is read."""
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write((2 * 10**8).to_bytes(8, "little"))
        f.truncate(2 * 10**8 + 64)  # sparse: no disk used
    with pytest.raises(NanoError, match="its header says 200000000 bytes, but the file has 200000064 and headers "
                                        "are <= 100 MB"):
        CheckpointReader(tmp_path)


@contextmanager
def never_waiting_on(fifo, seconds: float = 10):
    """A block that reads `fifo` and must never wait for a writer (opening a FIFO for reading
    does): past `seconds` a writer process comes and goes, which ends any wait (also one in code
    that holds the GIL, where no thread or signal handler of ours would run), and the block fails."""
    writer = subprocess.Popen(["sh", "-c", f'sleep {seconds} && : > "$0"', str(fifo)])
    start = time.monotonic()
    try:
        yield
    finally:
        writer.kill()
        writer.wait()
    assert time.monotonic() - start < seconds, f"waited for a writer to {fifo}"


SMALL, LARGE = "must be a regular file of at most 16 MiB", "must be a regular file of at most 256 MiB"


@pytest.mark.parametrize("name,kind,message", [
    ("config.json", "fifo", SMALL), ("tokenizer.json", "fifo", LARGE), ("tokenizer_config.json", "fifo", SMALL),
    ("model.safetensors", "fifo", "is not a regular file"), ("config.json", "/dev/zero", SMALL),
    ("tokenizer.json", "/dev/zero", LARGE), ("tokenizer_config.json", "large", SMALL),
])
def test_model_files_must_be_regular_files_of_bounded_size(tmp_path, tiny_model, name, kind, message):
    """A FIFO would block (or, skipped, lose the chat template and EOS), a device never end, a
    huge file cost its size: each is one line naming the file, before the weights load."""
    folder = shutil.copytree(tiny_model, tmp_path / "m")
    (folder / name).unlink()
    if kind == "fifo":
        os.mkfifo(folder / name)
    elif kind == "large":
        with open(folder / name, "wb") as f:
            f.truncate(17 * 2**20)  # sparse
    else:
        (folder / name).symlink_to(kind)
    with never_waiting_on(folder / name) if kind == "fifo" else nullcontext(), pytest.raises(NanoError) as e:
        open_model(str(folder))
    assert str(e.value) == f"{folder / name} {message}"


def test_a_linked_model_file_is_read(tmp_path, tiny_model):
    folder = shutil.copytree(tiny_model, tmp_path / "m", symlinks=True)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to(tiny_model / "tokenizer.json")
    assert open_model(str(folder)).tokenizer.num_ids == 512


@pytest.mark.parametrize("edit,message", [
    ({"chat_template": 42}, "chat_template must be a string, got 42"),
    ({"chat_template": [1, 2]}, "chat_template must be a string, got [1, 2]"),
    ({"bos_token": 5, "add_bos_token": True}, "bos_token must be a string, got 5"),
    ({"eos_token": {"content": ["x"]}}, "eos_token must be a string, got ['x']"),
    ({"add_bos_token": "yes"}, "add_bos_token must be true or false, got 'yes'"),
    ({"bos_token": "<nope>", "add_bos_token": True}, "bos_token '<nope>' is not a token of"),
])
def test_tokenizer_config_fields_of_the_wrong_type(tmp_path, tiny_model, edit, message):
    folder = shutil.copytree(tiny_model, tmp_path / "m")
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    with pytest.raises(NanoError) as e:
        Tokenizer(folder)
    assert str(e.value).startswith(f"{path} {message}")


def test_named_chat_templates(tmp_path, tiny_model):
    folder = shutil.copytree(tiny_model, tmp_path / "m")
    path = folder / "tokenizer_config.json"
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": templates}))
    assert Tokenizer(folder).chat_template == "D"


def test_tokenizer_ids_past_the_embedding_are_refused_at_load(tmp_path, tiny_model):
    """A tokenizer that makes ids the embedding has no row for would crash a run mid-way (an
    IndexError in the embedding lookup, the other prompts lost): refused before the weights load."""
    folder = shutil.copytree(tiny_model, tmp_path / "m")
    shutil.copy(make_random_model(tmp_path / "big", vocab=600) / "tokenizer.json", folder / "tokenizer.json")
    with pytest.raises(NanoError) as e:
        open_model(str(folder))
    assert str(e.value) == f"{folder / 'tokenizer.json'} has token ids up to 599, past config.json vocab_size 512"
    assert open_model(str(folder), tokenizer=False).config.vocab_size == 512  # TP ranks > 0 load no tokenizer


# ---------------------------------------------------------------- resolve_model


def test_resolve_model_errors(tmp_path):
    with pytest.raises(NanoError, match="model folder not found"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(NanoError, match="no config.json"):
        resolve_model(str(tmp_path))
    assert resolve_model(str(make_random_model(tmp_path / "m"))) == tmp_path / "m"


def default_model_in(tmp_path, monkeypatch):
    """A weights/ folder under tmp_path holding a (tiny, random) default model, and a fake
    conversion that rebuilds it and counts its calls: the real one downloads 98 MB."""
    import nano.default_model.fetch
    import nano.weights
    monkeypatch.setattr(nano.weights, "WEIGHTS_DIR", tmp_path)
    folder = tmp_path / nano.weights.DEFAULT_MODEL
    make_random_model(folder)
    fetches = []

    def fetch(folder):
        fetches.append(folder)
        shutil.rmtree(folder)
        make_random_model(folder)

    monkeypatch.setattr(nano.default_model.fetch, "fetch", fetch)
    return folder, fetches


@pytest.mark.parametrize("name,keep", [("model.safetensors", 5000), ("model.safetensors", 7),
                                       ("config.json", 20), ("tokenizer.json", 100)])
def test_damaged_default_model_is_converted_again(tmp_path, monkeypatch, capsys, name, keep):
    folder, fetches = default_model_in(tmp_path, monkeypatch)
    ensure()
    assert open_model(None).config.hidden_size == 64 and not fetches  # intact: used as it is
    (folder / name).write_bytes((folder / name).read_bytes()[:keep])   # an interrupted copy
    ensure()
    opened = open_model(None)
    assert fetches == [folder] and opened.path == folder and opened.tokenizer is not None
    err = capsys.readouterr().err
    assert err.startswith("weights/SmolLM2-135M-Instruct is damaged (") and str(folder / name) in err


def test_damaged_user_model_is_an_error_not_a_download(tmp_path, monkeypatch):
    _, fetches = default_model_in(tmp_path / "weights", monkeypatch)
    folder = make_random_model(tmp_path / "mine")
    (folder / "config.json").write_text("{")
    with pytest.raises(NanoError, match="config.json is not valid JSON"):
        open_model(str(folder))
    assert not fetches


def test_stale_download_folders_are_removed(tmp_path, monkeypatch):
    """A fetch killed mid-download leaves its scratch folder (~190 MB): the next run on its
    host removes it (named in the old way, without the host, too), but not one whose process
    is still running (another run converting right now), nor another host's: its process
    ids mean nothing here (a weights/ folder shared between hosts)."""
    default_model_in(tmp_path, monkeypatch)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    host = socket.gethostname()
    stale = [tmp_path / f".fetch-{host}-{gone}-abc", tmp_path / f".fetch-{gone}-abc", tmp_path / ".fetch-xyz"]
    live = [tmp_path / f".fetch-{host}-{os.getpid()}-def",
            tmp_path / f".fetch-other-host-{gone}-ghi"]  # in a folder shared with a host that may be filling it
    for d in stale + live:
        (d / "out").mkdir(parents=True)
        (d / "out" / "model.safetensors").write_bytes(b"partial")
    ensure()
    assert not any(d.exists() for d in stale) and all(d.exists() for d in live)


# ---------------------------------------------------------------- reference model


@pytest.mark.parametrize("kw", [{}, {"tie": False, "bias": True, "heads": 8, "kv_heads": 1}])
def test_dense_reference_cache_matches_full_forward(tmp_path, kw):
    model = DenseLlama(make_random_model(tmp_path, **kw))
    prompt = [5, 17, 300, 42, 7]
    out = model.greedy(prompt, 12)
    logits = model.logits(prompt + out)
    assert logits.shape == (len(prompt) + len(out), 512)
    assert list(np.argmax(logits[len(prompt) - 1:-1], axis=-1)) == out


def test_uniform_random_model_draws_like_the_normal_one(tmp_path):
    """make_random_model(uniform=True), the fast build for real shapes (the GPU tests): each
    tensor uniform with the normal draws' mean and std, seeded, a new draw for every block."""
    kw = dict(hidden=256, intermediate=512, vocab=1024, tie=False, bias=True, dtype="float16", seed=4)
    normal, uniform, again = (CheckpointReader(make_random_model(tmp_path / name, uniform=name != "normal", **kw))
                              for name in ("normal", "uniform", "again"))
    for name in normal.names():
        n, u = normal.get(name), uniform.get(name)
        tol = 6 * n.std() / np.sqrt(n.size)  # a few standard errors of both estimates
        assert u.shape == n.shape and np.array_equal(u, again.get(name))
        assert abs(u.mean() - n.mean()) <= tol and abs(u.std() - n.std()) <= tol, name
    embed = uniform.get("model.embed_tokens.weight").ravel()
    assert not np.array_equal(embed[:2**16], embed[2**16:2**17])


# ---------------------------------------------------------------- the checkpoint's tensors against the forward's


def with_tensors(folder, add=(), drop=(), **config):
    """The folder's checkpoint with tensors added (1-D, zeros) or dropped, config.json edited."""
    reader = CheckpointReader(folder)
    tensors = {n: reader.get(n) for n in reader.names() if n not in drop} | {n: np.zeros(8, np.float32) for n in add}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(load_config(folder) | config))
    return folder


QWEN3_NORMS = [f"model.layers.{i}.self_attn.{n}_norm.weight" for i in range(2) for n in ("q", "k")]


@pytest.mark.parametrize("kw,change,message", [
    ({}, dict(add=QWEN3_NORMS),  # a Qwen3 checkpoint that says it is a Llama
     "checkpoint tensor model.layers.0.self_attn.k_norm.weight is not used by the Llama forward (3 more)"),
    ({"bias": True}, dict(add=["model.layers.1.self_attn.o_proj.bias"]),  # transformers' Llama attention_bias
     "checkpoint tensor model.layers.1.self_attn.o_proj.bias is not used by the Llama forward"),
    ({"bias": True}, dict(attention_bias=False),
     "checkpoint tensor model.layers.0.self_attn.k_proj.bias is not used by the Llama forward (5 more)"),
    ({}, dict(attention_bias=True),
     "checkpoint has no tensor model.layers.0.self_attn.k_proj.bias, which the Llama forward reads (5 more)"),
    ({}, dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", attention_bias=True),  # Qwen2 has q/k/v biases
     "checkpoint has no tensor model.layers.0.self_attn.k_proj.bias, which the Qwen2 forward reads (5 more)"),
    ({}, dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16),  # Qwen3 has q/k norms
     "checkpoint has no tensor model.layers.0.self_attn.k_norm.weight, which the Qwen3 forward reads (3 more)"),
    ({}, dict(drop=["model.layers.1.mlp.up_proj.weight"]),
     "checkpoint has no tensor model.layers.1.mlp.up_proj.weight, which the Llama forward reads"),
    ({}, dict(tie_word_embeddings=False), "checkpoint has no tensor lm_head.weight, which the Llama forward reads"),
])
def test_every_checkpoint_tensor_is_one_the_forward_reads(tmp_path, kw, change, message):
    folder = with_tensors(make_random_model(tmp_path, layers=2, **kw), **change)
    with pytest.raises(NanoError) as e:
        open_model(folder)
    assert str(e.value) == message


def test_tensors_that_carry_nothing_the_forward_needs_are_let_be(tmp_path):
    """As transformers does: rotary_emb.inv_freq buffers (older checkpoints; RoPE comes from
    config.json) and a tied checkpoint's lm_head.weight (the head is the embedding)."""
    folder = with_tensors(make_random_model(tmp_path, tie=True),
                          add=["model.layers.0.self_attn.rotary_emb.inv_freq", "lm_head.weight"])
    assert open_model(folder, tokenizer=False).config.tie_word_embeddings


@pytest.mark.parametrize("kw", [{}, {"tie": False, "bias": True}, "qwen3"])
def test_the_loader_reads_exactly_the_checked_tensors(tmp_path, kw):
    """checkpoint_shapes is the one list: load_model reads every tensor of it and no other
    (Qwen3: its q/k norms too, whole on each rank)."""
    from nano.tp import checkpoint_shapes, load_model, partition
    from tests import families

    model = families.make_model(kw, tmp_path) if kw == "qwen3" else make_random_model(tmp_path, **kw)
    folder = open_model(model, tokenizer=False)
    read = set()

    class Recording:
        def __getattr__(self, name):
            return getattr(folder.reader, name)

        def get(self, name, **slices):
            read.add(name)
            return folder.reader.get(name, **slices)

    for rank in range(2):  # a tensor-parallel rank reads its slices of the same tensors
        load_model(Recording(), folder.config, partition(folder.config, rank, 2), lambda a, **_: a, 16)
        assert read == set(checkpoint_shapes(folder.config)) == set(folder.reader.names())
        read.clear()


def test_the_default_model_is_every_tensor_the_forward_reads(smol):
    folder = open_model(smol, tokenizer=False)
    assert folder.config.architecture == "LlamaForCausalLM" and not folder.config.attention_bias
