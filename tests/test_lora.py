"""LoRA adapters: logprobs against peft on the same tiny random adapters, a mixed batch equal
to each row alone, slots, the prefix cache keyed by adapter, and every refusal named."""

from __future__ import annotations

import gc
import json
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from test_engine import assert_no_leak

import radixlm as rl
from radixlm.runtime import Engine

from conftest import save_tiny_hf_model

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name: (rank, alpha, targets, rslora)
ADAPTERS = {"a": (8, 16, ALL_TARGETS, False), "b": (4, 8, ["q_proj", "v_proj", "down_proj"], True),
            "c": (16, 4, ["o_proj", "up_proj"], False)}


def make_adapter(folder: Path, base: Path, rank: int, alpha: int, targets: list[str],
                 rslora: bool, seed: int) -> Path:
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                             use_rslora=rslora, init_lora_weights=False)  # B random, not 0
    peft.get_peft_model(model, config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_hf_model(root / "base", "llama")
    folders = {"base": base}
    for seed, (name, spec) in enumerate(ADAPTERS.items()):
        folders[name] = make_adapter(root / name, base, *spec, seed=seed)
    return folders


def modules(models: dict[str, Path], *names: str) -> list[str]:
    return [f"{n}={models[n]}" for n in names]


def peft_logprobs(models: dict[str, Path], name: str | None, ids: list[int],
                  start: int) -> list[float]:
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(models["base"],
                                                              dtype=torch.float32)
    if name is not None:
        model = peft.PeftModel.from_pretrained(model, models[name])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [logprobs[i - 1, ids[i]].item() for i in range(start, len(ids))]


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "eager"])
def test_logprobs_match_peft(models, kernel):
    ids = torch.randint(3, 512, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    with Engine(str(models["base"]), device="cpu", dtype="float32", page_size=4,
                lora_modules=modules(models, "a", "b", "c"),
                disable_cpu_kernel=not kernel) as engine:
        assert (engine.core.runner.cpu_decode is not None) == kernel
        got = {name: engine.score(ids[:12], [ids[12:]], lora=name)[0]
               for name in (None, "a", "b", "c")}
        assert_no_leak(engine)
    for name, values in got.items():
        want = peft_logprobs(models, name, ids, 12)
        assert max(abs(x - y) for x, y in zip(values, want)) < 1e-4, name
        if name is not None:  # the adapter changes the model, or the check above is empty
            assert max(abs(x - y) for x, y in zip(values, got[None])) > 1e-2, name


def test_mixed_batch_equals_each_row_alone(models):
    """bfloat16 on the CPU kernel: every row's tokens and logprobs are the same bits in a
    batch that mixes adapters (and the base model) as alone; with one slot, the adapters
    take turns and still give the same; and with n-gram speculation."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 23, 9, 40, 14)]
    loras = ["a", "b", None, "a", "c"]
    params = {"temperature": 0, "max_new_tokens": 10, "min_new_tokens": 10,
              "logprobs": True}
    options = dict(device="cpu", dtype="bfloat16", page_size=4, chunked_prefill_size=16,
                   lora_modules=modules(models, "a", "b", "c"))

    def tokens(outputs):
        return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outputs]

    with Engine(str(models["base"]), **options) as engine:
        alone = [tokens([engine.generate(input_ids=ids, sampling_params=params, lora=lora)])[0]
                 for ids, lora in zip(prompts, loras)]
        engine.flush_cache()
        mixed = tokens(engine.generate(input_ids=prompts, sampling_params=params, lora=loras))
        assert_no_leak(engine)
    assert mixed == alone
    assert len({tuple(t) for t, _ in alone}) > 1
    with Engine(str(models["base"]), max_loras_per_batch=1, **options) as engine:
        assert tokens(engine.generate(input_ids=prompts, sampling_params=params,
                                      lora=loras)) == alone
        assert_no_leak(engine)
        stats = engine.stats()  # one slot: each adapter in turn, a at least twice
        assert stats["lora_slots"] == 1 and stats["lora_adapters_loaded"] == 3
        assert stats["lora_slot_loads"] >= 3
    # n-gram speculation verifies several tokens of a row per step, each with its adapter
    with Engine(str(models["base"]), speculative="ngram", **options) as engine:
        assert tokens(engine.generate(input_ids=prompts, sampling_params=params,
                                      lora=loras)) == alone
        assert_no_leak(engine)


def test_prefix_cache_is_kept_apart_per_adapter(models):
    ids = list(range(10, 74))
    params = {"temperature": 0, "max_new_tokens": 2}
    with Engine(str(models["base"]), device="cpu", dtype="float32", page_size=4,
                lora_modules=modules(models, "a", "b")) as engine:
        assert engine.generate(input_ids=ids, sampling_params=params).cached_tokens == 0
        assert engine.generate(input_ids=ids, sampling_params=params,
                               lora="a").cached_tokens == 0
        assert engine.generate(input_ids=ids, sampling_params=params,
                               lora="b").cached_tokens == 0
        assert engine.generate(input_ids=ids, sampling_params=params,
                               lora="a").cached_tokens >= 60
        assert_no_leak(engine)
        slots = weakref.ref(next(iter(engine.core.lora.slots.linears.values())).a)
        gc.disable()  # closing frees the slots at once: no cycle waits for a collection
        try:
            engine.close()
            assert slots() is None
        finally:
            gc.enable()


def test_only_the_layers_adapters_train_hold_slots(models):
    """An adapter of q, v and down (b) gives slots to the qkv and down layers only, with k's
    rank 0 in them, and still matches peft; lora_target_modules widens or narrows the layers,
    and a runtime-loaded adapter training others is refused naming the option."""
    ids = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    with Engine(str(models["base"]), device="cpu", dtype="float32",
                lora_modules=modules(models, "b")) as engine:
        linears = engine.core.lora.slots.linears
        assert {name.rpartition(".")[2] for name in linears} == {"qkv_proj", "down_proj"}
        assert len(linears) == 2 * engine.core.runner.model.config.num_layers
        got = engine.score(ids[:12], [ids[12:]], lora="b")[0]
        slot = engine.core.lora.slots.slot_of(engine.core.lora.adapters["b"])
        qkv = next(lin for name, lin in linears.items() if name.endswith("qkv_proj"))
        assert qkv.part_ranks[slot].tolist() == [4, 0, 4]  # q, k, v
    want = peft_logprobs(models, "b", ids, 12)
    assert max(abs(x - y) for x, y in zip(got, want)) < 1e-4
    with Engine(str(models["base"]), device="cpu", dtype="float32",
                allow_runtime_lora_loading=True,
                lora_target_modules=["q_proj", "v_proj", "down_proj"]) as engine:
        assert {name.rpartition(".")[2] for name in engine.core.lora.slots.linears} == {
            "qkv_proj", "down_proj"}
        engine.load_lora("b", str(models["b"]))
        with pytest.raises(ValueError, match=r"lora_target_modules: adapter 'c' trains .*"
                                             r"\(gate_up_proj, o_proj\)"):
            engine.load_lora("c", str(models["c"]))
        assert [a["name"] for a in engine.loras()] == ["b"]
    with Engine(str(models["base"]), device="cpu", dtype="float32",
                allow_runtime_lora_loading=True, lora_target_modules="all") as engine:
        assert len(engine.core.lora.slots.linears) == 4 * engine.core.runner.model.config.num_layers
    for targets, message in ((["o_proj"], "adapter 'b' trains"), (["q"], r"\['q'\] are not")):
        with pytest.raises(ValueError, match=f"lora_target_modules: {message}"):
            Engine(str(models["base"]), device="cpu", dtype="float32",
                   lora_modules=modules(models, "b"), lora_target_modules=targets)


def test_runtime_loading(models):
    ids = list(range(10, 30))
    params = {"temperature": 0, "max_new_tokens": 4}
    with Engine(str(models["base"]), device="cpu", dtype="float32",
                lora_modules=modules(models, "a")) as engine:
        with pytest.raises(PermissionError, match="allow_runtime_lora_loading"):
            engine.load_lora("b", str(models["b"]))
        with pytest.raises(ValueError, match="no adapter named 'b'.*loaded: a"):
            engine.generate(input_ids=ids, sampling_params=params, lora="b")
    with Engine(str(models["base"]), device="cpu", dtype="float32", max_lora_rank=8,
                allow_runtime_lora_loading=True) as engine:
        engine.load_lora("b", str(models["b"]))
        assert [a["name"] for a in engine.loras()] == ["b"]
        with pytest.raises(ValueError, match="already loaded"):
            engine.load_lora("b", str(models["a"]))
        with pytest.raises(ValueError, match="rank 16 is larger than max_lora_rank"):
            engine.load_lora("c", str(models["c"]))
        out = engine.generate(input_ids=ids, sampling_params=params, lora="b")
        assert out.finish_reason == "length"
        engine.unload_lora("b")
        with pytest.raises(ValueError, match="no adapter named 'b'"):
            engine.generate(input_ids=ids, sampling_params=params, lora="b")
        with pytest.raises(ValueError, match="lora_name: no adapter named 'b'"):
            engine.unload_lora("b")
    with Engine(str(models["base"]), device="cpu", dtype="float32") as engine:
        with pytest.raises(ValueError, match="serves no adapters"):
            engine.generate(input_ids=ids, sampling_params=params, lora="a")


def _edited(models: dict[str, Path], tmp_path: Path, **changes) -> Path:
    folder = tmp_path / "edited"
    shutil.copytree(models["a"], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("changes, message", [
    ({"use_dora": True}, "use_dora: DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias: adapters that train biases"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, r"target_modules: \['embed_tokens'\]"),
    ({"peft_type": "IA3"}, "peft_type"),
    ({"lora_alpha": -1}, "lora_alpha: must be a positive number"),
])
def test_unsupported_adapters_are_refused_by_field(models, tmp_path, changes, message):
    from radixlm.runtime.models.loader import load_model
    from radixlm.runtime.models.lora.adapter import load_adapter

    model = load_model(str(models["base"]), "auto", torch.float32, torch.device("cpu")).model
    with pytest.raises(ValueError, match=message):
        load_adapter("x", _edited(models, tmp_path, **changes), model)


def test_adapters_that_do_not_fit_the_model_are_refused(models, tmp_path):
    from radixlm.runtime.models.loader import load_model
    from radixlm.runtime.models.lora.adapter import load_adapter

    model = load_model(str(models["base"]), "auto", torch.float32, torch.device("cpu")).model
    other = save_tiny_hf_model(tmp_path / "other", "llama", hidden_size=32)
    wrong = make_adapter(tmp_path / "wrong", other, 4, 8, ["q_proj"], False, seed=0)
    with pytest.raises(ValueError, match="trained for another base model"):
        load_adapter("x", wrong, model)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_adapter("x", tmp_path, model)
    with pytest.raises(ValueError, match=r"lora_modules: each entry is NAME=PATH"):
        Engine(str(models["base"]), device="cpu", lora_modules=["a"])


@pytest.fixture(scope="module")
def chat_models(tmp_path_factory, default_model_folder) -> dict[str, Path]:
    from conftest import save_tiny_chat_model

    root = tmp_path_factory.mktemp("lora-chat")
    base = save_tiny_chat_model(root / "base", default_model_folder)
    return {"base": base, "a": make_adapter(root / "a", base, 8, 32, ALL_TARGETS, False, 0),
            "b": make_adapter(root / "b", base, 4, 16, ["q_proj", "v_proj"], False, 1)}


def post(url: str, body: dict, key: str | None = "key") -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, json.dumps(body).encode(), method="POST", headers={
        "Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@rl.function
def mixed(s):
    """Two gens under adapter a (one segment), one under the program's adapter, a select, one
    on the base model whatever the program's adapter."""
    s += "Name three colors:" + rl.gen("a1", max_tokens=4, lora="a")
    s += rl.gen("a2", max_tokens=4, lora="a")
    s += "\nAnd" + rl.gen("other", max_tokens=4)
    s += "\nPick:" + rl.select("pick", ["red", "blue", "green"], lora="a")
    s += "\nBase:" + rl.gen("base", max_tokens=4, lora=False)


def mixed_by_calls(engine: Engine, default: str | None) -> dict[str, str]:
    """What `mixed` gives made of one engine call per gen and select."""
    params = {"temperature": 0, "max_new_tokens": 4}
    text, got = "Name three colors:", {}
    for name, before, lora in (("a1", "", "a"), ("a2", "", "a"), ("other", "\nAnd", default)):
        text += before
        got[name] = engine.generate(text, params, lora=lora).text
        text += got[name]
    from radixlm.runtime.engine.tokenization import encode_prompt

    choices = [engine.tokenizer.encode(c, add_special_tokens=False)
               for c in ("red", "blue", "green")]
    scores = engine.score(encode_prompt(engine.tokenizer, text + "\nPick:"), choices, lora="a")
    best = max(range(3), key=lambda i: sum(scores[i]) / len(scores[i]))
    got["pick"] = ("red", "blue", "green")[best]
    got["base"] = engine.generate(text + "\nPick:" + got["pick"] + "\nBase:", params).text
    return got


def test_server_serves_loads_and_unloads_adapters(chat_models):
    """--lora-modules over HTTP: /v1/models lists the adapter under its parent, `model` on the
    OpenAI routes and `lora_path` on /generate pick it (the engine's tokens), and the load and
    unload routes (API key, --allow-runtime-lora-loading) change what is served. Programs
    choose adapters per gen and select (`lora=`) and per run, on the engine, over the native
    routes (segments) and over the OpenAI routes, with the engine's per-call answers."""
    import urllib.request

    import openai

    from radixlm.backends.server_process import ServerProcess

    prompt = "Name three colors:"
    params = {"temperature": 0, "max_new_tokens": 8}
    with Engine(str(chat_models["base"]), lora_modules=modules(chat_models, "a", "b")) as engine:
        want = {name: engine.generate(prompt, params, lora=name) for name in (None, "a")}
        calls = {default: mixed_by_calls(engine, default) for default in (None, "b")}
        backend = rl.Engine(engine=engine)
        for default, expected in calls.items():
            state = mixed.run(backend=backend, temperature=0, lora=default)
            assert {k: state[k] for k in expected} == expected, default
        failed = mixed.run(backend=backend, temperature=0, lora="nope")
        assert "no adapter named 'nope'" in str(failed.error())
    assert want[None].token_ids != want["a"].token_ids
    assert calls[None]["other"] != calls["b"]["other"]
    args = ["--model", str(chat_models["base"]), "--served-model-name", "base",
            "--lora-modules", *modules(chat_models, "a"), "--allow-runtime-lora-loading",
            "--api-key", "key"]
    with ServerProcess(args) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="key", max_retries=0)
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"base", "a"} and cards["a"].parent == "base"
        for name in (None, "a"):
            body = {"text": prompt, "sampling_params": params,
                    **({} if name is None else {"lora_path": name})}
            status, got = post(server.url + "/generate", body)
            assert status == 200 and got["output_ids"] == want[name].token_ids, name
        completion = client.completions.create(model="a", prompt=prompt, max_tokens=8,
                                               temperature=0)
        assert completion.model == "a" and completion.choices[0].text == want["a"].text
        endpoint = rl.RuntimeEndpoint(server.url, api_key="key")
        state = mixed.run(backend=endpoint, temperature=0)
        assert {k: state[k] for k in calls[None]} == calls[None]
        compatible = rl.OpenAI("base", base_url=server.url + "/v1", api_key="key")
        state = mixed.run(backend=compatible, temperature=0)
        assert state["a1"] == calls[None]["a1"] and state["other"] == calls[None]["other"]
        status, error = post(server.url + "/generate", {"text": prompt, "lora_path": "b"})
        assert status == 400 and error["error"]["param"] == "lora_path"
        load = {"lora_name": "b", "lora_path": str(chat_models["b"])}
        assert post(server.url + "/v1/load_lora_adapter", load, key=None)[0] == 401
        status, loaded = post(server.url + "/v1/load_lora_adapter", load)
        assert status == 200 and loaded["loaded_adapters"] == ["a", "b"]
        assert {m.id for m in client.models.list().data} == {"base", "a", "b"}
        assert client.completions.create(model="b", prompt=prompt, max_tokens=4,
                                         temperature=0).model == "b"
        status, error = post(server.url + "/v1/load_lora_adapter",
                             {"lora_name": "c", "lora_path": "/nonexistent"})
        assert status == 400 and error["error"]["param"] == "lora_path"
        assert "no adapter_config.json" in error["error"]["message"]
        assert post(server.url + "/unload_lora_adapter", {"lora_name": "b"})[0] == 200
        assert {m.id for m in client.models.list().data} == {"base", "a"}
        scrape = urllib.request.Request(server.url + "/metrics",
                                        headers={"Authorization": "Bearer key"})
        with urllib.request.urlopen(scrape, timeout=30) as response:
            metrics = response.read().decode()
        assert 'radixlm_lora_adapters_loaded{model_name="base"} 1.0' in metrics
        assert "radixlm_lora_slot_loads_total" in metrics


def test_tensor_parallel_ranks_hold_their_share_of_each_adapter(models):
    """tp_size=2 on gloo, float32: each rank holds its share of every adapter (B's rows of a
    column-parallel layer, A's columns of a row-parallel one) and fills its slots as rank 0
    does (two slots for three adapters: refilled mid-run). Scores match peft; a mixed batch's
    tokens equal one rank's; an adapter loaded while serving reaches every rank."""
    ids = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 17, 9, 12)]
    loras = ["a", "c", None, "b"]
    params = {"temperature": 0, "max_new_tokens": 6, "min_new_tokens": 6}
    options = dict(device="cpu", dtype="float32", max_loras_per_batch=2,
                   lora_modules=modules(models, "a", "b", "c"))
    with Engine(str(models["base"]), tp_size=2, allow_runtime_lora_loading=True,
                **options) as engine:
        scores = {name: engine.score(ids[:12], [ids[12:]], lora=name)[0]
                  for name in ("a", "b", "c")}
        sharded = [o.token_ids for o in engine.generate(input_ids=prompts,
                                                        sampling_params=params, lora=loras)]
        # Loaded while serving: every rank takes its share, at a catalog index an unloaded
        # adapter no request holds leaves free.
        engine.unload_lora("b")
        engine.load_lora("a2", str(models["a"]))  # in b's place
        assert len(engine.core.lora.slots.catalog) == 3
        assert engine.score(ids[:12], [ids[12:]], lora="a2")[0] == scores["a"]
        with pytest.raises(ValueError, match="no adapter_config.json"):
            engine.load_lora("d", "/nonexistent")
        assert_no_leak(engine)
    for name, values in scores.items():
        want = peft_logprobs(models, name, ids, 12)
        assert max(abs(x - y) for x, y in zip(values, want)) < 1e-4, name
    with Engine(str(models["base"]), disable_cpu_kernel=True, **options) as engine:
        assert [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params,
                                                     lora=loras)] == sharded


def test_adapters_run_where_triton_is_not_installed(models):
    """A plain install has no Triton (it is a GPU and test dependency): the engine and its CPU
    LoRA path must import and run without it."""
    import subprocess
    import sys

    script = f"""
import sys
sys.modules["triton"] = None  # any import of it fails
from radixlm.runtime import Engine
with Engine({str(models["base"])!r}, device="cpu", lora_modules=["a={models["a"]}"]) as engine:
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={{"max_new_tokens": 2}}, lora="a")
print(len(out.token_ids))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "2"


def test_an_adapter_of_phi3s_fused_layers_under_tensor_parallelism(tmp_path):
    """Phi-3 stores q, k and v (and gate and up) as one layer, and so do adapters trained on
    it: under tp_size=2 each rank cuts such a module into its parts' shares, as the weights
    are cut. Scores match peft, with one process and with two."""
    base = save_tiny_hf_model(tmp_path / "base", "phi3")
    adapter = make_adapter(tmp_path / "fused", base, 8, 16,
                           ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], False, seed=5)
    folders = {"base": base, "fused": adapter}
    ids = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    want = peft_logprobs(folders, "fused", ids, 10)
    for tp in (1, 2):
        with Engine(str(base), tp_size=tp, device="cpu", dtype="float32",
                    lora_modules=modules(folders, "fused")) as engine:
            got = engine.score(ids[:10], [ids[10:]], lora="fused")[0]
        assert max(abs(x - y) for x, y in zip(got, want)) < 1e-4, tp


def test_an_adapter_on_a_mixture_of_experts_through_the_cpu_kernel(tmp_path):
    """Qwen2-MoE (sparse layers with a shared expert, a dense layer): an adapter on the
    attention runs in the CPU forward step beside the experts, whose linears have no
    adapters; scores match peft."""
    from test_gguf_moe import CASES

    base = save_tiny_hf_model(tmp_path / "base", "llama", **CASES["qwen2-moe"][1])
    adapter = make_adapter(tmp_path / "attn", base, 8, 16, ["q_proj", "v_proj", "o_proj"],
                           False, seed=3)
    folders = {"base": base, "attn": adapter}
    ids = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    with Engine(str(base), device="cpu", dtype="float32", page_size=4,
                lora_modules=modules(folders, "attn")) as engine:
        assert engine.core.runner.cpu_decode is not None
        got = engine.score(ids[:10], [ids[10:]], lora="attn")[0]
        plain = engine.score(ids[:10], [ids[10:]])[0]
        assert_no_leak(engine)
    assert max(abs(x - y) for x, y in zip(got, peft_logprobs(folders, "attn", ids, 10))) < 1e-4
    assert max(abs(x - y) for x, y in zip(plain, peft_logprobs(folders, None, ids, 10))) < 1e-4
    assert max(abs(x - y) for x, y in zip(got, plain)) > 1e-2
