"""A tool-using agent on the Responses API, against a radixlm server (or any server that
speaks it): the model calls functions, we run them and send their outputs back with
`previous_response_id`, so the server keeps the conversation (and its prefix cache keeps the
earlier turns' KV) until the model answers in text.

    radixlm serve --model Qwen/Qwen2.5-1.5B-Instruct &
    python examples/server/responses_agent.py "What should I wear in Oslo and in Rome today?"
"""

from __future__ import annotations

import argparse
import json

from openai import OpenAI

TOOLS = [{"type": "function", "name": "get_weather", "description": "Today's weather.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}]


def get_weather(city: str) -> dict:
    table = {"oslo": (-3, "snow"), "rome": (17, "sun")}
    temp_c, sky = table.get(city.lower(), (12, "clouds"))
    return {"city": city, "temp_c": temp_c, "sky": sky}


def run(client: OpenAI, model: str, question: str, max_turns: int = 4,
        max_output_tokens: int = 256) -> list[str]:
    """The agent's transcript: each function call made and the final answer."""
    transcript: list[str] = []
    response = client.responses.create(model=model, input=question, tools=TOOLS,
                                       instructions="Use the tools, then answer briefly.",
                                       max_output_tokens=max_output_tokens, temperature=0)
    for _ in range(max_turns):
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            break
        outputs = []
        for call in calls:
            result = get_weather(**json.loads(call.arguments))
            transcript.append(f"{call.name}({call.arguments}) -> {json.dumps(result)}")
            outputs.append({"type": "function_call_output", "call_id": call.call_id,
                            "output": json.dumps(result)})
        response = client.responses.create(model=model, previous_response_id=response.id,
                                           input=outputs, tools=TOOLS, temperature=0,
                                           max_output_tokens=max_output_tokens)
    transcript.append(response.output_text)
    return transcript


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("question", nargs="?", default="What should I wear in Oslo today?")
    parser.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    parser.add_argument("--model", default="default")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="none")
    for line in run(client, args.model, args.question):
        print(line)


if __name__ == "__main__":
    main()
