"""SGLang's own test programs (`sglang.test.test_programs`, from the sglang package installed
without its runtime) against `radixlm serve`, two ways:

- `sglang`: SGLang's real frontend, unmodified, through `sgl.RuntimeEndpoint` (our protocol);
- `compat`: the same program functions with `sgl` bound to `radixlm.compat.sglang` (our
  language).

The server runs a tiny random-weight Llama with SmolLM2's tokenizer, so the programs' answers
are nonsense: a program may end in a wrong answer, which is fine, but never in a protocol or
API error. An outcome is "wrong answer" when the exception comes from the program's own code
(its value checks, or its Python acting on a generated value, such as `eval` in tool_use), and
"fails" when it comes from the frontend, our language or the server.
"""

from __future__ import annotations

import importlib.util
import signal
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from conftest import save_tiny_chat_model

sglang = pytest.importorskip("sglang", reason="the test extra installs sglang's frontend")
from sglang.test import test_programs  # noqa: E402

import radixlm.compat.sglang as compat  # noqa: E402
from radixlm.backends.server_process import ServerProcess  # noqa: E402

PROGRAM_TIMEOUT_S = 120

# name -> keyword arguments of the test function.
PROGRAMS: dict[str, dict[str, Any]] = {
    "few_shot_qa": {}, "mt_bench": {}, "select": {"check_answer": False}, "decode_int": {},
    "decode_json_regex": {}, "decode_json": {}, "expert_answer": {}, "tool_use": {},
    "react": {}, "parallel_decoding": {}, "parallel_encoding": {}, "stream": {},
    "stream_logprobs": {}, "regex": {}, "dtype_gen": {}, "gen_min_new_tokens": {},
}

# Programs whose checks need a model that answers well (the rest check the protocol: message
# counts, regex and type constraints, stream shapes, and must pass).
MODEL_DEPENDENT = {"few_shot_qa", "decode_int", "decode_json", "expert_answer", "tool_use",
                   "react", "parallel_encoding"}
# SGLang's frontend pairs the text that arrived since its iterator last woke with the meta info
# of the latest event only; when tokens come faster than it wakes (a tiny model on a CPU), the
# logprobs of the events in between are skipped and the program's shape check fails.
FRONTEND_RACES = {("sglang", "stream_logprobs")}

# Programs that cannot run here whatever the server does, and why.
CANNOT_RUN = {
    "gen_min_new_tokens": "imports sglang's get_tokenizer, which needs torchvision, which has no "
                          "build for this torch",
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_model_folder) -> Path:
    """A random Llama with SmolLM2's tokenizer and room for the programs' long prompts."""
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-sglang"), default_model_folder,
                                max_position_embeddings=4096)


@pytest.fixture(scope="module")
def server(tiny_model):
    with ServerProcess(["--model", str(tiny_model), "--max-total-tokens", "16384"]) as process:
        yield process


def _programs_on(sgl: Any) -> ModuleType:
    """A fresh copy of SGLang's test_programs module whose `sgl` is `sgl`."""
    spec = importlib.util.spec_from_file_location("sglang_test_programs", test_programs.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.sgl = sgl
    return module


def _timeout(signum: int, frame: Any) -> None:
    raise TimeoutError(f"the program ran longer than {PROGRAM_TIMEOUT_S} s")


def outcome(module: ModuleType, name: str) -> tuple[str, str]:
    """("pass" | "wrong answer" | "fails", detail) of test_<name>."""
    previous = signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(PROGRAM_TIMEOUT_S)
    try:
        getattr(module, f"test_{name}")(**PROGRAMS[name])
        return "pass", ""
    except Exception as exc:  # noqa: BLE001 - classified below
        # The deepest frame of the program, the frontend or radixlm (not of the standard
        # library, e.g. json.loads on a generated text) says whose the error is.
        frames = [f for f in traceback.extract_tb(exc.__traceback__)
                  if any(part in ("sglang", "radixlm", "lang", "runtime")
                         for part in Path(f.filename).parts)]
        where = frames[-1] if frames else traceback.extract_tb(exc.__traceback__)[-1]
        detail = f"{type(exc).__name__}: {str(exc)[:200]!r} at {Path(where.filename).name}:" \
                 f"{where.lineno}"
        own_code = Path(where.filename).name == "test_programs.py"
        # Reading a variable the model's choices never produced (react without "Finish").
        own_code |= isinstance(exc, KeyError) and any(
            Path(f.filename).name == "test_programs.py" and "ret[" in (f.line or "")
            for f in traceback.extract_tb(exc.__traceback__))
        return ("wrong answer" if own_code else "fails"), detail
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("mode", ["sglang", "compat"])
def test_sglangs_programs_run(server, mode):
    if mode == "sglang":
        sglang.set_default_backend(sglang.RuntimeEndpoint(server.url))
        module = _programs_on(sglang)
    else:
        compat.set_default_backend(compat.RuntimeEndpoint(server.url))
        # Programs that import sglang themselves find the same backend there.
        sglang.global_config.default_backend = compat.global_config.default_backend
        module = _programs_on(compat)
    try:
        results = {name: outcome(module, name) for name in PROGRAMS if name not in CANNOT_RUN}
    finally:
        sglang.set_default_backend(None)
        compat.set_default_backend(None)
    width = max(map(len, PROGRAMS))
    print(f"\nSGLang test programs, {mode} frontend:")
    for name, (result, detail) in results.items():
        print(f"  {name:<{width}}  {result:<12}  {detail}")
    failed = {n: d for n, (r, d) in results.items() if r == "fails"
              or (r == "wrong answer" and n not in MODEL_DEPENDENT
                  and (mode, n) not in FRONTEND_RACES)}
    assert not failed, f"programs that failed on a protocol or API error: {failed}"


def test_runtime_starts_a_server_and_is_its_endpoint(tiny_model):
    @compat.function
    def hello(s):
        s += "Hello" + compat.gen("x", max_tokens=3, ignore_eos=True)

    runtime = compat.Runtime(model_path=str(tiny_model), max_total_tokens=4096)
    try:
        assert runtime.endpoint is runtime
        assert runtime.get_model_name() == str(tiny_model)
        state = hello.run(backend=runtime, temperature=0)
        assert state.get_meta_info("x")["completion_tokens"] == 3
        assert compat.flush_cache(runtime) is True
        assert compat.get_server_info(runtime)["stats"]["num_running"] == 0
    finally:
        runtime.shutdown()
    assert runtime.server.proc.poll() is not None


def test_sglangs_frontend_needs_one_argument_for_smollm2s_chat_format(server):
    """SGLang's frontend renders roles itself, with a template it picks by the name in
    /get_model_info's model_path; it has none for SmolLM2 (ChatML) and falls back to
    `USER:` / `ASSISTANT:`. docs/sglang.md gives the one-argument fix checked here."""

    @sglang.function
    def chat(s):
        s += sglang.user("Hi there")
        s += sglang.assistant(sglang.gen("reply", max_tokens=2, temperature=0))

    plain = chat.run(backend=sglang.RuntimeEndpoint(server.url))
    assert plain.text().startswith("USER:Hi there\n")  # SGLang's fallback, not ChatML
    fixed = chat.run(backend=sglang.RuntimeEndpoint(server.url, chat_template_name="chatml"))
    assert fixed.text().startswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")


# SGLang's test programs that decode greedily (the others sample without a seed).
GREEDY = ("select", "decode_json_regex", "tool_use", "parallel_encoding", "regex",
          "stream_logprobs")


def test_greedy_programs_leave_the_same_text_with_segments_and_per_call(server, monkeypatch):
    """Segments change how a program reaches the server, never what it gets: every state these
    programs run ends with the same text both ways."""
    from radixlm.backends.runtime_endpoint import RuntimeEndpoint
    from radixlm.program import Program

    states: list[Any] = []
    run, run_batch = Program.run, Program.run_batch
    monkeypatch.setattr(Program, "run", lambda self, *a, **k: states.append(
        run(self, *a, **k)) or states[-1])
    monkeypatch.setattr(Program, "run_batch", lambda self, *a, **k: states.extend(
        run_batch(self, *a, **k)) or states[-len(a[0]):])
    started: list[Any] = []
    start_segment = RuntimeEndpoint.start_segment
    monkeypatch.setattr(RuntimeEndpoint, "start_segment", lambda self, segment: started.append(
        segment) or start_segment(self, segment))
    texts = {}
    for segments in (False, True):
        states.clear()
        compat.set_default_backend(RuntimeEndpoint(server.url, segments=segments))
        sglang.global_config.default_backend = compat.global_config.default_backend
        try:
            module = _programs_on(compat)
            for name in GREEDY:
                outcome(module, name)
        finally:
            sglang.set_default_backend(None)
            compat.set_default_backend(None)
        texts[segments] = [state.text() for state in states]
    assert len(texts[True]) >= len(GREEDY) and started  # decode_json_regex: one segment
    assert texts[True] == texts[False]
