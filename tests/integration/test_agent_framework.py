"""A real agent framework, unchanged, pointed at the gateway: LangChain's ChatOpenAI with
one tool, on the real pair.  It names its session only by header (created on first use),
gets a parsed tool call back, returns the tool's result as a ToolMessage, and continues
the same session.  (What the 1.5B says after the tool result is not asserted: it tends to
repeat the call.)"""

from __future__ import annotations

import httpx
import pytest

from core.models import model_files
from tests.support import real_model, start_gateway

pytestmark = pytest.mark.real


def test_langchain_chat_openai_tool_loop():
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        return f"{city}: 21 degrees and sunny"

    gw = start_gateway(real_model(model_files.TARGET), real_model(model_files.SPECULATOR))
    try:
        llm = ChatOpenAI(base_url=gw.base + "/v1", api_key="unused", model="specgate", temperature=0,
                         max_tokens=64, max_retries=0, default_headers={"X-SpecGate-Session": "langchain-run-1"})
        agent = llm.bind_tools([get_weather])
        messages = [HumanMessage("What's the weather in Oslo right now?")]
        first = agent.invoke(messages)
        (call,) = first.tool_calls
        assert call["name"] == "get_weather" and call["args"] == {"city": "Oslo"}
        messages += [first, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
        final = agent.invoke(messages)  # LangChain's ToolMessage round trip is accepted...
        # ...and continues the same session: the second request reused the first one's KV
        assert final.usage_metadata["input_token_details"]["cache_read"] >= first.usage_metadata["input_tokens"]
        view = httpx.get(f"{gw.base}/v1/sessions/langchain-run-1").json()
        assert view["turns"] == 2  # the header alone created and continued the session
    finally:
        gw.stop()
