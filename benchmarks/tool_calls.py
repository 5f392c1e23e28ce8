"""Tool calling on real function schemas (JSONSchemaBench's Glaiveai2K: each file is one
function's parameters; the file name is the function), with the default model on the CPU.

For each sampled function:
- compile: the call grammar (the hermes structural tag around the function's schema, as the
  server builds it) against, as the floor, llguidance's plain grammar of the same schema;
- `required`: one enforced call, its arguments validated with `jsonschema`;
- `auto`: the same request with the model free to answer in text (`--ask`), `--samples`
  seeds, each twice: unconstrained (the reply parsed as it comes, the server's behaviour
  before structural tags) and with the structural tag (free text until `<tool_call>`, then the
  call held to the schema). Counted: the replies that start a call, and how many of those are
  valid calls of the request's tool (the goal: every call the model starts).
Decode speed with and without constraints is reported beside free text. Prints a table,
writes JSON.

    python benchmarks/tool_calls.py --schemas 40
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import llguidance.hf

from radixlm.runtime import Engine
from radixlm.runtime.grammar import structural_tag
from radixlm.runtime.grammar.structural_tag import special_tokens
from radixlm.runtime.protocol import tool_formats, tool_requests
from radixlm.runtime.protocol.fields import Fields

from results_dir import results_dir

DATA = (Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschemabench"
        / "Glaiveai2K")


def function_tools(count: int, seed: int) -> list[dict]:
    files = sorted(DATA.glob("*.json"))
    random.Random(seed).shuffle(files)
    tools = []
    for path in files[:count]:
        name = path.stem.rsplit("_", 1)[0][:64]
        tools.append({"name": name, "parameters": json.loads(path.read_text())})
    return tools


def compile_ms(lltok, grammar: str) -> float:
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, grammar)
    if matcher.is_error():
        raise ValueError(matcher.get_error())
    return (time.perf_counter() - start) * 1e3


def valid_call(text: str, tool: dict[str, Any], cut: bool) -> bool | None:
    """None: the reply started no call; else whether it is a valid call of `tool`."""
    if "<tool_call>" not in text:
        return None
    _, calls = tool_formats.parse("hermes", text, [tool["name"]], cut)
    try:
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), tool["parameters"])
    except jsonschema.ValidationError:
        return False
    return bool(calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemas", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--samples", type=int, default=4, help="auto replies per function")
    parser.add_argument("--ask", default="Please use {name} for me.",
                        help="the user's message ({name}: the function)")
    parser.add_argument("--temperature", type=float, default=0.7,
                        help="for the auto replies (required is greedy)")
    parser.add_argument("--out", default=None, help="JSON file (default: a dated file in "
                        "$RADIXLM_RESULTS_DIR or ~/.cache/radixlm/benchmarks)")
    args = parser.parse_args()
    engine = Engine(max_total_tokens=16384)
    lltok = llguidance.hf.from_tokenizer(engine.tokenizer)
    specials = special_tokens(engine.tokenizer)
    template = engine.tokenizer.chat_template
    rows = []
    timings: dict[str, list[tuple[int, float]]] = {"required": [], "auto_free": [],
                                                   "auto_tag": []}  # (tokens, seconds)
    for tool in function_tools(args.schemas, args.seed):
        row: dict[str, Any] = {"function": tool["name"]}
        request = tool_requests.parse_tools(Fields({"tools": [
            {"type": "function", "function": tool}]}))
        ask = [{"role": "user", "content": args.ask.format(name=tool["name"])}]
        try:
            request.choice = "required"
            plan = tool_requests.plan(template, ask, request)
            required_tag = plan.structural_tag
            prompt = engine.apply_chat_template(plan.messages, True, plan.template_tools)
            row["call_compile_ms"] = compile_ms(lltok, structural_tag.to_lark(
                structural_tag.check(required_tag), specials,
                {"whitespace_flexible": False}))
            row["schema_compile_ms"] = compile_ms(
                lltok, llguidance.LLMatcher.grammar_from_json_schema(tool["parameters"]))
        except ValueError as exc:
            row["error"] = str(exc)[:200]
            rows.append(row)
            continue
        def run(name: str, prompt: str, params: dict[str, Any]) -> Any:
            start = time.perf_counter()
            out = engine.generate(prompt, {**params, "max_new_tokens": args.max_tokens})
            timings[name.rsplit("_", 1)[0] if name != "required" else name].append(
                (out.completion_tokens, time.perf_counter() - start))
            row[name] = valid_call(out.text, tool, out.finish_reason == "length")
            row[name + "_cut"] = out.finish_reason == "length"
            return out

        run("required", prompt, {"structural_tag": required_tag, "temperature": 0})
        rows.append(row)
        request.choice = "auto"
        plan = tool_requests.plan(template, ask, request)
        for seed in range(args.seed, args.seed + args.samples):
            sampled = {"temperature": args.temperature, "seed": seed}
            run(f"auto_free_{seed}", prompt, sampled)
            run(f"auto_tag_{seed}", prompt, {**sampled, "structural_tag": plan.structural_tag})
    free_start = time.perf_counter()
    free = engine.generate(engine.apply_chat_template([{"role": "user", "content": "Hello"}]),
                           {"max_new_tokens": args.max_tokens, "temperature": 0,
                            "ignore_eos": True})
    free_tps = free.completion_tokens / (time.perf_counter() - free_start)
    engine.close()

    ok = [r for r in rows if "error" not in r]

    def pct(values: list[float], q: int) -> float:
        return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]

    def tps(name: str) -> float:
        return sum(t for t, _ in timings[name]) / sum(s for _, s in timings[name])

    seeds = range(args.seed, args.seed + args.samples)

    def replies(kind: str) -> list[tuple[bool | None, bool]]:
        """(valid call, cut) of every `kind` reply that started a call."""
        return [(r[f"{kind}_{seed}"], r[f"{kind}_{seed}_cut"]) for r in ok
                for seed in seeds if r[f"{kind}_{seed}"] is not None]

    call_ms = [r["call_compile_ms"] for r in ok]
    schema_ms = [r["schema_compile_ms"] for r in ok]
    summary = {
        "functions": len(rows), "compiled": len(ok),
        "required_valid": sum(bool(r["required"]) for r in ok),
        "required_cut": sum(r["required_cut"] for r in ok),
        "auto_replies": len(ok) * args.samples,
        "auto_free_started": len(replies("auto_free")),
        "auto_free_valid": sum(bool(v) for v, _ in replies("auto_free")),
        "auto_tag_started": len(replies("auto_tag")),
        "auto_tag_valid": sum(bool(v) for v, _ in replies("auto_tag")),
        "auto_tag_started_cut": sum(cut for _, cut in replies("auto_tag")),
        "call_compile_ms_p50": pct(call_ms, 50), "call_compile_ms_p90": pct(call_ms, 90),
        "schema_compile_ms_p50": pct(schema_ms, 50), "schema_compile_ms_p90": pct(schema_ms, 90),
        "required_tokens_per_s": tps("required"), "auto_free_tokens_per_s": tps("auto_free"),
        "auto_tag_tokens_per_s": tps("auto_tag"), "free_tokens_per_s": free_tps,
    }
    s = summary
    print(f"{'functions (compiled)':<34}{s['functions']:>8} ({s['compiled']})")
    print(f"{'required: valid calls':<34}{s['required_valid']:>8} / {len(ok)}"
          f"   ({s['required_cut']} cut by the {args.max_tokens}-token budget)")
    print(f"{'auto, free: valid / started':<34}{s['auto_free_valid']:>8} / "
          f"{s['auto_free_started']}   (of {s['auto_replies']} replies)")
    print(f"{'auto, structural tag: valid / started':<34}{s['auto_tag_valid']:>8} / "
          f"{s['auto_tag_started']}   ({s['auto_tag_started_cut']} cut by the budget)")
    print(f"{'compile ms p50 / p90':<34}{s['call_compile_ms_p50']:>8.2f}"
          f"{s['call_compile_ms_p90']:>8.2f}   call grammar")
    print(f"{'':<34}{s['schema_compile_ms_p50']:>8.2f}"
          f"{s['schema_compile_ms_p90']:>8.2f}   its JSON schema alone (floor)")
    for name, label, base in (("required", "required", "free_tokens_per_s"),
                              ("auto_free", "auto, free", "free_tokens_per_s"),
                              ("auto_tag", "auto, structural tag", "auto_free_tokens_per_s")):
        rate = s[name + "_tokens_per_s"]
        print(f"{'decode tok/s: ' + label:<34}{rate:>8.1f}   {rate / s[base]:.2f}x "
              f"{'free text' if base == 'free_tokens_per_s' else 'auto, free'} "
              f"({s[base]:.1f})")
    today = datetime.date.today().isoformat()
    out = Path(args.out or results_dir() / f"tool_calls_cpu_{today}.json")
    out.write_text(json.dumps({"date": today, "machine": platform.processor()
                               or platform.machine(), "max_tokens": args.max_tokens,
                               "temperature": args.temperature, "samples": args.samples,
                               "summary": summary,
                               "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
