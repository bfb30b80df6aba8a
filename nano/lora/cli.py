"""run.py's LoRA flags, vLLM's: --enable-lora, --lora-modules, --max-loras, --max-lora-rank,
--max-cpu-loras, and for the server --allow-runtime-lora-updating (or vLLM's environment
variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), checked before any model loads; the adapters
given to the engine, and to each other tensor-parallel rank's runner, every one read at the
start; a .jsonl prompt's "lora" field, the name of one of --lora-modules, made its request's
LoRARequest."""
import json
import os
from pathlib import Path

from nano.cli import flags
from nano.errors import NanoError
from nano.lora import MAX_LORA_RANK, MAX_LORAS, LoRARequest, attach, rank_pool
from nano.lora.pool import AdapterPool, check_limits

MODULE_KEYS = {"name", "path", "base_model_name"}  # vLLM's JSON form of one --lora-modules entry


def runtime_updating_env() -> bool:
    """vLLM's switch for the server's load and unload routes, read as vLLM reads it."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


def add_arguments(p) -> None:
    g = p.add_argument_group("LoRA adapters (nano/lora)")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT folders) beside the base model, several in one batch")
    g.add_argument("--lora-modules", nargs="+", action="extend", metavar="NAME=PATH",
                   help="the adapters, by name: NAME=PATH or vLLM's JSON '{\"name\": ..., \"path\": ..., "
                        "\"base_model_name\": ...}', repeatable; a .jsonl prompt's \"lora\" field names one")
    g.add_argument("--max-loras", type=int, default=MAX_LORAS,
                   help="adapters running at once (the device pool's slots)")
    g.add_argument("--max-lora-rank", type=int, default=MAX_LORA_RANK, help="the largest adapter rank")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept read in host memory (default: --max-loras)")
    g.add_argument("--allow-runtime-lora-updating", action="store_true", default=runtime_updating_env(),
                   help="--serve: POST /v1/load_lora_adapter and /v1/unload_lora_adapter add and remove adapters "
                        "while serving (default: on when VLLM_ALLOW_RUNTIME_LORA_UPDATING is True or 1, as vLLM)")


def check_args(args) -> None:
    """The flags and the adapters they name (each a folder with adapter_config.json), before
    the model loads; args.lora_modules becomes {name: LoRARequest}, ids in the order given."""
    if not args.enable_lora:
        given = flags.given(args, add_arguments, skip=("enable_lora",))
        if given:
            raise NanoError(f"{given[0]} needs --enable-lora")
        args.lora_modules = {}
        return
    modes = {"--bench": args.bench, "--capacity": args.capacity, "--disagg": args.disagg,
             "--dp": args.dp}
    for flag, on in modes.items():
        if on:
            raise NanoError(f"--enable-lora runs a --prompt-file or --serve (with --tp or without), "
                            f"not {flag}")
    if args.allow_runtime_lora_updating and not args.serve and not runtime_updating_env():
        raise NanoError("--allow-runtime-lora-updating is the server's: it needs --serve")
    check_limits(args.max_loras, args.max_lora_rank, args.max_cpu_loras)
    modules = {}
    for entry in args.lora_modules or []:
        name, path = parse_module(entry, args.model)
        if name in modules:
            raise NanoError(f"--lora-modules: {name!r:.40} is given twice")
        if not (Path(path) / "adapter_config.json").is_file():
            raise NanoError(f"--lora-modules {name}: no adapter_config.json in {path:.200}")
        modules[name] = LoRARequest(name, len(modules) + 1, path)
    args.lora_modules = modules


def parse_module(entry: str, base_model: str) -> tuple[str, str]:
    """One --lora-modules entry -> (name, path)."""
    if not entry.startswith("{"):
        name, eq, path = entry.partition("=")
        if not (name and eq and path):
            raise NanoError(f"--lora-modules {entry!r:.80}: expected NAME=PATH or a JSON object")
        return name, path
    try:
        module = json.loads(entry)
    except (json.JSONDecodeError, RecursionError):
        raise NanoError(f"--lora-modules {entry!r:.80}: not JSON") from None
    if not isinstance(module, dict) or set(module) - MODULE_KEYS or not {"name", "path"} <= set(module):
        raise NanoError(f"--lora-modules {entry!r:.80}: expected an object with name, path and "
                        f"optionally base_model_name")
    if not all(isinstance(v, str) and v for v in module.values()):
        raise NanoError(f"--lora-modules {entry!r:.80}: name, path and base_model_name must be "
                        f"non-empty strings")
    if module.get("base_model_name", base_model) != base_model:
        raise NanoError(f"--lora-modules {module['name']}: base_model_name "
                        f"{module['base_model_name']!r:.80} is not the served --model {base_model!r:.80}")
    return module["name"], module["path"]


def prompt_adapters(args, requests) -> list:
    """The prompt file's requests, each "lora" name made its LoRARequest (None: the base
    model); None on the ranks that read no prompts."""
    if requests is None:
        return None
    for r in requests:
        if r.lora is not None and not args.enable_lora:
            raise NanoError(f"{args.prompt_file}: the field lora needs --enable-lora and --lora-modules")
        if r.lora is not None and r.lora not in args.lora_modules:
            raise NanoError(f"{args.prompt_file}: lora {r.lora!r:.40} is not one of --lora-modules "
                            f"({', '.join(args.lora_modules) or 'none given'})")
    return [r._replace(lora=args.lora_modules.get(r.lora)) for r in requests]


def use_adapters(args, engine=None, runner=None) -> AdapterPool | None:
    """With --enable-lora: rank 0's engine, or another tensor-parallel rank's runner, serves
    every --lora-modules adapter, each read now; returns the pool (None without)."""
    if not args.enable_lora:
        return None
    sizes = (args.max_loras, args.max_lora_rank, args.max_cpu_loras)
    pool = (attach(engine, *sizes) if engine is not None
            else rank_pool(runner.model.cfg, runner.device, *sizes))
    if runner is not None:
        runner.use_adapters(pool)
    for request in args.lora_modules.values():
        pool.resolve(request)
    return pool
