"""Runs the client calls of docs/server.md "Clients, unchanged" against a running nano server,
each as its users write it, at temperature 0, and prints one block per row: what came back, the
finish reasons the server sent, and whether the client raised.

This is a script, not a pytest test: it needs the clients, which the project's venv does not
hold (pytest does not collect it: its name does not start with test_). Run it so, from the
repository's root:

    python3 -m venv ../clients-venv
    ../clients-venv/bin/pip install openai langchain-openai instructor pydantic-ai litellm llm
    HF_HUB_OFFLINE=1 .venv/bin/python run.py --serve --port 8766 \\
        --chat-template tests/data/hermes_tools.jinja --enable-auto-tool-choice --tool-call-parser hermes &
    ../clients-venv/bin/python tests/clients_check.py                  # every row
    ../clients-venv/bin/python tests/clients_check.py instructor_tools  # some rows, by name

--url names another server. The `llm` row writes its extra-openai-models.yaml into a temporary
LLM_USER_PATH, so the user's own llm settings are neither read nor changed."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Iterable

import httpx
from pydantic import BaseModel

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM reads its prices from its package, offline
MODEL = "SmolLM2-135M-Instruct"
URL = "http://127.0.0.1:8766"
FINISHES: list[str] = []  # the finish reasons (or Responses statuses) the server sent, in order


class City(BaseModel):
    """Describes a city."""
    name: str
    country: str
    population: int


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return "18 C, sunny"


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITY_PROMPT = "Extract the city: Paris is in France and has 2102650 inhabitants."
CITIES_PROMPT = "Extract the cities: Paris, France, 2102650 inhabitants. Berlin, Germany, 3850809 inhabitants."
CITIES_CUT_PROMPT = "Paris (France, population 2102650) and Berlin (Germany, population 3850809)."
WEATHER_PROMPT = "What is the weather in Paris?"


def record(response: httpx.Response) -> None:
    """Records the finish reasons of a JSON answer from the server (streams are read by their row)."""
    if response.headers.get("content-type", "").startswith("application/json"):
        response.read()
        note(response.json())


async def arecord(response: httpx.Response) -> None:
    """Records the finish reasons of a JSON answer, for the clients that use httpx's async client."""
    if response.headers.get("content-type", "").startswith("application/json"):
        await response.aread()
        note(response.json())


def note(body: dict) -> None:
    """Keeps a chat answer's finish reasons, or a Response's status, in FINISHES."""
    if "choices" in body:
        FINISHES.extend(choice.get("finish_reason") for choice in body["choices"])
    elif body.get("object") == "response":
        FINISHES.append(body["status"])


def http() -> httpx.Client:
    """Makes the HTTP client every synchronous client is given, which records finish reasons."""
    return httpx.Client(event_hooks={"response": [record]}, timeout=600)


def ahttp() -> httpx.AsyncClient:
    """Makes the HTTP client the asynchronous clients are given, which records finish reasons."""
    return httpx.AsyncClient(event_hooks={"response": [arecord]}, timeout=600)


def openai_client():
    """Makes an openai client for the server."""
    from openai import OpenAI
    return OpenAI(base_url=URL + "/v1", api_key="none", http_client=http())


def chat_model(**kw):
    """Makes LangChain's ChatOpenAI for the server, at temperature 0."""
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(base_url=URL + "/v1", api_key="none", model=MODEL, temperature=0,
                      http_client=http(), **kw)


# ---- LangChain ------------------------------------------------------------------------------------
def langchain_json_schema():
    """Asks LangChain's with_structured_output(method="json_schema") for a City: it sends City's
    schema as response_format."""
    return chat_model(max_tokens=100).with_structured_output(City, method="json_schema").invoke(CITY_PROMPT)


def langchain_function_calling():
    """Asks with_structured_output(method="function_calling") for a City: it sends a tool named City, forced by name."""
    return chat_model(max_tokens=100).with_structured_output(City, method="function_calling").invoke(CITY_PROMPT)


def langchain_auto():
    """Binds a tool with bind_tools under "auto", the default, which the 135M model answers in prose."""
    from langchain_core.tools import tool
    reply = chat_model(max_tokens=60).bind_tools([tool(get_weather)]).invoke(WEATHER_PROMPT)
    return repr(reply.content), reply.tool_calls, reply.response_metadata["finish_reason"]


def langchain_named_tool():
    """Binds a tool with LangChain's bind_tools and tool_choice naming it."""
    from langchain_core.tools import tool
    reply = chat_model(max_tokens=60).bind_tools([tool(get_weather)], tool_choice="get_weather").invoke(WEATHER_PROMPT)
    return reply.tool_calls, reply.response_metadata["finish_reason"]


def langchain_required():
    """Binds a tool with bind_tools(tool_choice="required")."""
    from langchain_core.tools import tool
    reply = chat_model(max_tokens=60).bind_tools([tool(get_weather)], tool_choice="required").invoke(WEATHER_PROMPT)
    return reply.tool_calls, reply.response_metadata["finish_reason"]


def langchain_stream_required():
    """Streams bind_tools(tool_choice="required") with LangChain's .stream() and adds the chunks up."""
    from langchain_core.tools import tool
    chunks = list(chat_model(max_tokens=60).bind_tools([tool(get_weather)], tool_choice="required").stream(
        WEATHER_PROMPT))
    message = sum(chunks[1:], chunks[0])
    FINISHES.append(message.response_metadata["finish_reason"])
    return message.tool_calls


def langchain_agent_loop():
    """Runs an agent's two turns: the model calls the tool ("required": a 135M model answers "auto"
    in prose), the tool runs, its ToolMessage goes back, and the model answers under "auto"."""
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    weather = tool(get_weather)
    llm = chat_model(max_tokens=60)
    messages = [HumanMessage(WEATHER_PROMPT)]
    call = llm.bind_tools([weather], tool_choice="required").invoke(messages)
    messages.append(call)
    messages += [weather.invoke(tool_call) for tool_call in call.tool_calls]
    answer = llm.bind_tools([weather]).invoke(messages)
    return ([(type(m).__name__, m.content, getattr(m, "tool_calls", None)) for m in messages[1:]],
            answer.content, answer.response_metadata["finish_reason"])


def langchain_json_mode():
    """Asks with_structured_output(method="json_mode") for a City: it sends response_format
    json_object and no schema, so the prompt names the keys."""
    return chat_model(max_tokens=100).with_structured_output(City, method="json_mode").invoke(
        CITY_PROMPT + " Answer in JSON with the keys name, country and population.")


def langchain_responses_agent_loop():
    """Runs the agent's two turns on the Responses API (ChatOpenAI(use_responses_api=True)): a
    forced call, one only, its ToolMessage sent back as a function_call_output, the answer."""
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    weather = tool(get_weather)
    llm = chat_model(max_tokens=60, use_responses_api=True)
    messages = [HumanMessage(WEATHER_PROMPT)]
    call = llm.bind_tools([weather], tool_choice="required", parallel_tool_calls=False).invoke(messages)
    messages.append(call)
    messages += [weather.invoke(tool_call) for tool_call in call.tool_calls]
    answer = llm.bind_tools([weather]).invoke(messages)
    return call.tool_calls, answer.text, answer.response_metadata["status"]


# ---- instructor -----------------------------------------------------------------------------------
def instructor_client(mode_name: str):
    """Makes an instructor client in the named mode from an openai client."""
    import instructor
    return instructor.from_openai(openai_client(), mode=getattr(instructor.Mode, mode_name))


def instructor_tools():
    """Extracts a City with instructor's Mode.TOOLS, which sends City as a tool and names it in tool_choice."""
    return instructor_client("TOOLS").chat.completions.create(
        model=MODEL, response_model=City, temperature=0, max_tokens=100, max_retries=0,
        messages=[{"role": "user", "content": CITY_PROMPT}])


def instructor_tools_strict():
    """Extracts a City with Mode.TOOLS_STRICT, which sends the same tool with "strict": true."""
    return instructor_client("TOOLS_STRICT").chat.completions.create(
        model=MODEL, response_model=City, temperature=0, max_tokens=100, max_retries=0,
        messages=[{"role": "user", "content": CITY_PROMPT}])


def instructor_iterable():
    """Extracts cities with response_model=Iterable[City]: instructor asks for a list of them in one call."""
    cities = instructor_client("TOOLS").chat.completions.create(
        model=MODEL, response_model=Iterable[City], temperature=0, max_tokens=200, max_retries=0,
        messages=[{"role": "user", "content": CITIES_PROMPT}])
    return list(cities)


def instructor_iterable_cut():
    """Extracts cities from a text the 135M model repeats until max_tokens cuts the call short:
    the server sends no call and "length", and instructor raises IncompleteOutputException."""
    from instructor.core.exceptions import IncompleteOutputException
    try:
        instructor_client("TOOLS").chat.completions.create(
            model=MODEL, response_model=Iterable[City], temperature=0, max_tokens=200, max_retries=0,
            messages=[{"role": "user", "content": CITIES_CUT_PROMPT}])
    except IncompleteOutputException as e:
        return f"raised {type(e).__name__}: {e}"
    raise AssertionError("the call cut short was taken for a whole one")


# ---- pydantic-ai ----------------------------------------------------------------------------------
def pydantic_ai_agent(output_type):
    """Makes a pydantic-ai Agent on the server's chat completions (OpenAIChatModel), at temperature 0."""
    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    client = AsyncOpenAI(base_url=URL + "/v1", api_key="none", http_client=ahttp())
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client))
    return Agent(model, output_type=output_type, model_settings={"temperature": 0, "max_tokens": 100}, retries=0)


def pydantic_ai_tool_output():
    """Runs a pydantic-ai Agent with output_type=City: its default tool output (a final_result tool, "required")."""
    result = pydantic_ai_agent(City).run_sync(CITY_PROMPT)
    return result.output, [type(m).__name__ for m in result.all_messages()]


def pydantic_ai_stream_tool_output():
    """Streams the Agent's tool output (output_type=City) with run_stream."""
    import asyncio

    async def run():
        async with pydantic_ai_agent(City).run_stream(CITY_PROMPT) as result:
            output = await result.get_output()
            FINISHES.append(result.response.provider_details.get("finish_reason"))
            return output
    return asyncio.run(run())


def pydantic_ai_native_output():
    """Runs an Agent with NativeOutput(City), which sends City's schema as response_format."""
    from pydantic_ai import NativeOutput
    return pydantic_ai_agent(NativeOutput(City)).run_sync(CITY_PROMPT).output


# ---- LiteLLM --------------------------------------------------------------------------------------
def litellm_kw():
    """The arguments every LiteLLM row passes; client= is the HTTP handler LiteLLM would make,
    given so that the server's own finish reasons are recorded (LiteLLM turns a "stop" with
    calls into "tool_calls")."""
    from litellm.llms.custom_httpx.http_handler import HTTPHandler
    return {"model": "hosted_vllm/" + MODEL, "api_base": URL + "/v1", "api_key": "none", "temperature": 0,
            "max_tokens": 60, "client": HTTPHandler(client=http())}


def litellm_named_tool():
    """Calls LiteLLM's hosted_vllm/ provider with a named tool_choice."""
    import litellm
    out = litellm.completion(messages=[{"role": "user", "content": WEATHER_PROMPT}], tools=[WEATHER],
                             tool_choice={"type": "function", "function": {"name": "get_weather"}}, **litellm_kw())
    choice = out.choices[0]
    return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls], choice.finish_reason


def litellm_round_trip():
    """Makes LiteLLM's round trip: a forced call, the tool's result sent back, the model's answer."""
    import litellm
    messages = [{"role": "user", "content": WEATHER_PROMPT}]
    out = litellm.completion(messages=messages, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                             **litellm_kw())
    message = out.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": get_weather(**json.loads(call.function.arguments))})
    answer = litellm.completion(messages=messages, tools=[WEATHER], **litellm_kw())
    return ([(c.function.name, c.function.arguments) for c in message.tool_calls],
            answer.choices[0].message.content, answer.choices[0].finish_reason)


# ---- llm ------------------------------------------------------------------------------------------
def llm_schema():
    """Runs the llm CLI's --schema with a concise schema, through an extra-openai-models.yaml entry
    pointing at the server, with no max_tokens given."""
    with tempfile.TemporaryDirectory() as home:
        Path(home, "extra-openai-models.yaml").write_text(
            f"- model_id: nano\n  model_name: {MODEL}\n  api_base: {URL}/v1\n  supports_schema: true\n")
        env = {**os.environ, "LLM_USER_PATH": home}
        llm = str(Path(sys.executable).parent / "llm")
        out = subprocess.run([llm, "-m", "nano", "--schema", "name, country, population int", "-o", "temperature", "0",
                              CITY_PROMPT], env=env, capture_output=True, text=True, timeout=600)
        log = subprocess.run([llm, "logs", "-n", "1", "--json"], env=env, capture_output=True, text=True)
        FINISHES.extend(entry["response_json"]["finish_reason"] for entry in json.loads(log.stdout))
        return out.returncode, out.stdout.strip(), out.stderr.strip()[-500:]


# ---- openai -------------------------------------------------------------------------------------
def openai_parse():
    """Calls openai's chat.completions.parse(response_format=City)."""
    out = openai_client().chat.completions.parse(model=MODEL, temperature=0, max_tokens=100, response_format=City,
                                                 messages=[{"role": "user", "content": CITY_PROMPT}])
    return out.choices[0].message.parsed


def openai_responses_parse():
    """Calls openai's responses.parse(text_format=City)."""
    return openai_client().responses.parse(model=MODEL, input=CITY_PROMPT, text_format=City, max_output_tokens=100,
                                           temperature=0).output_parsed


# ---- openai Responses -----------------------------------------------------------------------------
def responses_stream_cut():
    """Reads openai's responses.stream(...).get_final_response() when max_output_tokens cuts the text short."""
    client = openai_client()
    with client.responses.stream(model=MODEL, input="Tell me a story.", max_output_tokens=8, temperature=0) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_response()
    FINISHES.append(final.status)
    return final.status, final.incomplete_details, repr(final.output_text), events[-1]


ROWS = [langchain_json_schema, langchain_function_calling, langchain_auto, langchain_named_tool, langchain_required,
        langchain_stream_required, langchain_agent_loop, langchain_json_mode, langchain_responses_agent_loop,
        instructor_tools, instructor_tools_strict, instructor_iterable, instructor_iterable_cut,
        pydantic_ai_tool_output, pydantic_ai_stream_tool_output, pydantic_ai_native_output,
        litellm_named_tool, litellm_round_trip,
        llm_schema,
        openai_parse, openai_responses_parse, responses_stream_cut]


def main() -> int:
    global URL
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", nargs="*", help="rows to run, by function name (default: all)")
    parser.add_argument("--url", default=URL)
    args = parser.parse_args()
    URL = args.url
    rows = [row for row in ROWS if not args.rows or row.__name__ in args.rows]
    raised = 0
    for row in rows:
        FINISHES.clear()
        print(f"== {row.__name__}: {' '.join(row.__doc__.split())}", flush=True)
        try:
            print("   result:", row())
        except Exception:
            raised += 1
            print("   RAISED:", traceback.format_exc().strip()[-1500:])
        print("   finish reasons:", FINISHES, flush=True)
    print(f"{len(rows) - raised} ran, {raised} raised")
    return 1 if raised else 0


if __name__ == "__main__":
    sys.exit(main())
