"""A ReAct-style agent: the model picks a tool with `select`, writes its input with `gen`, and
Python runs the tool and feeds the observation back, branching on the generated values.

    python examples/react_agent.py
"""

from __future__ import annotations

import argparse
import ast
import operator

import radixlm as rl

CAPITALS = {"france": "Paris", "japan": "Tokyo", "peru": "Lima", "kenya": "Nairobi"}
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
       ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        raise ValueError("only + - * / on numbers")
    try:
        return str(value(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


TOOLS = {"calculator": calculator,
         "capital": lambda country: CAPITALS.get(country.strip().lower(), "unknown")}
EXAMPLE = ("Question: What is the capital of Peru?\nAction: capital\nInput: Peru\n"
           "Observation: Lima\nAction: finish\nInput: Lima\n\n"
           "Question: What is 12 times 7?\nAction: calculator\nInput: 12 * 7\n"
           "Observation: 84\nAction: finish\nInput: 84\n\n")


@rl.function
def agent(s, question, max_steps=4):
    s += "Answer the question using the tools calculator and capital.\n\n" + EXAMPLE
    s += f"Question: {question}\n"
    for _ in range(max_steps):
        s += "Action: " + rl.select("action", choices=[*TOOLS, "finish"]) + "\nInput:"
        s += rl.gen("input", stop="\n") + "\n"
        if s["action"] == "finish":  # a Python branch on a generated value
            s.set_var("answer", s["input"].strip())
            return
        s += f"Observation: {TOOLS[s['action']](s['input'])}\n"
    s.set_var("answer", "(no answer within max_steps)")


def main(backend: rl.Backend, max_tokens: int = 16) -> list[str]:
    answers = []
    for question in ["What is 23 times 19?", "What is the capital of Japan?"]:
        state = agent.run(question=question, backend=backend, temperature=0,
                          max_tokens=max_tokens)
        print(state.text().split("\n\n")[-1].strip() + "\n")
        answers.append(state["answer"])
    return answers


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=16)
    with rl.Engine() as engine:
        main(engine, parser.parse_args().max_tokens)
