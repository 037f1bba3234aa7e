"""math: arithmetic and algebra word problems with verifiable answers, generated locally from a seed, or the
problems of a dataset (GSM8K, MATH and their kind) given by hub id or local file.

Problem kinds (`kinds` selects among them): `arithmetic` (integer expressions with precedence and brackets),
`fraction` (sums and products of fractions, answer reduced), `linear` (solve a*x + b = c, answer possibly a
fraction), `word` (multi-step shopping / sharing stories) and `percent`. `difficulty` (1..3) scales the numbers
and the number of operations. No download: the dataset is a pure function of the seed.

With `dataset` (arbor.environments.datasets: hub id or parquet/jsonl/arrow file, `split`, `dataset_config`,
`columns` mapping the task fields `question` and `answer` to columns) the tasks are the dataset's rows instead.
The reference is read from the answer column by `answer_format`: "gsm8k" takes the text after the last `####`
(GSM8K's solutions end `#### 72`), "math" the last `\\boxed{...}` of a worked solution (MATH), "plain" the column
as it is, and "auto" (default) picks by what each answer holds.

Answer checking: the answer is the content of the last `\\boxed{...}` (nested braces allowed), or else the last
number of the completion's final non-empty line ("... the answer is 7/2."). It is parsed exactly (integers,
decimals, `a/b`, `\\frac{a}{b}` / `\\dfrac`, a leading minus, thousands separators) into a `Fraction` and compared
exactly with the reference: 0.5 matches 1/2, 0.333 does not match 1/3. A reference that is not one number (MATH's
`\\frac{\\sqrt{3}}{2}`, `(1, 2)`, `x^2+1`) is compared as TeX after normalisation (spacing, `\\left`/`\\right`,
`\\dfrac`/`\\tfrac`, degree marks, `\\text{}` wrappers and a trailing period removed). Reward components:
`correct` (1 or 0) and, with `format_weight > 0`, `format` (that weight when a boxed answer is present) for early
shaping.
"""

from __future__ import annotations

import random
import re
from fractions import Fraction

from arbor.environments.datasets import DatasetError, load_rows, map_columns
from arbor.environments.protocol import Task

KINDS = ("arithmetic", "fraction", "linear", "word", "percent")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*-?\d+)?")
_FRAC = re.compile(r"^(-?)\\d?frac\{(-?\d+)\}\{(-?\d+)\}$")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None when there is none."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    depth, i = 1, starts[-1]
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def parse_number(text: str) -> Fraction | None:
    """An exact value from an answer string, or None when it is not one number."""
    s = text.strip().strip("$").strip().rstrip(".").replace(" ", "")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "")
    if s.startswith("(") and s.endswith(")"):
        s = s[1:-1]
    m = _FRAC.match(s)
    if m:
        sign, num, den = m.groups()
        return None if int(den) == 0 else Fraction(int(num), int(den)) * (-1 if sign else 1)
    s = s.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s) else s
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            return None if Fraction(den) == 0 else Fraction(num) / Fraction(den)
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(completion: str) -> str | None:
    """The boxed answer, or the last number on the last non-empty line."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    lines = [line for line in completion.strip().splitlines() if line.strip()]
    if not lines:
        return None
    numbers = _NUMBER.findall(lines[-1])
    return numbers[-1] if numbers else None


def normalize_tex(text: str) -> str:
    """An answer's TeX with the spellings that do not change its value removed (for non-numeric answers)."""
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", text)
    for old, new in (
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("$", ""),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
    ):
        s = s.replace(old, new)
    return re.sub(r"\s+", "", s).rstrip(".")


def is_correct(completion: str, answer: str) -> bool:
    got = extract_answer(completion)
    if got is None:
        return False
    want = parse_number(answer)
    if want is None:  # a symbolic reference: equal as normalised TeX
        return normalize_tex(got) == normalize_tex(answer)
    value = parse_number(got)
    if value is None:  # a number in TeX dress: `90^\\circ`, `\\text{12}`
        value = parse_number(normalize_tex(got))
    return value is not None and value == want


ANSWER_FORMATS = ("auto", "gsm8k", "math", "plain")


def reference_answer(text: str, answer_format: str = "auto") -> str:
    """The final answer held by a dataset's answer column (see the module docstring for the formats)."""
    text = str(text)
    if answer_format == "auto":
        answer_format = "gsm8k" if "####" in text else "math" if last_boxed(text) is not None else "plain"
    if answer_format == "gsm8k":
        if "####" not in text:
            raise DatasetError(f"answer_format 'gsm8k': no '####' in the answer {text[:60]!r}")
        return text.rsplit("####", 1)[1].strip().replace(",", "")
    if answer_format == "math":
        boxed = last_boxed(text)
        if boxed is None:
            raise DatasetError(f"answer_format 'math': no \\boxed{{}} in the answer {text[:60]!r}")
        return boxed.strip()
    return text.strip()


def fmt(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def _arithmetic(rng: random.Random, d: int) -> tuple[str, Fraction]:
    hi = 10**d
    a, b, c = rng.randint(1, hi), rng.randint(1, hi), rng.randint(1, 9 * d)
    form = rng.randrange(3 if d > 1 else 2)
    if form == 0:
        return f"What is {a} + {b} * {c}?", Fraction(a + b * c)
    if form == 1:
        return f"What is {a} - {b}?", Fraction(a - b)
    return f"What is ({a} + {b}) * {c}?", Fraction((a + b) * c)


def _fraction(rng: random.Random, d: int) -> tuple[str, Fraction]:
    hi = 4 + 3 * d
    x = Fraction(rng.randint(1, hi), rng.randint(2, hi))
    y = Fraction(rng.randint(1, hi), rng.randint(2, hi))
    if rng.random() < 0.5:
        return f"What is {x.numerator}/{x.denominator} + {y.numerator}/{y.denominator}? Reduce the fraction.", x + y
    return f"What is {x.numerator}/{x.denominator} * {y.numerator}/{y.denominator}? Reduce the fraction.", x * y


def _linear(rng: random.Random, d: int) -> tuple[str, Fraction]:
    hi = 5 * d
    a = rng.choice([k for k in range(-hi, hi + 1) if k not in (0,)])
    b, c = rng.randint(-10 * d, 10 * d), rng.randint(-10 * d, 10 * d)
    sign = "+" if b >= 0 else "-"
    return f"Solve for x: {a}x {sign} {abs(b)} = {c}", Fraction(c - b, a)


def _word(rng: random.Random, d: int) -> tuple[str, Fraction]:
    name = rng.choice(["Ada", "Ben", "Chen", "Dana", "Eli", "Fay"])
    item = rng.choice(["apples", "pens", "stamps", "marbles", "cards"])
    have, bags, per = rng.randint(1, 10 * d), rng.randint(2, 3 + d), rng.randint(2, 4 * d + 2)
    if rng.random() < 0.5:
        text = f"{name} has {have} {item} and buys {bags} bags of {per} {item} each. How many {item} does {name} have?"
        return text, Fraction(have + bags * per)
    friends = rng.randint(2, 3 + d)
    total = friends * rng.randint(1, 5 * d)
    gives = rng.randint(0, total // friends)
    text = (
        f"{name} shares {total} {item} equally among {friends} friends, then each friend gives away {gives}. "
        f"How many {item} does each friend keep?"
    )
    return text, Fraction(total // friends - gives)


def _percent(rng: random.Random, d: int) -> tuple[str, Fraction]:
    p = rng.choice([5, 10, 20, 25, 40, 50, 75] + ([12, 15, 35] if d > 1 else []))
    n = rng.randint(1, 20 * d) * 4
    return f"What is {p}% of {n}?", Fraction(p * n, 100)


_MAKERS = {"arithmetic": _arithmetic, "fraction": _fraction, "linear": _linear, "word": _word, "percent": _percent}


class MathEnv:
    name = "math"

    def __init__(
        self,
        num_tasks: int = 10000,
        kinds: list[str] | None = None,
        difficulty: int = 1,
        system_prompt: str | None = "Solve the problem. Put the final answer in \\boxed{}.",
        format_weight: float = 0.0,
        dataset: str | None = None,
        split: str = "train",
        dataset_config: str | None = None,
        columns: dict[str, str] | None = None,
        answer_format: str = "auto",
    ) -> None:
        kinds = list(kinds or KINDS)
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown:
            raise ValueError(f"math: unknown kinds {unknown}; choose from {list(KINDS)}")
        if not 1 <= difficulty <= 3:
            raise ValueError(f"math: difficulty must be 1, 2 or 3, got {difficulty}")
        self.num_tasks, self.kinds, self.difficulty = num_tasks, kinds, difficulty
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"math: answer_format must be one of {list(ANSWER_FORMATS)}, got {answer_format!r}")
        self.system_prompt, self.format_weight = system_prompt, format_weight
        self.source, self.split, self.dataset_config = dataset, split, dataset_config
        self.columns, self.answer_format = columns, answer_format

    def dataset(self, seed: int) -> list[Task]:
        if self.source is not None:
            rows = load_rows(self.source, self.split, self.dataset_config)
            tasks = map_columns(rows, self.columns, ("question", "answer"), self.source)
            return [{**t, "answer": reference_answer(t["answer"], self.answer_format)} for t in tasks]
        rng = random.Random(seed)
        tasks = []
        for i in range(self.num_tasks):
            kind = self.kinds[i % len(self.kinds)]
            question, answer = _MAKERS[kind](rng, self.difficulty)
            tasks.append({"id": i, "kind": kind, "question": question, "answer": fmt(answer)})
        return tasks

    def prompt(self, task: Task) -> list[dict[str, str]]:
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return messages + [{"role": "user", "content": task["question"]}]

    async def score(self, task: Task, completion: str) -> dict[str, float]:
        out = {"correct": float(is_correct(completion, task["answer"]))}
        if self.format_weight > 0:
            out["format"] = self.format_weight * (last_boxed(completion) is not None)
        return out

    def reference(self, task: Task) -> str | None:
        return f"\\boxed{{{task['answer']}}}"
