"""openai-agents (PyPI ``openai-agents``) as a test client: one agent, one function tool, N turns.

The agent runs on the library's default model path, ``OpenAIResponsesModel``
(``POST /v1/responses``), through an ``AsyncOpenAI`` pointed at ``base_url``
with a throwaway key. The client is handed to the run (``RunConfig``'s
``OpenAIProvider``) rather than set as the process-wide default, so runs in
one test process never share it; tracing is off (it would upload to OpenAI).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

THROWAWAY_KEY = "sk-kvwarm-test-agents"
INSTRUCTIONS = "You are a weather assistant. Use get_weather to answer questions about the weather."


def weather_report(city: str) -> str:
    """What the tool answers: deterministic, so tests can find it in the upstream's requests."""
    return f"The weather in {city} is sunny, 21 C."


@dataclass(frozen=True)
class AgentsRun:
    """What a multi-turn openai-agents session did."""

    outputs: list[str]
    """The final output of each turn, in order."""
    tool_calls: list[dict[str, Any]]
    """Every tool invocation the library made: ``{"city": ...}``, in order."""
    history: list[Any]
    """The input list the next turn would send (``RunResult.to_input_list()`` of the last turn)."""


async def run_agent(
    base_url: str,
    prompts: Sequence[str],
    *,
    model: str | None = None,
    api_key: str = THROWAWAY_KEY,
    timeout: float = 60,  # noqa: ASYNC109 - per turn, passed to the client and wait_for
    max_turns: int = 6,
    stream: bool = False,
) -> AgentsRun:
    """Run one agent with one ``@function_tool`` for ``len(prompts)`` user turns against ``base_url``.

    Each turn sends the previous turn's history plus the next prompt, as a chat
    app built on the library does. ``model=None`` keeps the library's default model name;
    ``stream`` uses ``Runner.run_streamed`` (``"stream": true`` requests, SSE answers)
    instead of ``Runner.run`` (no ``stream`` key, JSON answers).
    """
    from agents import Agent, RunConfig, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_provider import OpenAIProvider
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[dict[str, Any]] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city.

        Args:
            city: The city's name.
        """
        calls.append({"city": city})
        return weather_report(city)

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout)
    agent_kwargs: dict[str, Any] = {"name": "Weather", "instructions": INSTRUCTIONS, "tools": [get_weather]}
    if model is not None:
        agent_kwargs["model"] = model
    agent = Agent(**agent_kwargs)
    config = RunConfig(
        model_provider=OpenAIProvider(openai_client=client, use_responses=True),
        tracing_disabled=True,
    )
    outputs: list[str] = []
    history: list[Any] = []
    try:
        for prompt in prompts:
            turn_input: Any = prompt if not history else [*history, {"role": "user", "content": prompt}]
            if stream:
                streamed = Runner.run_streamed(agent, turn_input, run_config=config, max_turns=max_turns)
                await asyncio.wait_for(_drain(streamed), timeout)
                result: Any = streamed
            else:
                result = await asyncio.wait_for(
                    Runner.run(agent, turn_input, run_config=config, max_turns=max_turns), timeout
                )
            outputs.append(str(result.final_output))
            history = result.to_input_list()
    finally:
        await client.close()
    return AgentsRun(outputs=outputs, tool_calls=calls, history=history)


async def _drain(streamed: Any) -> None:
    async for _event in streamed.stream_events():
        pass
