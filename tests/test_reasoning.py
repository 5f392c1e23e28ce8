"""Reasoning output: the thinking of `<think>` replies as `reasoning_content`, whole and
streamed, with the official `openai` SDK; the reply is forced into the shape with a regex,
since the tiny random model never thinks on its own."""

from __future__ import annotations

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.backends.server_process import ServerProcess
from radixlm.runtime.protocol import reasoning

from conftest import save_tiny_chat_model


@pytest.mark.parametrize(("parser", "text", "expected"), [
    ("qwen3", "<think>\nweigh it\n</think>\n\nYes.", ("weigh it", "Yes.")),
    ("qwen3", "Yes, no thinking.", (None, "Yes, no thinking.")),
    ("qwen3", "<think>\ncut off mid-thought", ("cut off mid-thought", "")),
    ("deepseek_r1", "weigh it</think>\n\nYes.", ("weigh it", "Yes.")),
    ("deepseek_r1", "<think>weigh it</think>Yes.", ("weigh it", "Yes.")),
    ("deepseek_r1", "never closed", ("never closed", "")),
])
def test_split(parser, text, expected):
    assert reasoning.split(parser, text) == expected


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(reasoning.PARSERS), st.text(alphabet="ab<>/think\n ", max_size=40),
       st.integers(1, 7))
def test_streamed_pieces_add_up_to_the_whole(parser, text, step):
    stream = reasoning.ReasoningStream(parser)
    parts = [stream.feed(text[i:i + step]) for i in range(0, len(text), step)]
    parts.append(stream.finish())
    thought, content = reasoning.split(parser, text)
    assert "".join(p[1] for p in parts) == content
    assert "".join(p[0] for p in parts).strip() == (thought or "")


@pytest.fixture(scope="module")
def client(tmp_path_factory, default_model_folder):
    folder = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-think"), default_model_folder)
    with ServerProcess(["--model", str(folder), "--reasoning-parser", "qwen3"]) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


THINKING = {"regex": r"<think>\n[a-z]{1,8}( [a-z]{1,8}){2}\n</think>\n\n[a-z]{1,8}( [a-z]{1,8}){2}"}


def test_reasoning_content_whole_and_streamed(client):
    body = dict(model="m", messages=[{"role": "user", "content": "Think, then answer."}],
                max_tokens=64, temperature=0, extra_body=THINKING)
    message = client.chat.completions.create(**body).choices[0].message
    thought, content = message.model_extra["reasoning_content"], message.content
    assert len(thought.split()) == 3 and len(content.split()) == 3
    assert "<think>" not in content and "</think>" not in thought
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            streamed["content"] += choice.delta.content or ""
            streamed["reasoning_content"] += (choice.delta.model_extra or {}).get(
                "reasoning_content") or ""
    assert streamed["content"] == content and streamed["reasoning_content"].strip() == thought
    whole = client.chat.completions.create(
        **{**body, "extra_body": {**THINKING, "separate_reasoning": False}}).choices[0].message
    assert whole.content.startswith("<think>") and "reasoning_content" not in (
        whole.model_extra or {})
