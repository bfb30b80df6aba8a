"""The server's requests on the event loop's side: each checked against the limits before it
costs anything, started as jobs on the engine thread (engine_thread.py), aborted when its
client goes away, ended at shutdown. app.py routes HTTP to it; completions.py turns its jobs'
events into OpenAI's responses."""
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from fastapi.responses import JSONResponse

from nano.chat import template
from nano.errors import NanoError
from nano import structured
from nano.controls import OFF, ControlError, sampling_params
from nano.sequence import SamplingParams, Sequence
from nano.structured import Grammar, bounds
from nano.structured.stack import lower_priority
from nano.weights import resolve_model
from nano.lora.peft import LoRARequest
from nano.server.adapters import Adapters
from nano.server.engine_process import EngineProcess
from nano.server.engine_thread import EngineThread, Job, StopStrings
from nano.server.limits import GRAMMAR_CACHE, Limits
from nano.server.schemas import BadRequest, Message, Sampling, error_response


class Server:
    def __init__(self, engine, max_queued: int = 256, metrics=None, limits: Limits = Limits(),
                 stall_timeout: float | None = None, chat_template: str | None = None,
                 tool_parser: str | None = None, auto_tools: bool = False, served_names: list[str] | None = None,
                 generation_defaults: dict | None = None, adapters: Adapters | None = None,
                 own_process: bool = False):
        """own_process: the engine steps in a child process (engine_process.py), else on a thread here."""
        self.engine, self.max_queued, self.limits = engine, max_queued, limits
        self.adapters = adapters  # the LoRA adapters requests may name (adapters.py), or None
        # --chat-template (None: the model's), --tool-call-parser, --enable-auto-tool-choice (tools.py)
        self.chat_template, self.tool_parser, self.auto_tools = chat_template, tool_parser, auto_tools
        # --served-model-name (vLLM's): requests may name any; responses and metrics carry the first
        self.names = served_names or [engine.model_name]
        self.model_name = self.names[0]
        self.model_dir = resolve_model(engine.config.model)  # the folder the weights came from
        # --generation-config's (generation_config.py): what a request that leaves a field out gets
        self.defaults = generation_defaults or {}
        thread_args = (engine, metrics, stall_timeout, self.model_name, adapters and adapters.pool)
        self.thread = (EngineProcess(thread_args, lambda: [self.vocabulary]) if own_process
                       else EngineThread(*thread_args))
        self.open: set[Job] = set()  # jobs submitted and not yet ended (event loop only)
        self.created = int(time.time())
        self.closing = False  # shutting down: no new requests
        self.deadline: asyncio.TimerHandle | None = None  # when the open jobs are ended
        self.vocabulary = None  # llguidance's view of the tokenizer, for grammars (nano/structured)
        self.grammars: ThreadPoolExecutor | None = None  # the threads that compile them, made when first needed
        self.compiled: OrderedDict[bytes, Future] = OrderedDict()  # grammars by a digest of what asked for them

    def check_model(self, model: str | None) -> None:
        """A model named in a request (or a URL) is one of this server's names or adapters, or a 404
        as OpenAI answers it."""
        if model is not None and model not in self.names and self.lora_of(model) is None:
            served = self.names + list(self.adapters.named if self.adapters else ())
            raise BadRequest(f"the model {model!r} does not exist: this server has {', '.join(map(repr, served))}",
                             404, code="model_not_found", param="model")

    def lora_of(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's model names (None: the base model, or no such adapter)."""
        return self.adapters.get(model) if self.adapters and model not in self.names else None

    def name_of(self, lora: LoRARequest | None) -> str:
        """The model a response carries, as vLLM's: the adapter's name, or the base model's first name."""
        return self.model_name if lora is None else lora.lora_name

    def check(self, body: Sampling) -> StopStrings:
        """What can be checked before tokenizing: the model, and the stop strings (returned)."""
        self.check_model(body.model)
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > self.limits.stop_strings:
            raise BadRequest(f"stop: {len(stops)} strings, more than this server's {self.limits.stop_strings}")
        if any(len(s) > self.limits.stop_chars for s in stops):
            raise BadRequest(f"stop: a string longer than this server's {self.limits.stop_chars} characters")
        return StopStrings(tuple(s for s in stops if s))

    def check_tools(self, tools: list[dict] | None) -> None:
        if tools is not None and len(tools) > self.limits.tools:
            raise BadRequest(f"tools: {len(tools)} tools, more than this server's {self.limits.tools}", param="tools")

    def check_chars(self, chars: int) -> None:
        if chars > self.limits.prompt_chars:
            raise BadRequest(f"the prompt has {chars} characters, more than this server's {self.limits.prompt_chars}")

    def check_ids(self, name: str, ids: list[int]) -> None:
        vocab = self.engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise BadRequest(f"{name}: token ids must be in [0, {vocab})")

    async def structured(self, body: Sampling, tool_schema: dict | None = None,
                         format_param: str = "response_format") -> Grammar | None:
        """The request's grammar (response_format, vLLM's structured_outputs, or the schema a
        forced tool_choice needs: tools.forced_schema), or None if it asks for none. A grammar
        past the limits, one that does not compile, or one that allows no output is a 400
        naming the field (response_format: as format_param names it, the Responses API's
        text.format); so is one whose compile and first mask take longer than grammar_timeout."""
        fmt, outputs = body.response_format, body.structured_outputs
        if fmt is not None and fmt.type == "text":
            fmt = None
        if fmt is None and outputs is None and tool_schema is None:
            return None
        asked = [name for name, value in ((format_param, fmt), ("structured_outputs", outputs),
                                          ("a forced tool_choice", tool_schema)) if value is not None]
        if len(asked) > 1:
            raise BadRequest(f"{' and '.join(asked)}: set one of them",
                             param="tool_choice" if tool_schema is not None else "structured_outputs")
        if tool_schema is not None:
            kind, value, strict, name = "json", tool_schema, True, "tool_choice"
            param = name
        elif fmt is not None:
            param = name = format_param
            spec = fmt.json_schema
            kind, value, strict = (("json", spec.schema_, spec.strict is not False) if spec else ("json_object", None, True))
        else:
            param = "structured_outputs"
            [kind] = outputs.asked()
            value, strict, name = getattr(outputs, "json_" if kind == "json" else kind), True, f"{param}.{kind}"
        try:
            grammar = await self._compile(kind, value, strict, name)
        except NanoError as e:
            raise BadRequest(str(e), param=param) from None
        if kind == "choice" and body.min_tokens > max(len(c.encode()) for c in value):
            raise BadRequest(f"min_tokens: {body.min_tokens} tokens, more than the longest of {name} can take "
                             "(one token a byte)", param="min_tokens")
        return grammar

    async def _compile(self, kind: str, value, strict: bool, name: str) -> Grammar:
        """kind's grammar, checked against the limits here, then compiled with its first mask on
        the compile pool within grammar_timeout, its wait for a free thread included. A grammar
        asked for again (agent frameworks send the same schema with every call) is the compiled
        one, or the compile under way, of the last GRAMMAR_CACHE different ones."""
        bounds.check(kind, value, name, self.limits.grammar)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        key = hashlib.sha256(json.dumps([kind, text, strict, name]).encode()).digest()
        future = self.compiled.pop(key, None)
        if future is None or future.cancelled():
            if self.grammars is None:
                self.grammars = ThreadPoolExecutor(self.limits.grammar_workers, "nano-grammar", lower_priority)
            future = self.grammars.submit(self._build, kind, value, strict, name)
        self.compiled[key] = future  # the most recent last
        while len(self.compiled) > GRAMMAR_CACHE:
            self.compiled.popitem(last=False)
        try:
            # shield: a waiter that gives up leaves the compile to the others waiting for it
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.limits.grammar_timeout)
        except asyncio.TimeoutError:
            if not future.cancel():  # it started, and ran past the limit
                raise BadRequest(f"{name}: the grammar took longer than this server's {self.limits.grammar_timeout} s "
                                 "to compile", param=name.split(".")[0]) from None
        except asyncio.CancelledError:
            if not future.cancelled():  # this request was cancelled (its client left), not the compile
                raise
        # It never started: the threads were busy with other grammars for all that time.
        raise BadRequest(f"{name}: every grammar compiler stayed busy for {self.limits.grammar_timeout} s: "
                         "try again later", 503, "server_error", "server_overloaded")

    def build_vocabulary(self) -> None:
        """Build the grammars' vocabulary now, before the first request: llguidance holds the GIL
        for all of the 0.3-1 s it takes (a 49k vocabulary), which would pause every stream if a
        request paid for it. A tokenizer llguidance cannot read is left to the first grammar's
        compile, which answers it with a 400."""
        with contextlib.suppress(NanoError):
            self.vocabulary = structured.Vocabulary.of(self.engine.tokenizer, self.engine.model_config.vocab_size)

    def _build(self, kind: str, value, strict: bool, name: str) -> Grammar:
        """On a compile thread: the vocabulary (unless the server built it), then the compile."""
        if self.vocabulary is None:
            self.vocabulary = structured.Vocabulary.of(self.engine.tokenizer, self.engine.model_config.vocab_size)
        return structured.compile_grammar(self.vocabulary, kind, value, strict, name)

    async def submit(self, body: Sampling, prompts: list[list[int]], stops: StopStrings, top_logprobs: int | None,
                     max_tokens: int | None, echo: bool = False, grammar: Grammar | None = None) -> list[Job]:
        """Start body.n jobs for each prompt, the whole request checked against the limits first;
        returns them in OpenAI's choice order (prompt i's choices are i*n .. i*n+n-1). max_tokens:
        as asked (a prompt it does not fit beside in the context is a 400, as vLLM's), or None:
        the rest of the context (at most the generation config's max_tokens). echo: each
        prompt's text and (with top_logprobs) its logprobs come first. grammar: the request's
        (structured())."""
        choices = body.n * len(prompts)
        if choices > self.max_queued:  # would never fit: not a "try again"
            raise BadRequest(f"n: {choices} choices" + (f" ({len(prompts)} prompts x {body.n})" if len(prompts) > 1
                                                        else "") +
                             f", more than this server's {self.max_queued} requests in flight")
        self.check_room(choices)
        context, capped = self.engine.max_model_len, []
        for i, prompt in enumerate(prompts):
            name = "prompt" if len(prompts) == 1 else f"prompt {i}"
            if len(prompt) + 1 > context:
                raise BadRequest(f"this model's maximum context length is {context} tokens; the {name} has "
                                 f"{len(prompt)}")
            if max_tokens is not None and len(prompt) + max_tokens > context:
                raise BadRequest(f"This model's maximum context length is {context} tokens. However, you requested "
                                 f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, {max_tokens} in "
                                 "the completion). Please reduce the length of the messages or completion.")
            self.check_ids(name, prompt)  # after the length: bounded
            rest = min(context - len(prompt), self.defaults.get("max_tokens", context))  # vLLM's get_max_tokens
            capped.append(rest if max_tokens is None else max_tokens)
        if body.n * sum(capped) > self.limits.request_tokens:
            raise BadRequest(f"n x max_tokens is {body.n} x {sum(capped)}"
                             + (f" (over {len(prompts)} prompts)" if len(prompts) > 1 else "") +
                             f", more than this server's {self.limits.request_tokens} tokens a request: ask for "
                             "fewer choices or tokens")
        self.check_controls(body)
        # The engine scores the prompt for echo's logprobs, for prompt_logprobs, and for max_tokens 0.
        asked = [k for k in (top_logprobs if echo else None, body.prompt_logprobs, 0 if max_tokens == 0 else None)
                 if k is not None]
        # One SamplingParams per prompt, made on a worker thread (bad_words are tokenized), its
        # choices copies of it that differ in their seed; on that thread too, the adapter's
        # weights if host memory has dropped them since they were last used.
        lora = self.lora_of(body.model)
        made, adapter = await asyncio.to_thread(lambda: (
            [self._params(body, most, top_logprobs is not None, max(asked, default=None), grammar) for most in capped],
            lora and self.adapters.read_dropped(lora)))
        if self.lora_of(body.model) is not lora:
            raise BadRequest(f"the model {body.model!r} was unloaded while the request was prepared", 404,
                             code="model_not_found", param="model")
        loop, jobs = asyncio.get_running_loop(), []
        for prompt, params in zip(prompts, made):
            for i in range(body.n):
                seed = None if body.seed is None else body.seed + i
                jobs.append(Job(prompt, dataclasses.replace(params, seed=seed), stops, top_logprobs, asyncio.Queue(),
                                loop, echo, body.prompt_logprobs, min_tokens=body.min_tokens,
                                include_stop=body.include_stop_str_in_output, constrained=grammar is not None,
                                lora=lora, adapter=adapter))
        if grammar is not None:
            self.check_first_token(jobs[0])
        self.check_room(choices)  # again, with no await before the jobs count: others came in meanwhile
        for job in jobs:
            self.thread.inbox.put(("add", job))
        self.open.update(jobs)
        return jobs

    def check_room(self, choices: int) -> None:
        """A 503 if the server is shutting down, its engine stopped, or `choices` more jobs would
        pass --max-queued-requests."""
        if self.closing or self.stopped():
            raise BadRequest("the server is shutting down" if self.closing else f"engine stopped: {self.thread.error}",
                             503, "server_error")
        if len(self.open) + choices > self.max_queued:
            raise BadRequest(f"the server has {len(self.open)} requests in flight (at most {self.max_queued}): "
                             "try again later", 503, "server_overloaded")

    def check_controls(self, body: Sampling) -> None:
        """The sampling controls whose size costs every step: within the limits, or a 400."""
        for field, count in (("bad_words", len(body.bad_words or ())), ("logit_bias", len(body.logit_bias or {}))):
            if count > getattr(self.limits, field):
                raise BadRequest(f"{field}: {count} entries, more than this server's {getattr(self.limits, field)}",
                                 param=field)
        if any(len(w) > self.limits.stop_chars for w in body.bad_words or ()):
            raise BadRequest(f"bad_words: a word longer than this server's {self.limits.stop_chars} characters",
                             param="bad_words")

    def _params(self, body: Sampling, max_tokens: int, return_logits: bool, prompt_logprobs: int | None,
                grammar: Grammar | None) -> SamplingParams:
        # A field the request left out (or sent null): the generation config's default, else nano's
        asked = {k: getattr(body, k) if k in body.model_fields_set else self.defaults.get(k, getattr(body, k))
                 for k in ("temperature", "top_p", "top_k", "min_p", *OFF)}
        try:
            params = sampling_params(
                self.engine, max_tokens=max_tokens, ignore_eos=body.ignore_eos,
                stop_token_ids=body.stop_token_ids or [], return_logits=return_logits,
                prompt_logprobs=prompt_logprobs, **asked)
        except ControlError as e:
            raise BadRequest(str(e), param=e.field) from None
        except NanoError as e:
            raise BadRequest(str(e)) from None
        params.logits_processor = structured.chain(params.logits_processor, grammar)
        return params

    @staticmethod
    def check_first_token(job: Job) -> None:
        """A 400 if the request's controls ban every first token its grammar allows (a choice
        whose words are bad_words, say): what the engine would find at the first step."""
        seq = Sequence(-1, "", job.prompt, job.params, 0.0, 0)
        processor = job.params.logits_processor
        processor.edits(seq, [])
        if why := processor.failure(seq):
            raise BadRequest(why)

    def abort(self, job: Job) -> None:
        self.thread.inbox.put(("abort", job))

    def release(self, jobs: list[Job]) -> None:
        """The request is over (finished, failed or gone): abort what still runs."""
        for job in jobs:
            self.abort(job)
        self.open.difference_update(jobs)

    async def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Completion prompts, as plain text, on a worker thread (the event loop keeps serving)."""
        self.check_chars(sum(map(len, texts)))
        return await asyncio.to_thread(lambda: [self.engine.tokenizer.encode(t, True) for t in texts])

    async def tokenize_chat(self, messages: list[Message], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        """The conversation (and the tools) in the chat template, on a worker thread (content null: empty)."""
        conversation = [m.conversation() for m in messages]
        extra = [{k: v for k, v in m.items() if k not in ("role", "content")} for m in conversation]
        self.check_chars(sum(len(m["content"]) for m in conversation)
                         + sum(len(json.dumps(e)) for e in extra if e) + (len(json.dumps(tools)) if tools else 0))
        try:
            return await asyncio.to_thread(template.encode, self.engine.tokenizer, conversation, add_generation_prompt,
                                           tools, self.chat_template)
        except NanoError as e:
            raise BadRequest(str(e)) from None

    async def metrics_text(self) -> bytes:
        """GET /metrics' text: the registry the engine thread sets from the engine after each
        step, rendered where that thread runs (here: at once, whatever the step is doing)."""
        if isinstance(self.thread, EngineProcess):
            return await asyncio.wrap_future(self.thread.metrics_text())
        return self.thread.export.text()

    def stopped(self) -> JSONResponse | None:
        """A 503 if the engine thread is gone (it failed, or the server is shutting down)."""
        if self.thread.error or not self.thread.is_alive():
            return error_response(f"engine stopped: {self.thread.error}", 503, "server_error")
        return None

    def shut_down(self, grace: float) -> None:
        """Take no new requests; end the open ones in `grace` seconds unless they finish first
        (sooner if asked again). On the event loop."""
        self.closing = True
        if self.deadline:
            self.deadline.cancel()
        self.deadline = asyncio.get_running_loop().call_later(grace, self._end_open)

    def _end_open(self) -> None:
        for job in self.open:  # each waiting response ends with this error (a stream: then [DONE])
            job.events.put_nowait({"error": "the server is shutting down", "status": 503})
