"""Interpreter semantics of the program language, against a deterministic fake backend."""

from __future__ import annotations

import threading
import time

import pytest

import radixlm as rl
from radixlm.backends.backend import Backend, Generation, Prompt
from radixlm.expr import DTYPE_REGEX
from radixlm.runtime.programs.choices import ChoiceScores


class FakeBackend(Backend):
    """Generates "<n>" where n counts the gens so far (or a scripted answer for a prompt
    suffix), scores choices from a table, and has a small chat template that, like many real
    ones, adds a default system message before a conversation that has none."""

    supports_cache_hints = True

    def __init__(self, answers=None, scores=None, fail_on=None, delay=0.0):
        self.answers = answers or {}
        self.scores = scores or {}
        self.fail_on = fail_on
        self.delay = delay
        self.calls: list[tuple[Prompt, object]] = []
        self.pins: list[str] = []
        self.released: list[int] = []
        self._lock = threading.Lock()

    def generate(self, prompt, params, on_delta=None):
        time.sleep(self.delay)
        with self._lock:
            self.calls.append((prompt, params))
            count = len(self.calls)
        if self.fail_on and prompt.text.endswith(self.fail_on):
            raise RuntimeError("backend exploded")
        text = next((a for suffix, a in self.answers.items() if prompt.text.endswith(suffix)),
                    f"<{count}>")
        if on_delta is not None:
            for ch in text:
                on_delta(ch, {"completion_tokens": 1})
        return Generation(text, {"finish_reason": "stop"})

    def score(self, prefix, choices, unconditional):
        cond = [self.scores[c] for c in choices]
        uncond = [self.scores["uncond:" + c] for c in choices] if unconditional else None
        return ChoiceScores(cond, uncond)

    def render_chat(self, messages, add_generation_prompt=False):
        out = "" if messages and messages[0]["role"] == "system" else "[sys]default[/sys]"
        for m in messages:
            out += f"[{m['role']}]{m['content']}[/{m['role']}]"
        return out

    def pin_prefix(self, text):
        self.pins.append(text)
        return len(self.pins) - 1

    def release_prefix(self, handle):
        self.released.append(handle)


def test_text_assembly_and_variables():
    @rl.function
    def qa(s, question):
        s += "Q: " + question + "\nA:" + rl.gen("answer", max_tokens=5)
        s += "\nDone."

    backend = FakeBackend(answers={"A:": " 42"})
    state = qa.run(question="six times seven?", backend=backend)
    assert state.text() == "Q: six times seven?\nA: 42\nDone."
    assert state["answer"] == " 42"
    assert state.error() is None
    prompt, params = backend.calls[0]
    assert prompt.text == "Q: six times seven?\nA:" and params.max_new_tokens == 5


def test_run_defaults_are_under_gen_fields():
    @rl.function
    def two(s):
        s += rl.gen("a") + rl.gen("b", temperature=0.5, max_tokens=3)

    backend = FakeBackend()
    two.run(backend=backend, temperature=0, max_tokens=9)
    (_, first), (_, second) = backend.calls
    assert (first.temperature, first.max_new_tokens) == (0, 9)
    assert (second.temperature, second.max_new_tokens) == (0.5, 3)


def test_bad_fields_fail_where_written():
    with pytest.raises(TypeError, match="max_tokenz"):
        rl.gen("x", max_tokenz=3)
    with pytest.raises(ValueError, match="temperature"):
        rl.gen("x", temperature=-1)
    with pytest.raises(ValueError, match="choices"):
        rl.select("x", choices=[])

    @rl.function
    def f(s, a):
        s += a

    with pytest.raises(TypeError, match="colour"):
        f.run(a="x", colour="red", backend=FakeBackend())
    with pytest.raises(ValueError, match="backend"):
        f.run(a="x")


def test_roles_render_through_the_chat_template():
    @rl.function
    def chat(s):
        s += rl.user("hi")
        s += rl.assistant(rl.gen("reply"))
        with s.user():
            s += "and " + rl.gen("more")

    backend = FakeBackend()
    state = chat.run(backend=backend)
    assert state.text() == ("[sys]default[/sys][user]hi[/user][assistant]<1>[/assistant]"
                            "[user]and <2>[/user]")
    assert state.messages() == [{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "<1>"},
                                {"role": "user", "content": "and <2>"}]
    # A gen sees the open role's messages too (what chat-only backends send).
    prompt, _ = backend.calls[0]
    assert prompt.open_role == "assistant" and prompt.messages[-1] == {
        "role": "assistant", "content": ""}


def test_system_first_has_no_default_and_nested_roles_fail():
    @rl.function
    def sys_first(s):
        s += rl.system("be brief") + rl.user("hi")

    assert sys_first.run(backend=FakeBackend()).text() == (
        "[system]be brief[/system][user]hi[/user]")

    @rl.function
    def nested(s):
        with s.user():
            s += rl.assistant("no")
        s += rl.gen("after")

    state = nested.run(backend=FakeBackend())
    assert "cannot nest" in str(state.error())
    with pytest.raises(rl.ProgramError, match="cannot nest"):
        state["after"]


def test_var_scope_and_dtype_conversion():
    @rl.function
    def typed(s):
        with s.var_scope("line"):
            s += "n=" + rl.gen("n", dtype=int)
        s += " ok=" + rl.gen("ok", dtype=bool) + " x=" + rl.gen("x", dtype=float)

    backend = FakeBackend(answers={"n=": "17", "ok=": "True", "x=": "-2.5"})
    state = typed.run(backend=backend)
    assert state["line"] == "n=17"
    assert state["n"] == 17 and state["ok"] is True and state["x"] == -2.5
    assert backend.calls[0][1].regex == DTYPE_REGEX[int]


def test_dtype_conversion_failure_is_an_error():
    @rl.function
    def typed(s):
        s += rl.gen("n", dtype=int)

    state = typed.run(backend=FakeBackend(answers={"": "many"}))
    with pytest.raises(rl.ProgramError, match="not a valid int"):
        state["n"]


@pytest.mark.parametrize("method, expected", [
    (rl.token_length_normalized, "bb"),           # means: a -1.0, bb -0.75, ccc -0.9
    (rl.greedy_token_selection, "a"),             # first tokens: a -1.0, bb -1.2, ccc -1.1
    (rl.unconditional_likelihood_normalized, "ccc"),  # gains: 0.5, 0.25, 1.9
])
def test_select_methods_on_fixed_logprobs(method, expected):
    scores = {"a": [-1.0], "bb": [-1.2, -0.3], "ccc": [-1.1, -0.5, -1.1],
              "uncond:a": [-1.5], "uncond:bb": [-1.5, -0.5], "uncond:ccc": [-3.0, -3.0, -3.1]}

    @rl.function
    def pick(s):
        s += "x:" + rl.select("v", choices=["a", "bb", "ccc"], choices_method=method)

    state = pick.run(backend=FakeBackend(scores=scores))
    assert state["v"] == expected and state.text() == "x:" + expected
    assert state.get_meta_info("v")["method"] == method.name


def test_greedy_selection_breaks_ties_on_later_tokens():
    scores = {"ab": [-0.5, -2.0], "ac": [-0.5, -0.1], "b": [-0.7]}

    @rl.function
    def pick(s):
        s += rl.select("v", choices=["ab", "ac", "b"],
                       choices_method=rl.greedy_token_selection)

    assert pick.run(backend=FakeBackend(scores=scores))["v"] == "ac"


def test_fork_gather_and_concat_with_lease():
    @rl.function
    def tips(s):
        s += "Tips:"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f" tip{i}=" + rl.gen("tip")
        gathered = s.join(forks, mode="gather")
        s += " | " + ",".join(gathered["tip"])
        again = s.fork(2)
        again += rl.gen("x")
        s.join(again, mode="concat")

    backend = FakeBackend()
    state = tips.run(backend=backend)
    assert sorted(state["tip"]) == ["<1>", "<2>", "<3>"]
    text = state.text()
    assert text.startswith("Tips: | ") and text.count("<") == 5
    assert backend.pins[0] == "Tips:" and backend.released == [0, 1]


def test_fork_lease_released_when_the_program_fails():
    @rl.function
    def broken(s):
        s += "prefix"
        forks = s.fork(2)
        forks += rl.gen("x")
        raise RuntimeError("user bug before join")

    backend = FakeBackend()
    state = broken.run(backend=backend)
    assert "user bug" in str(state.error())
    assert backend.released == [0]


def test_branch_errors_propagate_to_join():
    @rl.function
    def prog(s):
        forks = s.fork(2)
        forks[0] += "ok" + rl.gen("a")
        forks[1] += "BOOM" + rl.gen("a")
        s.join(forks)
        s += rl.gen("after")

    state = prog.run(backend=FakeBackend(fail_on="BOOM"))
    assert "backend exploded" in str(state.error())
    with pytest.raises(rl.ProgramError):
        state["after"]


def test_errors_never_hang_reads():
    @rl.function
    def prog(s):
        s += "BOOM" + rl.gen("a")
        s += rl.gen("b")
        s["b"]  # the program reads a value that can never come

    started = time.monotonic()
    state = prog.run(backend=FakeBackend(fail_on="BOOM"))
    assert time.monotonic() - started < 5
    assert "backend exploded" in str(state.error())
    with pytest.raises(KeyError, match="nope"):
        rl.function(lambda s: None).run(backend=FakeBackend())["nope"]


def test_reads_block_until_ready_so_python_can_branch():
    @rl.function
    def agent(s):
        s += "Think:" + rl.gen("thought")
        if s["thought"] == "<1>":
            s += " act:" + rl.gen("action")
        else:
            s += " stop"

    state = agent.run(backend=FakeBackend(delay=0.05))
    assert state["action"] == "<2>" and state.text() == "Think:<1> act:<2>"


def test_run_batch_preserves_order_and_warms_the_shared_prefix():
    @rl.function
    def qa(s, q):
        s += "Shared instructions. Q: " + q + " A:" + rl.gen("a")

    backend = FakeBackend(delay=0.01)
    states = qa.run_batch([{"q": str(i)} for i in range(12)], backend=backend,
                          concurrency=4, progress_bar=False)
    assert [s.text().split("Q: ")[1].split(" ")[0] for s in states] == [str(i)
                                                                        for i in range(12)]
    assert backend.pins == ["Shared instructions. Q: "] and backend.released == [0]

    # Tracing runs through a fork (which waits for the state) to the branches' first gen.
    @rl.function
    def forked(s, doc):
        s += "Document: " + doc
        forks = s.fork(2)
        forks += " Q:" + rl.gen("a")
        s.join(forks)

    backend = FakeBackend()
    forked.run_batch([{"doc": "d1"}, {"doc": "d2"}], backend=backend, progress_bar=False)
    assert backend.pins[0] == "Document: d"


def test_run_batch_isolates_failures():
    @rl.function
    def qa(s, q):
        s += q + rl.gen("a")

    states = rl.function(qa.fn).run_batch([{"q": "fine"}, {"q": "BOOM"}, {"q": "ok"}],
                                          backend=FakeBackend(fail_on="BOOM"),
                                          progress_bar=False)
    assert [s.error() is None for s in states] == [True, False, True]


def test_bind_and_use_backend():
    @rl.function
    def greet(s, name, punct):
        s += "Hello " + name + punct

    hello = greet.bind(punct="!")
    backend = FakeBackend()
    with rl.use_backend(backend):
        assert hello.run(name="Ada").text() == "Hello Ada!"
    with pytest.raises(TypeError, match="colour"):
        greet.bind(colour="red")


def test_streaming_yields_the_same_text():
    @rl.function
    def story(s):
        s += "Once" + rl.gen("a", max_tokens=8) + "." + rl.gen("b")

    backend = FakeBackend(answers={"Once": " upon a time"})
    state = story.run(backend=backend, stream=True)
    pieces = list(state.text_iter())
    assert "".join(pieces) == state.text() == "Once upon a time.<2>"
    assert len(pieces) > 4  # token by token, not one lump
    state2 = story.run(backend=FakeBackend(answers={"Once": " upon a time"}), stream=True)
    assert "".join(state2.text_iter("a")) == " upon a time"


def test_async_text_iter():
    import asyncio

    @rl.function
    def story(s):
        s += "Hi" + rl.gen("a")

    async def collect():
        state = story.run(backend=FakeBackend(), stream=True)
        return "".join([piece async for piece in state.text_async_iter()])

    assert asyncio.run(collect()) == "Hi<1>"


def test_a_read_waits_for_the_newest_value_of_a_reused_name():
    seen = []

    @rl.function
    def loop(s):
        for _ in range(3):
            s += rl.gen("step")
            seen.append(s["step"])  # must be this iteration's value, not the previous one

    state = loop.run(backend=FakeBackend(delay=0.05))
    assert seen == ["<1>", "<2>", "<3>"] and state.text() == "<1><2><3>"
