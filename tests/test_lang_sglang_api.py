"""The language's SGLang-compatible surface (SGLang's frontend API is a subset of ours) and
`radixlm.compat.sglang`, on the recording backend of test_lang."""

from __future__ import annotations

import asyncio
import threading

import pytest
from test_lang import FakeBackend

import radixlm as rl
import radixlm.compat.sglang as sgl
from radixlm.expr import DTYPE_REGEX, Select


def test_gen_takes_sglangs_positional_fields_and_dtype_names():
    assert rl.gen("a", 64).sampling == {"max_new_tokens": 64}
    assert rl.gen("a", 64, 2, None, ["\n"]).sampling == {
        "max_new_tokens": 64, "min_new_tokens": 2, "stop": ["\n"]}
    assert rl.gen_int("a", 8).sampling == {"max_new_tokens": 8, "regex": DTYPE_REGEX[int]}
    assert rl.gen("a", dtype="int").dtype is int and rl.gen("a", dtype="string").dtype is str
    assert rl.gen("a", temperature=None).sampling == {}  # None is unset, as in SGLang
    assert rl.gen("a", return_text_in_logprobs=True).sampling == {}
    with pytest.raises(TypeError, match="by position and by name"):
        rl.gen("a", 64, max_tokens=3)
    with pytest.raises(TypeError, match="dtype"):
        rl.gen("a", dtype="complex")
    pick = rl.gen("a", choices=["x", "y"], choices_method=rl.greedy_token_selection)
    assert isinstance(pick, Select) and pick.method is rl.greedy_token_selection
    assert rl.select("a", ["x"], 0.0, rl.greedy_token_selection).method is rl.greedy_token_selection
    with pytest.raises(ValueError, match="temperature must be 0"):
        rl.select("a", ["x", "y"], temperature=0.5)


def test_numbers_end_at_a_space_or_newline_the_model_prefers():
    @rl.function
    def count(s):
        s += "n=" + rl.gen_int("n") + ";"

    state = count.run(backend=FakeBackend(answers={"n=": "24\n"}))
    assert state["n"] == 24 and state.text() == "n=24;"


def test_compat_typed_gens_keep_their_text_as_sglang_does():
    @sgl.function
    def typed(s):
        s += "n=" + sgl.gen("n", dtype=int) + ";" + sgl.gen_int("m") + ";"

    state = typed.run(backend=FakeBackend(answers={"n=": "24\n", ";": "7"}))
    assert state["n"] == "24" and state["m"] == "7"  # SGLang: int(state["n"]) is the caller's

    @rl.function
    def ours(s):
        s += "n=" + rl.gen("n", dtype=int) + ";" + rl.gen_int("m") + ";"

    state = ours.run(backend=FakeBackend(answers={"n=": "24\n", ";": "7"}))
    assert state["n"] == 24 and state["m"] == 7  # radixlm converts


def test_state_items_contains_and_role_markers():
    @rl.function
    def chat(s):
        s += rl.system_begin() + "Be brief." + rl.system_end()
        s.user("Hi")  # SGLang's form: appends a whole message
        s += rl.assistant_begin() + rl.gen("reply") + rl.assistant_end()
        s["note"] = "set by the program"

    state = chat.run(backend=FakeBackend(answers={"[assistant]": "Hello"}))
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant"]
    assert state["note"] == "set by the program" and "reply" in state and "x" not in state
    with pytest.raises(ValueError, match="text-only"):
        rl.image("cat.png")


def test_fork_group_join_callable_and_list_appends_and_mode_names():
    @rl.function
    def branches(s):
        forks = s.fork(3)
        forks += lambda i: f"<{i}>"
        forks += ["a", "b", "c"]
        forks += rl.gen("x")
        forks.join()  # SGLang's form, gather_variable
        more = s.fork(2)
        more += ["[p]", "[q]"]
        more.join(mode="concate_and_append")
        with s.copy() as c:
            c += rl.gen("y")

    state = branches.run(backend=FakeBackend(answers={"<0>a": "0", "<1>b": "1", "<2>c": "2"}))
    assert state["x"] == ["0", "1", "2"] and state.text() == "[p][q]"
    assert state["y"] == [state["y"][0]]

    @rl.function
    def mismatched(s):
        forks = s.fork(2)
        forks += ["a", "b", "c"]

    with pytest.raises(ValueError, match="3 items for 2"):
        raise mismatched.run(backend=FakeBackend()).error()


def test_streamed_pieces_carry_their_meta_info():
    @rl.function
    def story(s):
        s += "Once" + rl.gen("tale")

    async def collect(state):
        return [piece async for piece in state.text_async_iter("tale", return_meta_data=True)]

    state = story.run(backend=FakeBackend(answers={"Once": " upon"}), stream=True)
    pieces = asyncio.run(collect(state))
    assert "".join(t for t, _ in pieces) == " upon"
    assert all(meta == {"completion_tokens": 1} for _, meta in pieces)


def test_default_backend_applies_to_every_thread():
    @rl.function
    def hello(s):
        s += rl.gen("x")

    backend = FakeBackend(answers={"": "hi"})
    rl.set_default_backend(backend)
    try:
        result = {}
        worker = threading.Thread(target=lambda: result.update(x=hello.run()["x"]))
        worker.start()
        worker.join()
        assert result["x"] == "hi" and sgl.global_config.default_backend is backend
        assert rl.get_server_info() == {} and rl.flush_cache() is False
    finally:
        rl.set_default_backend(None)


def test_run_batch_takes_tuples_threads_and_yields_in_order():
    @rl.function
    def echo(s, word, suffix="!"):
        s += word + suffix + rl.gen("x")

    backend = FakeBackend(answers={"a!": "1", "b?": "2"})
    states = echo.run_batch([("a",), ("b", "?")], backend=backend, num_threads=2,
                            progress_bar=False)
    assert [st["x"] for st in states] == ["1", "2"]
    stream = echo.run_batch([{"word": "a"}, {"word": "b", "suffix": "?"}], backend=backend,
                            generator_style=True, progress_bar=False)
    assert [st["x"] for st in stream] == ["1", "2"]
    assert echo.trace(backend=backend, word="a") == "a!"


def test_compat_module_keeps_sglangs_meanings():
    @sgl.function
    def broken(s):
        s += sgl.user() + "after"
        raise RuntimeError("the program's own bug")

    with pytest.raises(RuntimeError, match="own bug"):  # SGLang: run() raises it
        broken.run(backend=FakeBackend())

    @sgl.function(num_api_spec_tokens=64)
    def fine(s):
        s += sgl.user() + "after"

    state = fine.run(backend=FakeBackend())
    assert state.messages() == [{"role": "user", "content": ""}]  # an empty message
    with pytest.raises(AttributeError, match="offline engine"):
        sgl.Engine


def test_separate_reasoning_keeps_the_answer_in_the_text_and_variable():
    @sgl.function
    def think(s):
        s += "Q: 2+2?\nA:" + sgl.separate_reasoning(sgl.gen("a"), model_type="deepseek-r1")
        s += "\nDone."

    state = think.run(backend=FakeBackend(answers={"A:": "add them</think>\n\n4"}))
    assert state["a"] == "4" and state["a_reasoning_content"] == "add them"
    assert state.text() == "Q: 2+2?\nA:4\nDone."
    with pytest.raises(ValueError, match="model_type"):
        rl.separate_reasoning(rl.gen("a"), model_type="gpt")
