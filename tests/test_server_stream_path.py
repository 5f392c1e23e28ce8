"""The streaming path between the engine and a client, piece by piece, without a server: the
engine process's messages (a plain tuple for most tokens, a Chunk for the rest), the HTTP
process's dispatch of them, and the merging of chunks that piled up behind a busy consumer."""

from __future__ import annotations

import asyncio
import pickle
from types import SimpleNamespace

from radixlm.runtime.engine_process.client import EngineClient
from radixlm.runtime.engine_process.loop import EngineServer
from radixlm.runtime.engine_process.messages import Chunk, EngineError
from radixlm.runtime.server.generation import coalesce


def output(tokens: list[int], delta: str, index: int = 0, finish: str | None = None,
           logprobs: list | None = None) -> SimpleNamespace:
    """What Request.make_output gives the engine process: every token so far."""
    return SimpleNamespace(index=index, delta=delta, token_ids=tokens, logprobs=logprobs,
                           finish_reason=finish, prompt_tokens=7, cached_tokens=3,
                           text="abc", completion_tokens=len(tokens), matched_stop=None,
                           error=None, error_invalid=False, grammar_warnings=(),
                           queue_time=0.5, time_to_first_token=0.75, prompt_logprobs=None)


def test_engine_process_sends_new_tokens_as_tuples_and_the_rest_as_chunks():
    server = EngineServer(engine=None, conn=None)
    server.active["k"] = 2  # two samples
    sent: dict = {}
    first = server._message(("out", "k", output([5], "a"), 1.0), sent)
    assert first == ("tokens", "k", 0, "a", [5], 1.0, 7, 3)
    second = server._message(("out", "k", output([5, 6], "b"), 2.0), sent)
    assert second[:6] == ("tokens", "k", 0, "b", [6], 2.0)  # only the new token
    entry = SimpleNamespace(token_id=9, logprob=-0.5, top=None)
    other = server._message(("out", "k", output([9], "x", 1, logprobs=[entry]), 2.5), sent)
    assert other[0] == "chunk" and other[2].logprobs == [(9, -0.5, None)]
    last = server._message(("out", "k", output([5, 6, 7], "c", finish="length"), 3.0), sent)
    kind, key, chunk = last
    assert (kind, key, chunk.token_ids, chunk.finish_reason, chunk.text) == (
        "chunk", "k", [7], "length", "abc")
    assert chunk.time == 3.0 and chunk.prefill_time == 0.25
    assert server.active == {"k": 1}  # one sample left
    server._message(("out", "k", output([9, 8], "y", 1, finish="stop"), 4.0), sent)
    assert server.active == {} and sent == {}
    # The tuple is what makes a token cheap to send: far fewer bytes than the Chunk.
    assert len(pickle.dumps(first)) < len(pickle.dumps(("chunk", "k", chunk))) / 2


def test_http_process_turns_tuples_back_into_chunks():
    async def run() -> list:
        client = EngineClient({})
        sink: asyncio.Queue = asyncio.Queue()
        client._tracked["k"] = SimpleNamespace(sink=sink, remaining=1, group=None,
                                               detached=False)
        client._in_flight = 1
        final = Chunk(0, "b", [6], None, 2.0, finish_reason="stop", text="ab")
        client._dispatch([("tokens", "k", 0, "a", [5], 1.0, 7, 3), ("chunk", "k", final)])
        assert client.in_flight == 0 and not client.is_tracked("k")
        return [sink.get_nowait() for _ in range(sink.qsize())]

    (k1, first), (k2, last) = asyncio.run(run())
    assert k1 == k2 == "k"
    assert (first.delta, first.token_ids, first.time, first.prompt_tokens,
            first.cached_tokens, first.finished) == ("a", [5], 1.0, 7, 3, False)
    assert last.finished and last.text == "ab"


def test_coalesce_merges_each_samples_backlog():
    entry = (11, -0.1, None)
    items = [("k", Chunk(0, "He", [1], None, 1.0, prompt_tokens=4)),
             ("k", Chunk(1, "X", [7], [entry], 1.0)),
             ("k", Chunk(0, "llo", [2], None, 2.0, prompt_tokens=4)),
             ("k", Chunk(1, "Y", [8], None, 2.0)),
             ("k", Chunk(0, "!", [3], None, 3.0, finish_reason="length", text="Hello!",
                         completion_tokens=3, prompt_tokens=4)),
             ("j", EngineError(400, "bad input"))]
    merged = coalesce(items)
    assert [key for key, _ in merged] == ["k", "k", "j"]
    zero, one, error = (item for _, item in merged)
    assert (zero.delta, zero.token_ids, zero.logprobs, zero.time, zero.finish_reason,
            zero.text, zero.completion_tokens) == ("Hello!", [1, 2, 3], None, 3.0, "length",
                                                   "Hello!", 3)
    # Logprobs join (a chunk without them counts as none), in token order.
    assert (one.delta, one.token_ids, one.logprobs, one.finished) == ("XY", [7, 8], [entry],
                                                                        False)
    assert isinstance(error, EngineError)
    # A consumer that keeps up sees the chunks unchanged, and the inputs are not modified.
    assert coalesce(items[:1]) == items[:1]
    assert items[0][1].delta == "He" and items[0][1].token_ids == [1]
    # A sample's chunks after its last one (none ever come) would not be merged into it.
    done = ("k", Chunk(0, "", [], None, 1.0, finish_reason="stop"))
    late = ("k", Chunk(0, "z", [4], None, 2.0))
    assert coalesce([done, late]) == [done, late]


def test_a_busy_consumer_gets_one_merged_chunk_per_sample():
    """HttpGeneration.chunks: what piled up in the sink comes out merged; metrics still count
    every token."""
    from radixlm.runtime.config.sampling_params import SamplingParams
    from radixlm.runtime.server.args import ServerConfig
    from radixlm.runtime.server.generation import HttpGeneration
    from radixlm.runtime.server.metrics import Metrics

    state = SimpleNamespace(config=ServerConfig(), info=None, metrics=Metrics("m"))

    async def run() -> tuple[list, list]:
        gen = HttpGeneration(state, [[1, 2]], [SamplingParams(max_new_tokens=3)], ["k"])
        for i, token in enumerate((5, 6, 7)):
            gen._sink.put_nowait(("k", Chunk(0, f"t{i}", [token], None, 10.0 + i,
                                             finish_reason="length" if i == 2 else None,
                                             text="t0t1t2", completion_tokens=3)))
        return [chunk async for _, chunk in gen.chunks()], gen.samples

    chunks, samples = asyncio.run(run())
    assert len(chunks) == 1 and chunks[0].token_ids == [5, 6, 7] and chunks[0].finished
    assert samples[0].text == "t0t1t2" and samples[0].token_ids == [5, 6, 7]
    assert state.metrics.registry.get_sample_value("radixlm_generation_tokens_total",
                                                   {"model_name": "m"}) == 3
