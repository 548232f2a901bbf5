"""Quick start: AgentMTPChat as a drop-in LangChain chat model on the embedded default model (SmolLM2-135M).

    python examples/quickstart.py

Shows invoke (with the MTP statistics), streaming (one chunk per forward pass), a forced tool call, structured
output and async use. Every call decodes under the shipped ``default`` policy.
"""

from __future__ import annotations

import asyncio

import torch
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from agent_mtp import AgentMTPChat


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"{city}: 18 degrees Celsius, sunny"


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(max_length=40)
    country: str = Field(max_length=40)


def stats(message: object) -> str:
    meta = getattr(message, "response_metadata", {})
    mtp = meta.get("mtp", {})
    return (
        f"{mtp.get('new_tokens')} tokens, {mtp.get('forward_passes')} forward passes "
        f"({mtp.get('tokens_per_forward')} tokens/forward, {mtp.get('jump_forward_tokens')} jump-forward), "
        f"mode {mtp.get('mode')}, step {meta.get('policy', {}).get('step_type')}"
    )


def main() -> None:
    torch.set_num_threads(1)
    llm = AgentMTPChat(max_tokens=64)

    msg = llm.invoke("Name three primary colours.")
    print("invoke:", msg.content)
    print("       ", stats(msg), "| usage", msg.usage_metadata)

    print("stream:", end=" ")
    for chunk in llm.stream("Count from one to five."):
        print(chunk.content, end="|", flush=True)  # one chunk per forward pass
    print()

    call = llm.bind_tools([get_weather], tool_choice="any").invoke("What is the weather in Paris?")
    print("tool call:", call.tool_calls[0]["name"], call.tool_calls[0]["args"])
    print("          ", stats(call))

    city = llm.with_structured_output(City).invoke("Which city is the Eiffel Tower in?")
    print("structured:", repr(city))

    answer = asyncio.run(llm.ainvoke("Say hello in French."))
    print("async:", answer.content)


if __name__ == "__main__":
    main()
