"""Writes examples/gsm8k/data/train.jsonl: grade-school word problems in GSM8K's format (a `question`, and an
`answer` holding a short worked solution that ends `#### <number>`), generated from a fixed seed so the file is
the same on every machine. The numbers are small and each problem takes one or two operations, so that the
CPU twin's ~1M-parameter model can learn some of them within minutes.

    uv run python examples/gsm8k/make_data.py        # rewrites the file (byte-identical)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data" / "train.jsonl"
NAMES = ["Ann", "Ben", "Cai", "Dev", "Eva", "Finn", "Gus", "Ida", "Jo", "Kim", "Lea", "Max"]
ITEMS = ["apples", "pens", "books", "cards", "eggs", "cups", "coins", "toys"]


def _gain(rng: random.Random) -> tuple[str, str, int]:
    name, item, a, b = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(1, 9), rng.randint(1, 9)
    return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have?", f"{a} + {b} = {a + b}", a + b


def _loss(rng: random.Random) -> tuple[str, str, int]:
    name, item, a = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(2, 9)
    b = rng.randint(1, a)
    return f"{name} has {a} {item} and gives away {b}. How many {item} are left?", f"{a} - {b} = {a - b}", a - b


def _groups(rng: random.Random) -> tuple[str, str, int]:
    item, a, b = rng.choice(ITEMS), rng.randint(2, 5), rng.randint(1, 4)
    return f"There are {a} boxes with {b} {item} each. How many {item} in all?", f"{a} * {b} = {a * b}", a * b


def _two_steps(rng: random.Random) -> tuple[str, str, int]:
    name, item, a, b = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(2, 6), rng.randint(1, 3)
    c = rng.randint(1, a + b)
    question = f"{name} has {a} {item}, buys {b} more, then loses {c}. How many {item} now?"
    return question, f"{a} + {b} = {a + b}\n{a + b} - {c} = {a + b - c}", a + b - c


def problems(n: int = 400, seed: int = 0) -> list[dict[str, str]]:
    """`n` distinct problems (GSM8K's columns), the four kinds in turn."""
    rng, seen, rows = random.Random(seed), set(), []
    makers = [_gain, _loss, _groups, _two_steps]
    while len(rows) < n:
        question, work, answer = makers[len(rows) % len(makers)](rng)
        if question in seen:
            continue
        seen.add(question)
        rows.append({"question": question, "answer": f"{work}\n#### {answer}"})
    return rows


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(row) + "\n" for row in problems()))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
