"""A LangChain agent (``langchain.agents.create_agent``, a LangGraph graph) on the local default model.

Two tools and a structured final answer, all grammar-constrained, with the MTP statistics of every model step:

    python examples/langgraph_agent.py
    python examples/langgraph_agent.py "What is the weather in Oslo, in Fahrenheit?" --policy latency
    python examples/langgraph_agent.py --base-url http://127.0.0.1:8000/v1     # the same agent, through
                                                              # `agent-mtp serve` and langchain-openai's ChatOpenAI

The default model is SmolLM2-135M-Instruct. Once a call is forced it fills the arguments well (copying from the
question and from earlier tool results), but on its own it rarely decides to start a call or which tool comes
first, and after a few calls it keeps imitating them instead of answering. So this agent uses the usual
small-model pattern, a fixed plan in a middleware: call the next unused tool (``tool_choice=<its name>``), then
answer with a JSON object matching ``WeatherAnswer`` (``response_format``, decoded under its JSON-schema grammar,
parsed by the agent into ``structured_response``). A larger model can drop the middleware and let
``tool_choice="auto"`` decide.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any, Literal

import torch
from langchain.agents import create_agent
from langchain.agents.middleware import ModelRequest, ModelResponse, wrap_model_call
from langchain.agents.structured_output import ProviderStrategy
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from agent_mtp import AgentMTPChat

WEATHER = {"paris": (18.0, "sunny"), "oslo": (4.0, "light rain"), "tokyo": (22.0, "cloudy")}


@tool
def get_weather(city: str) -> str:
    """Current weather in a city: temperature in degrees Celsius and the sky."""
    celsius, sky = WEATHER.get(city.strip().lower(), (15.0, "clear"))
    # JSON results with the argument names of the next tool are what a small model copies best.
    return json.dumps({"city": city, "celsius": celsius, "sky": sky})


@tool
def convert_temperature(celsius: float, unit: Literal["fahrenheit", "kelvin"]) -> str:
    """Convert a temperature in degrees Celsius to fahrenheit or kelvin."""
    value = celsius * 9 / 5 + 32 if unit == "fahrenheit" else celsius + 273.15
    return f"It is {value:.1f} degrees {unit.capitalize()}."


TOOLS = [get_weather, convert_temperature]


class WeatherAnswer(BaseModel):
    """The agent's final answer."""

    # maxLength bounds the string in the grammar too, so the answer always ends within max_tokens.
    answer: str = Field(
        max_length=120, description="one sentence for the user, with the temperature in the unit they asked for"
    )


@wrap_model_call
def tools_then_answer(request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]) -> ModelResponse:
    """Call the tools in order, each once (the model fills in the arguments), then give the structured answer."""
    used = {m.name for m in request.messages if isinstance(m, ToolMessage)}
    unused = [name for t in request.tools if (name := getattr(t, "name", None)) and name not in used]
    # With a provider-side response_format the agent binds model_settings, so the tool choice goes there.
    choice = unused[0] if unused else "none"
    return handler(request.override(model_settings={**request.model_settings, "tool_choice": choice}))


def build_agent(llm: BaseChatModel) -> Any:
    return create_agent(
        llm,
        tools=TOOLS,
        system_prompt="You are a weather assistant. Use the tools, then answer in one short sentence.",
        middleware=[tools_then_answer],
        response_format=ProviderStrategy(WeatherAnswer),
    )


def describe_step(message: AIMessage) -> str:
    """One line of MTP statistics for a model step."""
    mtp = message.response_metadata.get("mtp", {})
    policy = message.response_metadata.get("policy", {})
    if not mtp:  # through the server (ChatOpenAI): the statistics are in the response's agent_mtp field
        return "[served over the OpenAI API]"
    step = f"{policy.get('step_type', '-')}/{mtp.get('mode', '?')}"
    usage: dict[str, Any] = dict(message.usage_metadata or {})
    cached = (usage.get("input_token_details") or {}).get("cache_read", 0)  # read from the prefix cache
    return (
        f"[{step}: {mtp.get('new_tokens', 0)} tokens in {mtp.get('forward_passes', 0)} forward passes, "
        f"{mtp.get('tokens_per_forward', 0):.2f} tokens/forward, {mtp.get('jump_forward_tokens', 0)} jump-forward, "
        f"{cached}/{usage.get('input_tokens', 0)} prompt tokens cached, prefill {mtp.get('prefill_s', 0):.2f} s, "
        f"{mtp.get('wall_s', 0):.2f} s]"
    )


def print_message(message: BaseMessage) -> None:
    if isinstance(message, AIMessage):
        for call in message.tool_calls:
            print(f"  model -> {call['name']}({call['args']})")
        for bad in message.invalid_tool_calls:
            print(f"  model -> invalid tool call: {bad.get('error')}")
        if message.content:
            print(f"  model: {message.content}")
        print(f"         {describe_step(message)}")
    elif isinstance(message, ToolMessage):
        print(f"  tool {message.name}: {message.content}")
    else:
        print(f"  user: {message.content}")


def make_llm(*, policy: str | None, max_tokens: int, base_url: str | None = None, api_key: str = "") -> BaseChatModel:
    """AgentMTPChat in this process, or ChatOpenAI against `agent-mtp serve` at ``base_url`` (same policy)."""
    if base_url is None:
        if policy:
            return AgentMTPChat(policy=policy, max_tokens=max_tokens)
        return AgentMTPChat(mode="verified", max_tokens=max_tokens)
    from langchain_openai import ChatOpenAI

    options = {"policy": policy} if policy else {"mode": "verified"}
    return ChatOpenAI(
        base_url=base_url,
        api_key=api_key or "unused",  # type: ignore[arg-type]
        model="default",
        max_tokens=max_tokens,  # type: ignore[call-arg]
        temperature=0,
        extra_body={"agent_mtp": options},
    )


def run(
    question: str,
    *,
    policy: str | None = "default",
    max_tokens: int = 96,
    base_url: str | None = None,
    api_key: str = "",
) -> dict[str, Any]:
    """Run the agent on ``question``, printing each step; return the final state."""
    agent = build_agent(make_llm(policy=policy, max_tokens=max_tokens, base_url=base_url, api_key=api_key))
    state: dict[str, Any] = {"messages": [HumanMessage(question)]}
    print_message(state["messages"][0])
    for update in agent.stream(state, stream_mode="updates"):
        for node in update.values():
            for message in (node or {}).get("messages", []):
                print_message(message)
                state["messages"].append(message)
            if (node or {}).get("structured_response") is not None:
                state["structured_response"] = node["structured_response"]
    answer = state.get("structured_response")
    print(f"  answer: {answer.answer if isinstance(answer, WeatherAnswer) else answer}")
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default="What is the weather in Paris, in Fahrenheit?")
    parser.add_argument("--policy", default="default", help="default, latency, exact, a YAML path, or none")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--base-url", default=None, help="an `agent-mtp serve` server, e.g. http://127.0.0.1:8000/v1")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    policy = None if args.policy == "none" else args.policy
    api_key = os.environ.get("OPENAI_API_KEY", "")
    run(args.question, policy=policy, max_tokens=args.max_tokens, base_url=args.base_url, api_key=api_key)


if __name__ == "__main__":
    main()
