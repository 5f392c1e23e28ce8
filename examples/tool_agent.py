"""An agent with OpenAI-style tools: the model calls functions (`rl.tool_call`), Python runs
them, the results go back as tool messages (`rl.tool`), and the model answers. The calls are
valid by construction: with `tool_choice="required"` decoding follows the tools' schemas.

    python examples/tool_agent.py
"""

from __future__ import annotations

import argparse
import json

import radixlm as rl

WEATHER = {"paris": (18, "cloudy"), "tokyo": (24, "sunny"), "oslo": (7, "rain")}


def get_weather(city: str) -> dict:
    temp, sky = WEATHER.get(city.strip().lower(), (None, "unknown"))
    return {"city": city, "temp_c": temp, "sky": sky}


def convert(celsius: float) -> dict:
    return {"fahrenheit": round(celsius * 9 / 5 + 32, 1)}


FUNCTIONS = {"get_weather": get_weather, "convert": convert}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Tokyo", "Oslo"]}},
            "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "convert", "description": "Celsius to Fahrenheit.",
        "parameters": {"type": "object", "properties": {"celsius": {"type": "number"}},
                       "required": ["celsius"], "additionalProperties": False}}},
]


@rl.function
def agent(s, question, max_tokens=48):
    s += rl.system("You are a weather assistant. Use the tools, then answer in one sentence.")
    s += rl.user(question)
    s += rl.assistant(rl.tool_call("calls", tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False, max_tokens=64))
    for call in s["calls"]:  # Python runs each call and hands back its result
        result = FUNCTIONS[call["name"]](**call["arguments"])
        s += rl.tool(json.dumps(result), tool_call_id=call["id"])
    s += rl.assistant("Based on the tool result," + rl.gen("answer", max_tokens=max_tokens,
                                                           stop="\n"))


def main(backend: rl.Backend, max_tokens: int = 48) -> list[dict]:
    calls = []
    for question in ["What's the weather like in Tokyo?", "Is it raining in Oslo?"]:
        state = agent.run(question=question, backend=backend, temperature=0,
                          max_tokens=max_tokens)
        for call in state["calls"]:
            print(f"{question}\n  call:   {call['name']}({json.dumps(call['arguments'])})")
            calls.append(call)
        print(f"  answer: {state['answer'].strip()}\n")
    return calls


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=48)
    with rl.Engine() as engine:
        main(engine, parser.parse_args().max_tokens)
