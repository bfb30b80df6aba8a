"""LoRA adapters served by name, as vLLM serves them (docs/lora.md#serving): a request's "model"
names an adapter (the base model's served names: none) and its response carries that name;
GET /v1/models lists a card per adapter, its parent the base model's first served name and its
root the adapter's folder; with runtime updating allowed (--allow-runtime-lora-updating, or
vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), POST /v1/load_lora_adapter and
/v1/unload_lora_adapter add and remove names while serving, with vLLM's statuses and messages.

The names live here, on the event loop; the weights live in nano/lora's pool, which only the
engine thread touches (engine_thread.py). Folders are read on worker threads: a load reads its
folder before the name is served, and a request whose adapter has left host memory (past
--max-cpu-loras) has it read again before it is queued, so that no step waits for a disk."""
import asyncio
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from nano import parallel
from nano.errors import NanoError
from nano.lora.peft import Adapter, LoRARequest, read_adapter
from nano.lora.pool import AdapterPool
from nano.server.schemas import BadRequest, Text


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/load_lora_adapter (its load_inplace, a replacement under the same
    name, is refused as an unknown field)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: Text
    lora_path: Text


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/unload_lora_adapter, by name."""
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: Text


class Adapters:
    """The adapters a server serves: --lora-modules at the start, then those loaded at runtime."""

    def __init__(self, pool: AdapterPool, modules: dict[str, LoRARequest], base_names: list[str],
                 runtime_updates: bool = False):
        """modules: name -> LoRARequest (nano/lora/cli.py's, already in the pool); base_names:
        the base model's served names, the first of which is each adapter card's parent."""
        if hidden := sorted(set(modules) & set(base_names)):
            raise NanoError(f"--lora-modules {hidden[0]}: the base model is served under that name")
        self.pool, self.base_names, self.runtime_updates = pool, base_names, runtime_updates
        self.named = dict(modules)  # what requests may name now
        self.next_id = max((r.lora_int_id for r in modules.values()), default=0) + 1  # ids are never reused
        self.loading: set[str] = set()  # names whose folders are being read for a load

    def get(self, name: str | None) -> LoRARequest | None:
        return self.named.get(name)

    def card(self, request: LoRARequest, base_card: dict) -> dict:
        """vLLM's card of an adapter: the base model's, with the adapter's name, its folder as root
        and the base model as parent."""
        return {**base_card, "id": request.lora_name, "root": request.lora_path, "parent": self.base_names[0]}

    def read_dropped(self, request: LoRARequest) -> Adapter | None:
        """On a worker thread: the adapter's weights if host memory no longer holds them, else
        None. A folder that has gone bad since it was loaded is a 400."""
        if self.pool.holds(request.lora_int_id):
            return None
        try:
            return read_adapter(request, self.pool.cfg, self.pool.max_rank)
        except (NanoError, OSError) as e:
            raise BadRequest(str(e), param="model") from None

    async def load(self, name: str, path: str, inbox) -> str:
        """Read a new adapter's folder on a worker thread, then serve it under name: its weights go
        to the engine thread through inbox before any request can name it. vLLM's answers."""
        if not name or not path:
            raise BadRequest("Both 'lora_name' and 'lora_path' must be provided.", kind="InvalidUserInput")
        if name in self.named or name in self.loading:
            raise BadRequest(f"The lora adapter '{name}' has already been loaded.", kind="InvalidUserInput")
        if name in self.base_names:
            raise BadRequest(f"The lora adapter '{name}' would hide the base model served under that name.",
                             kind="InvalidUserInput")
        if parallel.tp_group().world > 1:
            raise BadRequest("loading a LoRA adapter while serving is not supported under --tp: every rank would "
                             "have to read it, and the ranks share only the steps; give it to --lora-modules "
                             "at the start", kind="InvalidUserInput")
        request = LoRARequest(name, self.next_id, path)
        self.next_id += 1
        self.loading.add(name)
        try:
            adapter = await asyncio.to_thread(self._read_new, request)
        finally:
            self.loading.discard(name)
        self.named[name] = request
        inbox.put(("keep", adapter))
        return f"Success: LoRA adapter '{name}' added successfully."

    def _read_new(self, request: LoRARequest) -> Adapter:
        """On a worker thread: a folder without adapter_config.json is vLLM's 404, one that nano's
        checks refuse a 400 naming what they refuse."""
        if not (Path(request.lora_path) / "adapter_config.json").is_file():
            raise BadRequest(f"Loading lora {request.lora_name} failed: No adapter found for {request.lora_path}",
                             404, "NotFoundError")
        try:
            return read_adapter(request, self.pool.cfg, self.pool.max_rank)
        except (NanoError, OSError) as e:
            raise BadRequest(f"Loading lora {request.lora_name} failed: {e}", kind="BadRequestError") from None

    def unload(self, name: str, inbox) -> str:
        """Stop serving name at once: requests that name it from now on get a 404, those already
        queued or running end under it, and the engine thread drops its weights after them."""
        request = self.named.pop(name, None)
        if request is None:
            raise BadRequest(f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError")
        inbox.put(("retire", request))
        return f"Success: LoRA adapter '{name}' removed successfully."
