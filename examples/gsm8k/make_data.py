"""Writes the CPU twin's data, generated from fixed seeds so the files are the same on every machine:

- `data/train.jsonl`: 400 one-step grade-school word problems in GSM8K's format (a `question`, and an `answer`
  holding the worked step and `#### <number>`), the RL tasks;
- `data/sft.jsonl`: 300 other problems of the same kinds as SFT rows (`prompt` the question, `completion` the
  worked step then `\\boxed{<number>}`), the warm-up's demonstrations; none of their questions is a train question.

The numbers are single digits and each problem takes one addition, subtraction or multiplication (GSM8K's
problems take two to eight steps), the easiest curriculum in GSM8K's format.

    uv run python examples/gsm8k/make_data.py        # rewrites both files (byte-identical)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
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
    name, item, a, b = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(2, 5), rng.randint(1, 5)
    question = f"{name} has {a} boxes with {b} {item} in each. How many {item} does {name} have?"
    return question, f"{a} * {b} = {a * b}", a * b


MAKERS = [_gain, _loss, _groups]


def _generate(n: int, seed: int, exclude: set[str]) -> list[tuple[str, str, int]]:
    """`n` distinct (question, worked step, answer) triples, the kinds in turn, none of whose questions is in
    `exclude`."""
    rng, seen, out = random.Random(seed), set(exclude), []
    while len(out) < n:
        question, work, answer = MAKERS[len(out) % len(MAKERS)](rng)
        if question in seen:
            continue
        seen.add(question)
        out.append((question, work, answer))
    return out


def problems(n: int = 400, seed: int = 0) -> list[dict[str, str]]:
    """`n` distinct problems (GSM8K's columns), the kinds in turn: the RL tasks."""
    return [{"question": q, "answer": f"{work}\n#### {answer}"} for q, work, answer in _generate(n, seed, set())]


def demonstrations(n: int = 300, seed: int = 1) -> list[dict[str, str]]:
    """`n` SFT rows on problems that are not RL tasks: the worked step, then the answer boxed as the verifier
    reads it."""
    train = {row["question"] for row in problems()}
    return [
        {"prompt": q, "completion": f"{work}\n\\boxed{{{answer}}}"} for q, work, answer in _generate(n, seed, train)
    ]


def main() -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", problems()), ("sft.jsonl", demonstrations())):
        (DATA / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"wrote {DATA / name}")


if __name__ == "__main__":
    main()
