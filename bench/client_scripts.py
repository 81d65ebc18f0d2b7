"""The conversation each agent client holds in ``specgate bench clients``, written the way
its own documentation writes a tool loop: a weather question, the tool's result, a
follow-up question.  No client names a session; each resends its history its own way."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

SYSTEM = "You are a weather assistant. Use the get_weather tool, then answer in one sentence."
QUESTIONS = ("What's the weather in Oslo right now?", "And in Bergen?")
MAX_TOKENS = 96
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OPENAI_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city.",
                                                 "parameters": PARAMS}}
ROUNDS = 2  # model calls per question: the call, then the answer (the 1.5B often calls again: not followed)


def get_weather(city: str) -> str:
    """Get the weather for a city."""
    return f"{city}: 21 degrees and sunny, light wind from the west."


def weather_for(arguments: str | dict[str, Any]) -> str:
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        args = {}
    return get_weather(str(args.get("city", "Oslo")) if isinstance(args, dict) else "Oslo")


def _openai_client(base: str, key: str) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=900)


def _chat_model(base: str, key: str) -> Any:
    from langchain_openai import ChatOpenAI

    settings: dict[str, Any] = {"base_url": base + "/v1", "api_key": key, "model": "specgate", "temperature": 0,
                                "max_tokens": MAX_TOKENS, "max_retries": 0}
    return ChatOpenAI(**settings)


async def openai_chat(base: str, key: str, questions: tuple[str, ...] = QUESTIONS) -> list[dict[str, Any]]:
    """The official SDK's tool loop; returns each response's usage."""
    usages = []
    async with _openai_client(base, key) as client:
        messages: list[Any] = [{"role": "system", "content": SYSTEM}]
        for q in questions:
            messages.append({"role": "user", "content": q})
            for _ in range(ROUNDS):
                r = await client.chat.completions.create(model="specgate", messages=messages, tools=[OPENAI_TOOL],
                                                         max_tokens=MAX_TOKENS, temperature=0)
                usages.append(r.usage.model_dump() if r.usage else {})
                msg = r.choices[0].message
                messages.append(msg.model_dump(exclude_none=True))
                if not msg.tool_calls:
                    break
                messages += [{"role": "tool", "tool_call_id": c.id, "content": weather_for(c.function.arguments)}
                             for c in msg.tool_calls]
    return usages


async def langchain(base: str, key: str) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool

    weather = tool(get_weather)
    llm = _chat_model(base, key).bind_tools([weather])
    messages: list[Any] = [SystemMessage(SYSTEM)]
    for q in QUESTIONS:
        messages.append(HumanMessage(q))
        for _ in range(ROUNDS):
            reply = await llm.ainvoke(messages)
            messages.append(reply)
            if not isinstance(reply, AIMessage) or not reply.tool_calls:
                break
            messages += [ToolMessage(weather.invoke(c["args"]), tool_call_id=c["id"]) for c in reply.tool_calls]


async def langgraph(base: str, key: str) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage
    from langgraph.errors import GraphRecursionError
    from langgraph.prebuilt import create_react_agent

    agent = create_react_agent(_chat_model(base, key), [get_weather])
    state: dict[str, Any] = {"messages": [SystemMessage(SYSTEM)]}
    for q in QUESTIONS:
        state = {"messages": [*state["messages"], HumanMessage(q)]}
        try:  # recursion_limit 4: a call, the tool, the answer (a model that calls again stops here)
            state = await agent.ainvoke(state, config={"recursion_limit": 4})
        except GraphRecursionError:
            return


async def pydantic_ai(base: str, key: str) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import UsageLimitExceeded
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    model = OpenAIChatModel("specgate", provider=OpenAIProvider(openai_client=_openai_client(base, key)))
    agent = Agent(model, system_prompt=SYSTEM, tools=[get_weather],
                  model_settings={"max_tokens": MAX_TOKENS, "temperature": 0})
    history: list[Any] = []
    for q in QUESTIONS:
        try:
            result = await agent.run(q, message_history=history, usage_limits=UsageLimits(request_limit=ROUNDS))
        except UsageLimitExceeded:
            return
        history = result.all_messages()


async def instructor(base: str, key: str) -> None:
    import instructor as instructor_lib
    from pydantic import BaseModel

    class Meeting(BaseModel):
        city: str
        day: str

    client = instructor_lib.from_openai(_openai_client(base, key))  # TOOLS mode: a forced call
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Extract the meeting's city and day."}]
    for text in ("Let's meet in Oslo on Friday.", "Lunch in Bergen on Monday instead.", "Make it Tromso, Sunday."):
        messages.append({"role": "user", "content": text})
        meeting = await client.chat.completions.create(model="specgate", response_model=Meeting, messages=messages,
                                                       max_tokens=MAX_TOKENS, temperature=0, max_retries=0)
        messages.append({"role": "assistant", "content": meeting.model_dump_json()})  # as instructor's docs do


async def litellm(base: str, key: str) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its bundled price list: no fetch offline
    import litellm as litellm_lib

    messages: list[Any] = [{"role": "system", "content": SYSTEM}]
    for q in QUESTIONS:
        messages.append({"role": "user", "content": q})
        for _ in range(ROUNDS):
            r = await litellm_lib.acompletion(model="openai/specgate", api_base=base + "/v1", api_key=key,
                                              messages=messages, tools=[OPENAI_TOOL], max_tokens=MAX_TOKENS,
                                              temperature=0, num_retries=0)
            msg = r.choices[0].message
            messages.append(msg)  # LiteLLM's docs append the message object itself
            if not msg.tool_calls:
                break
            messages += [{"role": "tool", "tool_call_id": c.id, "content": weather_for(c.function.arguments)}
                         for c in msg.tool_calls]


async def openai_agents(base: str, key: str) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from agents.exceptions import MaxTurnsExceeded

    set_tracing_disabled(True)
    agent = Agent(name="weather", instructions=SYSTEM, tools=[function_tool(get_weather)],
                  model=OpenAIResponsesModel("specgate", _openai_client(base, key)),
                  model_settings=ModelSettings(max_tokens=MAX_TOKENS, temperature=0))
    items: list[Any] = []
    for q in QUESTIONS:
        try:
            result = await Runner.run(agent, [*items, {"role": "user", "content": q}], max_turns=ROUNDS)
        except MaxTurnsExceeded:
            return
        items = result.to_input_list()


async def anthropic(base: str, key: str) -> None:
    import anthropic as anthropic_lib

    tool = {"name": "get_weather", "description": "Get the weather for a city.", "input_schema": PARAMS}
    client = anthropic_lib.AsyncAnthropic(base_url=base, api_key=key, max_retries=0, timeout=900)
    messages: list[Any] = []
    for q in QUESTIONS:
        messages.append({"role": "user", "content": q})
        for _ in range(ROUNDS):
            r = await client.messages.create(model="specgate", system=SYSTEM, tools=[tool],  # type: ignore[list-item]
                                             messages=messages, max_tokens=MAX_TOKENS)
            messages.append({"role": "assistant", "content": r.content})  # as the SDK's docs do
            calls = [b for b in r.content if b.type == "tool_use"]
            if not calls:
                break
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b.id, "content": weather_for(b.input)} for b in calls]})
    await client.close()


async def two_at_once(base: str, key: str) -> dict[str, Any]:
    """Two plain ``openai`` agents under one key, each on its own conversation, at once: each
    later request's cached tokens, as its client sees them."""
    cities = (("What's the weather in Lisbon?", "And in Porto?"), ("What's the weather in Kyoto?", "And in Osaka?"))
    runs = await asyncio.gather(*(openai_chat(base, key, qs) for qs in cities))
    agents = []
    for usages in runs:
        rows = [{"prompt_tokens": u.get("prompt_tokens", 0), "reply_tokens": u.get("completion_tokens", 0),
                 "cached": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)} for u in usages]
        agents.append(rows)
    later = [r["cached"] / (prev["prompt_tokens"] + prev["reply_tokens"])
             for rows in agents for prev, r in zip(rows, rows[1:], strict=False) if prev["prompt_tokens"]]
    return {"agents": agents, "min_share": round(min(later), 3) if later else None}
