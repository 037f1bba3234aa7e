"""tool_use: multi-turn questions that need a calculator and a search over a local corpus.

The corpus is a set of fictional towns generated from `corpus_seed` (name, river, founding year, population,
so no model can know the facts without searching). Task kinds: `calc` (arithmetic too large to do reliably in
one's head), `lookup` (a fact from the corpus), `lookup_calc` (a fact, then arithmetic on it). Tools, as plain
functions the chat template exposes:
- `calculator(expression)`: exact evaluation of + - * / // % ** and parentheses over integers and decimals,
  by walking the Python AST (no `eval`): names, calls, attributes and anything else are refused; exponents,
  operands and results are bounded so a call cannot allocate or loop without bound.
- `search(query, k)`: BM25 (k1 = 1.5, b = 0.75) over the corpus, written here; returns the top k passages.

Reward: `correct` (1 when the final answer, `\\boxed{}` or the last number of the last assistant turn, equals
the reference exactly, see arbor.environments.math_problems) plus `tool_penalty` = -`invalid_penalty` per
invalid tool call (malformed markup, unknown tool, bad arguments, a failing expression): the process penalty of
a composite reward. With `process_penalty > 0` the penalty is also given per turn (reward-to-go advantages).

A turn with neither a tool call nor a `\\boxed{}` answer gets the `nudge` user message and the episode goes on
(until `max_turns`); `nudge = None` ends the episode there instead. The episode's answer is the last assistant
turn's.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
import re
from collections import Counter
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

from arbor.environments.math_problems import fmt, is_correct, last_boxed
from arbor.environments.multiturn import ToolEnv, ToolState
from arbor.environments.protocol import StepResult, Task

MAX_DIGITS = 60
MAX_EXPONENT = 100
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


class CalculatorError(ValueError):
    pass


def _check(x: Fraction) -> Fraction:
    if max(abs(x.numerator), x.denominator).bit_length() > MAX_DIGITS * 3.33:
        raise CalculatorError(f"number too large (more than {MAX_DIGITS} digits)")
    return x


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(Fraction(str(node.value)))  # via str: 0.1 is 1/10, not the binary float
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise CalculatorError(f"exponents must be integers of at most {MAX_EXPONENT}")
            if left == 0 and right < 0:
                raise CalculatorError("division by zero")
            if left != 0 and abs(right) * math.log10(max(abs(left.numerator), left.denominator, 2)) > MAX_DIGITS:
                raise CalculatorError(f"result too large (more than {MAX_DIGITS} digits)")
            return _check(left ** int(right))
        return _check(Fraction(_BINARY[type(node.op)](left, right)))
    raise CalculatorError(f"unsupported expression element: {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression exactly (+ - * / // % ** and parentheses).

    Args:
        expression: e.g. "(12 + 30) * 7 / 4"
    """
    if len(expression) > 200:
        raise CalculatorError("expression longer than 200 characters")
    try:
        tree = ast.parse(expression.replace("^", "**").replace("×", "*"), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression: {e.msg}") from None
    value = _eval(tree)
    if value.denominator == 1:
        return str(value.numerator)
    try:  # a terminating decimal reads better than a fraction when there is one
        dec = Decimal(value.numerator) / Decimal(value.denominator)
        if Fraction(dec) == value:
            return str(dec)
    except InvalidOperation:
        pass
    return fmt(value)


_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class BM25:
    """Okapi BM25 over a list of passages (lower-cased alphanumeric words)."""

    def __init__(self, passages: list[str], k1: float = 1.5, b: float = 0.75) -> None:
        self.passages, self.k1, self.b = passages, k1, b
        self.docs = [Counter(words(p)) for p in passages]
        self.lengths = [sum(d.values()) for d in self.docs]
        self.avg = sum(self.lengths) / max(len(self.lengths), 1)
        df: Counter[str] = Counter(w for d in self.docs for w in d)
        n = len(passages)
        self.idf = {w: math.log(1 + (n - f + 0.5) / (f + 0.5)) for w, f in df.items()}

    def scores(self, query: str) -> list[float]:
        q = words(query)
        out = []
        for doc, length in zip(self.docs, self.lengths):
            s = 0.0
            for w in q:
                tf = doc.get(w, 0)
                if tf:
                    s += self.idf[w] * tf * (self.k1 + 1) / (tf + self.k1 * (1 - self.b + self.b * length / self.avg))
            out.append(s)
        return out

    def top(self, query: str, k: int) -> list[tuple[int, float]]:
        ranked = sorted(enumerate(self.scores(query)), key=lambda x: (-x[1], x[0]))
        return [(i, s) for i, s in ranked[:k] if s > 0]


_SYLLABLES = ["var", "nor", "kes", "tal", "bri", "mon", "dra", "fel", "gar", "hol", "lin", "sur", "tek", "vo", "zan"]
_RIVERS = ["Kessel", "Amber", "Silt", "Corran", "Vey", "Ostra", "Lune", "Brisk"]


def make_corpus(num_towns: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    towns, seen = [], set()
    while len(towns) < num_towns:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
        if name in seen:
            continue
        seen.add(name)
        towns.append(
            {
                "name": name,
                "river": rng.choice(_RIVERS),
                "founded": rng.randint(1100, 1900),
                "population": rng.randint(800, 90000),
            }
        )
    return towns


def passage(town: dict[str, Any]) -> str:
    return (
        f"{town['name']} is a town on the {town['river']} river. It was founded in {town['founded']} "
        f"and has a population of {town['population']}."
    )


class ToolUseEnv(ToolEnv):
    name = "tool_use"

    def __init__(
        self,
        num_tasks: int = 5000,
        kinds: list[str] | None = None,
        num_towns: int = 40,
        corpus_seed: int = 0,
        max_turns: int = 4,
        invalid_penalty: float = 0.1,
        process_penalty: float = 0.0,
        search_k: int = 1,
        nudge: str | None = "Call a tool or give the final answer in \\boxed{}.",
        system_prompt: str | None = "Use the tools when needed. Put the final answer in \\boxed{}.",
    ) -> None:
        kinds = list(kinds or ["calc", "lookup", "lookup_calc"])
        unknown = sorted(set(kinds) - {"calc", "lookup", "lookup_calc"})
        if unknown:
            raise ValueError(f"tool_use: unknown kinds {unknown}; choose from calc, lookup, lookup_calc")
        self.num_tasks, self.kinds, self.max_turns = num_tasks, kinds, max_turns
        self.invalid_penalty, self.process_penalty, self.search_k = invalid_penalty, process_penalty, search_k
        self.system_prompt, self.nudge = system_prompt, nudge
        self.towns = make_corpus(num_towns, corpus_seed)
        self.index = BM25([passage(t) for t in self.towns])

    def search(self, query: str, k: int = 1) -> str:
        """Searches a local encyclopedia of towns.

        Args:
            query: words to look for, e.g. a town's name
            k: how many passages to return
        """
        hits = self.index.top(query, max(1, min(int(k), 5)))
        return "\n".join(self.index.passages[i] for i, _ in hits) or "no results"

    def tools(self, task: Task) -> list[Callable[..., Any]]:
        return [calculator, self.search]

    def dataset(self, seed: int) -> list[Task]:
        rng = random.Random(seed)
        tasks = []
        for i in range(self.num_tasks):
            kind = self.kinds[i % len(self.kinds)]
            town = rng.choice(self.towns)
            task: Task = {"id": i, "kind": kind, "town": town["name"]}
            if kind == "calc":
                a, b, c = rng.randint(100, 9999), rng.randint(11, 99), rng.randint(1, 999)
                task["expression"] = f"{a} * {b} - {c}"
                question, answer = f"What is {task['expression']}?", a * b - c
            elif kind == "lookup":
                attr = task["attribute"] = rng.choice(["population", "founded"])
                question = (
                    f"What is the population of {town['name']}?"
                    if attr == "population"
                    else f"In which year was {town['name']} founded?"
                )
                answer = town[attr]
            else:
                m = rng.randint(2, 9)
                task["expression"] = f"{m} * {town['population']}"
                question, answer = f"What is {m} times the population of {town['name']}?", m * town["population"]
            tasks.append({**task, "question": question, "answer": str(answer)})
        return tasks

    def prompt(self, task: Task) -> list[dict[str, str]]:
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return messages + [{"role": "user", "content": task["question"]}]

    def reference(self, task: Task) -> str | None:
        return f"\\boxed{{{task['answer']}}}"

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """A correct episode (real tool results): what SFT warm-up imitates (arbor.trainer.sft)."""
        calls = []
        if task["kind"] != "calc":
            calls.append(("search", {"query": task["town"]}, self.search(task["town"], self.search_k)))
        if task["kind"] != "lookup":
            calls.append(("calculator", {"expression": task["expression"]}, calculator(task["expression"])))
        messages = self.prompt(task)
        for name, args, result in calls:
            call = json.dumps({"name": name, "arguments": args})
            messages += [
                {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                {"role": "tool", "content": result},
            ]
        return messages + [{"role": "assistant", "content": f"\\boxed{{{task['answer']}}}"}]

    async def step(self, task: Task, state: ToolState, messages: list[dict[str, Any]]) -> StepResult:
        result = await super().step(task, state, messages)
        if result.done and self.nudge and last_boxed(messages[-1].get("content") or "") is None:
            # neither a tool call nor an answer: say what is expected and go on (max_turns bounds it)
            return StepResult([{"role": "user", "content": self.nudge}], done=False)
        return result

    async def score_episode(self, task: Task, state: ToolState, messages: list[dict[str, Any]]) -> dict[str, float]:
        final = next((m.get("content") or "" for m in reversed(messages) if m["role"] == "assistant"), "")
        return {
            "correct": float(is_correct(final, task["answer"])),
            "tool_penalty": 0.0 - self.invalid_penalty * state.invalid_calls,
        }
