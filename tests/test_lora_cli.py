"""run.py's LoRA flags (nano/lora/cli.py): a prompt file whose JSONL lines name adapters of
--lora-modules (both spellings) gets the Python API's tokens for each, and every kind of bad
input is one `error:` line, exit code 2, before the model loads where the input allows."""
import dataclasses
import json

import pytest
from test_bad_input import FAST, main_error
from test_cli import assert_one_line_error, run_cli
from test_lora_pool import make_adapter

import run
from nano.config import ModelConfig
from nano.lora import LLM, LoRARequest
from nano.sequence import SamplingParams


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    """Two adapters of the tiny model: all seven projections at rank 4, three at rank 3."""
    root = tmp_path_factory.mktemp("adapters")
    cfg = ModelConfig.from_hf(json.loads((tiny_model / "config.json").read_text()))
    return {"a": make_adapter(root / "a", seed=1, r=4, alpha=8, cfg=cfg),
            "b": make_adapter(root / "b", seed=2, r=3, alpha=3, cfg=cfg,
                              modules=("q_proj", "v_proj", "down_proj"))}


def test_prompts_name_their_adapters(tmp_path, tiny_model, adapters, capsys):
    lines = [{"prompt": "hello there", "lora": "a"}, {"prompt": "hello there"},
             {"prompt": "hello there", "lora": "b"}, {"prompt": "one two three", "lora": "a"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    b = json.dumps({"name": "b", "path": str(adapters["b"]), "base_model_name": str(tiny_model)})
    assert run.main(["--prompt-file", str(tmp_path / "p.jsonl"), "--model", str(tiny_model), *FAST,
                     "--temperature", "0", "--max-tokens", "6", "--ignore-eos",
                     "--output", str(tmp_path / "out.jsonl"), "--enable-lora", "--max-loras", "2",
                     "--max-lora-rank", "4", "--lora-modules", f"a={adapters['a']}", b]) == 0
    got = [json.loads(line)["token_ids"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    requests = {"a": LoRARequest("a", 1, str(adapters["a"])), "b": LoRARequest("b", 2, str(adapters["b"]))}
    llm = LLM(str(tiny_model), enable_lora=True, max_loras=2, max_lora_rank=4, device="cpu",
              num_blocks=256)
    want = [out.token_ids for out in llm.generate(
        [line["prompt"] for line in lines], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        lora_request=[requests.get(line.get("lora")) for line in lines])]
    assert got == want
    assert got[0] != got[1] != got[2]  # each adapter changes the answer
    capsys.readouterr()


@pytest.mark.parametrize("flags, message", [
    (["--lora-modules", "a=x"], "--lora-modules needs --enable-lora"),
    (["--max-loras", "2"], "--max-loras needs --enable-lora"),
    (["--enable-lora", "--max-loras", "0"], "--max-loras must be an integer in [1, 1024], got 0"),
    (["--enable-lora", "--max-loras", "3", "--max-cpu-loras", "2"],
     "--max-cpu-loras (2) must be at least --max-loras (3)"),
    (["--enable-lora", "--lora-modules", "a=/nowhere"], "--lora-modules a: no adapter_config.json in /nowhere"),
    (["--enable-lora", "--lora-modules", "a"], "--lora-modules 'a': expected NAME=PATH or a JSON object"),
    (["--enable-lora", "--lora-modules", '{"name": "a", "path": "x", "scale": 2}'],
     "expected an object with name, path and optionally base_model_name"),
    (["--enable-lora", "--lora-modules", '{"name": "a", "path": 5}'],
     "name, path and base_model_name must be non-empty strings"),
    (["--enable-lora", "--lora-modules", '{"name": "a", "path": "x", "base_model_name": "other"}'],
     "--lora-modules a: base_model_name 'other' is not the served --model"),
    (["--enable-lora", "--lora-modules", "a={a}", "a={b}"], "--lora-modules: 'a' is given twice"),
    (["--allow-runtime-lora-updating"], "--allow-runtime-lora-updating needs --enable-lora"),
    (["--enable-lora", "--allow-runtime-lora-updating"], "--allow-runtime-lora-updating is the server's: it needs "
                                                         "--serve"),
])
def test_bad_flags(tmp_path, adapters, flags, message):
    (tmp_path / "p.txt").write_text("hi\n")
    flags = [f.replace("{a}", str(adapters["a"])).replace("{b}", str(adapters["b"])) for f in flags]
    assert message in main_error("--prompt-file", tmp_path / "p.txt", *flags)


def test_modes_without_adapters_refuse_them():
    for mode in (["--bench"], ["--capacity"]):
        assert main_error("--enable-lora", *mode) == (f"--enable-lora runs a --prompt-file or --serve (with --tp "
                                                      f"or without), not {mode[0]}")


@pytest.mark.parametrize("line, flags, message", [
    ({"prompt": "hi", "lora": "c"}, ["--enable-lora", "--lora-modules", "a={a}"],
     "lora 'c' is not one of --lora-modules (a)"),
    ({"prompt": "hi", "lora": "a"}, [], "the field lora needs --enable-lora and --lora-modules"),
    ({"prompt": "hi", "lora": 3}, [], "line 1: field lora must be a string, got 3"),
])
def test_bad_prompt_fields(tmp_path, adapters, line, flags, message):
    (tmp_path / "p.jsonl").write_text(json.dumps(line) + "\n")
    flags = [f.replace("{a}", str(adapters["a"])).replace("{b}", str(adapters["b"])) for f in flags]
    assert message in main_error("--prompt-file", tmp_path / "p.jsonl", *flags)


def test_an_adapter_of_another_model_is_one_line(tmp_path, tiny_model):
    """Read once the model is loaded: its shapes are the base model's check."""
    (tmp_path / "p.txt").write_text("hi\n")
    cfg = ModelConfig.from_hf(json.loads((tiny_model / "config.json").read_text()))
    other = make_adapter(tmp_path / "other", seed=3, r=4, alpha=8,
                         cfg=dataclasses.replace(cfg, intermediate_size=96))
    r = run_cli("--prompt-file", tmp_path / "p.txt", "--model", tiny_model, *FAST, "--enable-lora",
                "--lora-modules", f"other={other}")
    assert_one_line_error(r, "LoRA adapter 'other': tensor base_model.model.model.layers.0.")
