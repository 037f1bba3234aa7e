"""code: the model writes a small Python function; hidden test cases run it in the sandbox.

Tasks are generated locally and deterministically from a seed (no download): 16 task families (arithmetic,
strings, lists, number theory) with random constants, each a function to write, a reference solution and hidden
test inputs; the expected outputs come from running the (trusted) reference in-process. The prompt asks for a
```python block. Scoring extracts the last such block and runs it with a test harness in
`arbor.environments.sandbox`, so a fork bomb, an infinite loop, a huge allocation or a flood of output scores 0
and never stops the run; a sandbox error is logged and scores 0 too.

With `dataset` (arbor.environments.datasets: a hub id or a parquet/jsonl/arrow file, `split`, `dataset_config`)
the tasks are the dataset's rows: `columns` maps the task fields `question` (the problem statement), `entry`
(the function's name), `tests` (a list, or its JSON text, of `{"args": [...], "expected": ...}`) and the optional
`answer` (a reference solution, for SFT warm-up) to the dataset's columns.

Reward components: `pass` (the fraction of tests passed, or 0/1 with `partial_credit = false`) and `format` (1
when a fenced code block was found). Departures: unlike HumanEval-style harnesses (and prime-rl's code envs, which
use remote sandboxes), the harness is the main program and imports the solution after reading a per-call nonce
from stdin, and results are compared as canonical JSON, so printing a fake result, exiting early or returning an
object with a lying `__eq__` does not pass. A solution that deliberately inspects the harness's frames could
still forge results: the harness shares its interpreter.
"""

from __future__ import annotations

import json
import logging
import random
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from arbor.environments.datasets import DatasetError, load_rows, map_columns
from arbor.environments.protocol import Task
from arbor.environments.sandbox import Sandbox, SandboxLimits

log = logging.getLogger(__name__)

FENCE = re.compile(r"```(python|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
RESULT_PREFIX = "__arbor_result__"

HARNESS = """\
import json, sys


def main():  # locals, not module globals, so `import __main__` does not reveal the nonce
    nonce = sys.stdin.readline().strip()
    tests = json.loads(sys.stdin.read())
    out, sys.stdout, sys.stdin = sys.stdout, sys.stderr, None  # the solution's prints cannot crowd out the result
    passed = []
    try:
        import solution
        fn = getattr(solution, {entry!r})
    except BaseException as e:
        print(f"import failed: {{e!r}}", file=sys.stderr)
        fn = None
    for t in tests:
        ok = False
        if fn is not None:
            try:
                ok = json.dumps(fn(*t["args"]), sort_keys=True) == json.dumps(t["expected"], sort_keys=True)
            except BaseException as e:
                print(f"test failed: {{e!r}}", file=sys.stderr)
        passed.append(ok)
    out.write("\\n{prefix}" + nonce + json.dumps(passed) + "\\n")
    out.flush()


main()
"""


@dataclass(frozen=True)
class Family:
    name: str
    describe: Callable[[dict], str]
    source: Callable[[dict], str]
    """The reference solution, a `def name(...)` source."""
    params: Callable[[random.Random], dict]
    inputs: Callable[[random.Random, dict], list]
    """One test's positional arguments."""


def _ints(rng: random.Random, n: int = 6, lo: int = -20, hi: int = 20) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(1, n))]


def _word(rng: random.Random, letters: str = "abcde", n: int = 8) -> str:
    return "".join(rng.choice(letters) for _ in range(rng.randint(0, n)))


FAMILIES = [
    Family(
        "add_constant",
        lambda p: f"returns the integer x plus {p['k']}",
        lambda p: f"def add_constant(x):\n    return x + {p['k']}\n",
        lambda r: {"k": r.randint(1, 99)},
        lambda r, p: [r.randint(-1000, 1000)],
    ),
    Family(
        "scale_list",
        lambda p: f"returns a new list with every element of the list xs multiplied by {p['k']}",
        lambda p: f"def scale_list(xs):\n    return [x * {p['k']} for x in xs]\n",
        lambda r: {"k": r.randint(2, 9)},
        lambda r, p: [_ints(r)],
    ),
    Family(
        "count_char",
        lambda p: f"returns how many times the character {p['c']!r} occurs in the string s",
        lambda p: f"def count_char(s):\n    return s.count({p['c']!r})\n",
        lambda r: {"c": r.choice("abcde")},
        lambda r, p: [_word(r)],
    ),
    Family(
        "reverse_words",
        lambda p: "returns the words of the string s (split on spaces) in reverse order, joined by single spaces",
        lambda p: "def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n",
        lambda r: {},
        lambda r, p: [" ".join(_word(r, n=5) or "a" for _ in range(r.randint(1, 5)))],
    ),
    Family(
        "is_palindrome",
        lambda p: "returns True if the string s reads the same backwards, else False",
        lambda p: "def is_palindrome(s):\n    return s == s[::-1]\n",
        lambda r: {},
        lambda r, p: [
            (lambda w: w + w[::-1][r.randint(0, 1) :])(_word(r, "ab", 4)) if r.random() < 0.5 else _word(r, "ab", 6)
        ],
    ),
    Family(
        "fizzbuzz",
        lambda p: (
            f"returns 'FizzBuzz' if n is divisible by both {p['a']} and {p['b']}, 'Fizz' if "
            f"only by {p['a']}, 'Buzz' if only by {p['b']}, else str(n)"
        ),
        lambda p: (
            f"def fizzbuzz(n):\n    if n % {p['a']} == 0 and n % {p['b']} == 0:\n        return 'FizzBuzz'\n"
            f"    if n % {p['a']} == 0:\n        return 'Fizz'\n    if n % {p['b']} == 0:\n"
            "        return 'Buzz'\n    return str(n)\n"
        ),
        lambda r: dict(zip("ab", r.sample([2, 3, 5, 7], 2))),
        lambda r, p: [r.randint(1, 100)],
    ),
    Family(
        "sum_multiples",
        lambda p: f"returns the sum of the positive integers below n divisible by {p['a']} or {p['b']}",
        lambda p: (
            f"def sum_multiples(n):\n    return sum(i for i in range(1, n) if i % {p['a']} == 0 or i % {p['b']} == 0)\n"
        ),
        lambda r: dict(zip("ab", r.sample([2, 3, 5, 7, 11], 2))),
        lambda r, p: [r.randint(0, 200)],
    ),
    Family(
        "fibonacci",
        lambda p: "returns the n-th Fibonacci number, with fibonacci(0) == 0 and fibonacci(1) == 1",
        lambda p: "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
        lambda r: {},
        lambda r, p: [r.randint(0, 40)],
    ),
    Family(
        "gcd",
        lambda p: "returns the greatest common divisor of the positive integers a and b",
        lambda p: "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
        lambda r: {},
        lambda r, p: [r.randint(1, 500), r.randint(1, 500)],
    ),
    Family(
        "running_max",
        lambda p: "returns the list of running maxima of the list xs (element i is max(xs[:i+1]))",
        lambda p: (
            "def running_max(xs):\n    out = []\n    for x in xs:\n"
            "        out.append(x if not out else max(out[-1], x))\n    return out\n"
        ),
        lambda r: {},
        lambda r, p: [_ints(r, 8)],
    ),
    Family(
        "rotate_left",
        lambda p: f"returns the list xs rotated left by {p['k']} positions (wrapping around)",
        lambda p: (
            f"def rotate_left(xs):\n    if not xs:\n        return []\n    k = {p['k']} % len(xs)\n"
            "    return xs[k:] + xs[:k]\n"
        ),
        lambda r: {"k": r.randint(1, 5)},
        lambda r, p: [_ints(r, 7) if r.random() < 0.9 else []],
    ),
    Family(
        "count_vowels",
        lambda p: "returns the number of vowels (a, e, i, o, u; lowercase) in the string s",
        lambda p: "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)\n",
        lambda r: {},
        lambda r, p: [_word(r, "abcdefghijklmnopqrstu", 12)],
    ),
    Family(
        "digit_sum",
        lambda p: "returns the sum of the decimal digits of the non-negative integer n",
        lambda p: "def digit_sum(n):\n    return sum(int(d) for d in str(n))\n",
        lambda r: {},
        lambda r, p: [r.randint(0, 10**9)],
    ),
    Family(
        "dedupe",
        lambda p: "returns the list xs without repeated elements, keeping first occurrences in order",
        lambda p: (
            "def dedupe(xs):\n    seen, out = set(), []\n    for x in xs:\n        if x not in seen:\n"
            "            seen.add(x)\n            out.append(x)\n    return out\n"
        ),
        lambda r: {},
        lambda r, p: [_ints(r, 10, 0, 5)],
    ),
    Family(
        "clamp_all",
        lambda p: f"returns the list xs with every element clamped into [{p['lo']}, {p['hi']}]",
        lambda p: f"def clamp_all(xs):\n    return [min(max(x, {p['lo']}), {p['hi']}) for x in xs]\n",
        lambda r: (lambda lo: {"lo": lo, "hi": lo + r.randint(1, 15)})(r.randint(-10, 5)),
        lambda r, p: [_ints(r, 8)],
    ),
    Family(
        "second_largest",
        lambda p: "returns the second largest distinct value in the list xs (which has at least two distinct values)",
        lambda p: "def second_largest(xs):\n    return sorted(set(xs))[-2]\n",
        lambda r: {},
        lambda r, p: [[0, 1] + _ints(r, 6)] if r.random() < 0.2 else [_ints(r, 6) + [21, 22]],
    ),
]


def make_task(index: int, family: Family, rng: random.Random, num_tests: int) -> Task:
    params = family.params(rng)
    source = family.source(params)
    namespace: dict[str, Any] = {}
    exec(source, namespace)  # trusted reference code, written above
    fn = namespace[family.name]
    tests = []
    for _ in range(num_tests):
        args = family.inputs(rng, params)
        tests.append({"args": args, "expected": fn(*args)})
    return {"id": index, "entry": family.name, "description": family.describe(params), "tests": tests, "answer": source}


def extract_code(completion: str) -> str | None:
    """The last fenced code block (```python preferred over a bare ```), or None."""
    blocks = FENCE.findall(completion)
    tagged = [body for lang, body in blocks if lang]
    chosen = tagged or [body for _, body in blocks]
    return chosen[-1] if chosen else None


class CodeEnv:
    name = "code"

    def __init__(
        self,
        num_tasks: int = 48,
        tests_per_task: int = 6,
        partial_credit: bool = True,
        system_prompt: str | None = None,
        max_concurrency: int = 4,
        cpu_seconds: int = 5,
        wall_seconds: float = 10.0,
        memory_mb: int = 1024,
        file_size_mb: int = 16,
        max_processes: int = 32,
        max_output_bytes: int = 64 * 1024,
        dataset: str | None = None,
        split: str = "train",
        dataset_config: str | None = None,
        columns: dict[str, str] | None = None,
    ) -> None:
        if num_tasks < 1 or tests_per_task < 1:
            raise ValueError(f"need num_tasks >= 1 and tests_per_task >= 1, got {num_tasks}, {tests_per_task}")
        self.num_tasks, self.tests_per_task = num_tasks, tests_per_task
        self.partial_credit, self.system_prompt = partial_credit, system_prompt
        self.source, self.split, self.dataset_config, self.columns = dataset, split, dataset_config, columns
        self.sandbox = Sandbox(
            SandboxLimits(
                cpu_seconds=cpu_seconds,
                wall_seconds=wall_seconds,
                memory_mb=memory_mb,
                file_size_mb=file_size_mb,
                max_processes=max_processes,
                max_output_bytes=max_output_bytes,
            ),
            max_concurrency=max_concurrency,
        )

    def dataset(self, seed: int) -> list[Task]:
        if self.source is not None:
            rows = load_rows(self.source, self.split, self.dataset_config)
            tasks = map_columns(rows, self.columns, ("question", "entry", "tests"), self.source, optional=("answer",))
            return [{**t, "tests": _dataset_tests(t["tests"], t["id"], self.source)} for t in tasks]
        rng = random.Random(seed)
        return [make_task(i, FAMILIES[i % len(FAMILIES)], rng, self.tests_per_task) for i in range(self.num_tasks)]

    def prompt(self, task: Task) -> list[dict[str, str]]:
        if "question" in task:  # a dataset's problem statement, as written
            text = (
                f"{task['question']}\nAnswer with the complete Python function `{task['entry']}` in a ```python "
                "code block."
            )
        else:
            text = (
                f"Write a Python function `{task['entry']}` that {task['description']}. Answer with the "
                "complete function in a ```python code block."
            )
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return messages + [{"role": "user", "content": text}]

    async def score(self, task: Task, completion: str) -> dict[str, float]:
        code = extract_code(completion)
        if code is None:
            return {"pass": 0.0, "format": 0.0}
        return {"pass": await self.run_tests(task, code), "format": 1.0}

    async def run_tests(self, task: Task, code: str) -> float:
        """The pass score of `code` on the task's hidden tests; 0 on any failure of the program or the sandbox."""
        nonce = secrets.token_hex(16)
        harness = HARNESS.format(entry=task["entry"], prefix=RESULT_PREFIX)
        stdin = nonce + "\n" + json.dumps(task["tests"])
        try:
            result = await self.sandbox.run(harness, files={"solution.py": code}, stdin=stdin)
        except Exception:  # a sandbox fault must cost this sample, not the run
            log.exception("code env: sandbox failed on task %s", task.get("id"))
            return 0.0
        passed = _parse_result(result.stdout, nonce, len(task["tests"])) if result.ok else None
        if passed is None:
            return 0.0
        fraction = sum(passed) / len(passed)
        return fraction if self.partial_credit else float(fraction == 1.0)

    def reference(self, task: Task) -> str | None:
        return f"```python\n{task['answer']}```" if task.get("answer") else None


def _dataset_tests(tests: Any, row: int, source: str) -> list[dict[str, Any]]:
    """A dataset row's test cases, checked: a list (or its JSON text) of {"args": [...], "expected": ...}."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError:
            raise DatasetError(f"dataset {source!r} row {row}: the tests column is not JSON") from None
    if not (
        isinstance(tests, list)
        and tests
        and all(isinstance(t, dict) and isinstance(t.get("args"), list) and "expected" in t for t in tests)
    ):
        raise DatasetError(
            f'dataset {source!r} row {row}: tests must be a non-empty list of {{"args": [...], "expected": ...}}'
        )
    return tests


def _parse_result(stdout: str, nonce: str, num_tests: int) -> list[bool] | None:
    marker = RESULT_PREFIX + nonce
    for line in reversed(stdout.splitlines()):
        if line.startswith(marker):
            try:
                passed = json.loads(line[len(marker) :])
            except ValueError:
                return None
            if isinstance(passed, list) and len(passed) == num_tests and all(isinstance(p, bool) for p in passed):
                return passed
            return None
    return None
