"""Tool calling with enforced calls (`tool_choice: required`): what the call grammar costs and
whether the calls validate, on real function schemas (JSONSchemaBench's Glaiveai2K: each file
is one function's parameters; the file name is the function).

For each sampled function: compile the hermes call grammar around its schema, and, as the
baseline, llguidance's plain JSON-schema grammar of the same parameters (the floor: a call
grammar cannot compile faster than its arguments' schema). The call grammar closes objects
that leave additionalProperties open (tool_formats.closed), as the arguments feed a
function. Then generate one enforced call with the default model on the CPU and validate its
arguments with `jsonschema`. Also decode speed with and without the call grammar. Prints a
table, writes JSON.

    python benchmarks/tool_calls.py --schemas 60
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

import jsonschema
import llguidance
import llguidance.hf

from radixlm.runtime import Engine
from radixlm.runtime.protocol import tool_formats

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemas", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", default=None, help="JSON file (default: a dated file in "
                        "$RADIXLM_RESULTS_DIR or ~/.cache/radixlm/benchmarks)")
    args = parser.parse_args()
    engine = Engine(max_total_tokens=16384)
    lltok = llguidance.hf.from_tokenizer(engine.tokenizer)
    rows = []
    for tool in function_tools(args.schemas, args.seed):
        row = {"function": tool["name"]}
        try:
            row["call_compile_ms"] = compile_ms(lltok, llguidance.LLMatcher.grammar_from_lark(
                tool_formats.call_grammar("hermes", [tool], parallel=False)))
            row["schema_compile_ms"] = compile_ms(
                lltok, llguidance.LLMatcher.grammar_from_json_schema(tool["parameters"]))
        except ValueError as exc:
            row["error"] = str(exc)[:200]
            rows.append(row)
            continue
        grammar = tool_formats.call_grammar("hermes", [tool], parallel=False)
        prompt = engine.apply_chat_template([{"role": "user", "content": f"Call {tool['name']}."}])
        start = time.perf_counter()
        out = engine.generate(prompt, {"ebnf": grammar, "max_new_tokens": args.max_tokens,
                                       "temperature": 0})
        row["seconds"] = time.perf_counter() - start
        row["tokens"] = out.completion_tokens
        _, calls = tool_formats.parse("hermes", out.text, [tool["name"]])
        row["complete"] = bool(calls)
        try:
            if calls:
                jsonschema.validate(json.loads(calls[0].arguments), tool["parameters"])
            row["valid"] = bool(calls)
        except jsonschema.ValidationError:
            row["valid"] = False
        rows.append(row)
    free_start = time.perf_counter()
    free = engine.generate(engine.apply_chat_template([{"role": "user", "content": "Hello"}]),
                           {"max_new_tokens": args.max_tokens, "temperature": 0,
                            "ignore_eos": True})
    free_tps = free.completion_tokens / (time.perf_counter() - free_start)
    engine.close()

    ok = [r for r in rows if "error" not in r]
    done = [r for r in ok if r["complete"]]
    tps = sum(r["tokens"] for r in ok) / sum(r["seconds"] for r in ok)

    def pct(values: list[float], q: float) -> float:
        return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]

    call_ms = [r["call_compile_ms"] for r in ok]
    schema_ms = [r["schema_compile_ms"] for r in ok]
    summary = {
        "functions": len(rows), "compiled": len(ok),
        "complete_calls": len(done), "valid_calls": sum(r["valid"] for r in ok),
        "call_compile_ms_p50": pct(call_ms, 50), "call_compile_ms_p90": pct(call_ms, 90),
        "schema_compile_ms_p50": pct(schema_ms, 50), "schema_compile_ms_p90": pct(schema_ms, 90),
        "constrained_tokens_per_s": tps, "free_tokens_per_s": free_tps,
    }
    print(f"{'functions':<28}{summary['functions']:>10}")
    print(f"{'compiled':<28}{summary['compiled']:>10}")
    print(f"{'complete calls (<= ' + str(args.max_tokens) + ' tok)':<28}"
          f"{summary['complete_calls']:>10}")
    print(f"{'schema-valid arguments':<28}{summary['valid_calls']:>10}")
    print(f"{'compile ms p50 / p90':<28}{summary['call_compile_ms_p50']:>10.2f}"
          f"{summary['call_compile_ms_p90']:>8.2f}   call grammar")
    print(f"{'':<28}{summary['schema_compile_ms_p50']:>10.2f}"
          f"{summary['schema_compile_ms_p90']:>8.2f}   its JSON schema alone (floor)")
    print(f"{'decode tokens/s':<28}{tps:>10.1f}{free_tps:>8.1f}   enforced call vs free text "
          f"({tps / free_tps:.2f}x)")
    today = datetime.date.today().isoformat()
    out = Path(args.out or results_dir() / f"tool_calls_cpu_{today}.json")
    out.write_text(json.dumps({"date": today, "machine": platform.processor()
                               or platform.machine(), "summary": summary, "rows": rows},
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
