"""swe_agent: a multi-turn code agent that fixes small Python repositories, its tests run in arbor's sandbox.

Each task is a repository shipped as data (a JSON Lines file, one task a line: `id`, `issue` (the bug report the
agent reads), `files` (path -> content: the repository), `tests` (a test module of `test_*` functions run against
it) and `solution` (path -> fixed content, for the SFT demonstration)). The agent works through four tools on its
own copy of the files: `list_files`, `read_file`, `write_file` and `run_tests`; a turn without a tool call ends
the episode. The reward is the fraction of the tests that pass on the final files (`passed`), run in the sandbox
(arbor.environments.sandbox: rlimits, and namespaces and cgroups where the machine allows them), minus
`invalid_penalty` per malformed or failing tool call (`tool_penalty`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from arbor.environments.multiturn import ToolEnv, ToolState
from arbor.environments.protocol import Task
from arbor.environments.sandbox import Sandbox, SandboxLimits

# The sandbox's main.py: imports the test module, runs each test_* function, prints one verdict line per test.
RUNNER = """import importlib, sys, traceback
sys.path.insert(0, ".")
mod = importlib.import_module("test_repo")
for name in sorted(n for n in dir(mod) if n.startswith("test_")):
    try:
        getattr(mod, name)()
        print("PASS", name)
    except Exception as e:
        print("FAIL", name, type(e).__name__, str(e)[:200])
"""


def count_verdicts(stdout: str) -> tuple[int, int]:
    """(passed, total) from the runner's verdict lines."""
    verdicts = [line.split()[0] for line in stdout.splitlines() if line.startswith(("PASS ", "FAIL "))]
    return verdicts.count("PASS"), len(verdicts)


class SweAgentEnv(ToolEnv):
    name = "swe_agent"

    def __init__(
        self,
        tasks: str = "examples/swe_agent/tasks.jsonl",
        max_turns: int = 6,
        invalid_penalty: float = 0.05,
        wall_seconds: float = 10.0,
        max_concurrency: int = 4,
        system_prompt: str | None = "Fix the repository. Tools: list_files, read_file, write_file, run_tests.",
    ) -> None:
        path = Path(tasks)
        if not path.is_file():
            raise ValueError(f"swe_agent: tasks file {tasks} does not exist (a relative path starts at {Path.cwd()})")
        self.rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for row in self.rows:
            missing = sorted({"id", "issue", "files", "tests"} - row.keys())
            if missing:
                raise ValueError(f"swe_agent: task {row.get('id', '?')} in {tasks} lacks {', '.join(missing)}")
        self.max_turns, self.invalid_penalty, self.system_prompt = max_turns, invalid_penalty, system_prompt
        self.sandbox = Sandbox(SandboxLimits(wall_seconds=wall_seconds), max_concurrency=max_concurrency)

    def dataset(self, seed: int) -> list[Task]:
        return [dict(row) for row in self.rows]

    def prompt(self, task: Task) -> list[dict[str, str]]:
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return messages + [{"role": "user", "content": task["issue"]}]

    async def setup(self, task: Task) -> ToolState:
        return ToolState(extra={"files": dict(task["files"])})  # the episode's own copy of the repository

    async def run_tests(self, files: dict[str, str], tests: str) -> tuple[int, int, str]:
        """(passed, total, output) of `tests` run against `files` in the sandbox."""
        res = await self.sandbox.run(RUNNER, {**files, "test_repo.py": tests})
        passed, total = count_verdicts(res.stdout)
        return passed, total, (res.stdout + res.stderr)[-2000:]

    def tools(self, task: Task) -> list[Callable[..., Any]]:
        """The tools on a fresh copy of the repository (what the chat template shows)."""
        return self.episode_tools(task, ToolState(extra={"files": dict(task["files"])}))

    def episode_tools(self, task: Task, state: ToolState) -> list[Callable[..., Any]]:
        files: dict[str, str] = state.extra["files"]

        def list_files() -> str:
            """Lists the repository's files."""
            return "\n".join(sorted(files))

        def read_file(path: str) -> str:
            """Returns a file's content.

            Args:
                path: the file's path, as list_files shows it
            """
            if path not in files:
                raise ValueError(f"no file {path!r}")
            return files[path]

        def write_file(path: str, content: str) -> str:
            """Replaces (or creates) a file.

            Args:
                path: the file's path
                content: its whole new content
            """
            files[path] = content
            return f"wrote {path} ({len(content)} characters)"

        async def run_tests() -> str:
            """Runs the repository's tests and returns their verdicts."""
            passed, total, output = await self.run_tests(files, task["tests"])
            return f"{passed}/{total} tests pass\n{output}"

        return [list_files, read_file, write_file, run_tests]

    async def score_episode(self, task: Task, state: ToolState, messages: list[dict[str, Any]]) -> dict[str, float]:
        passed, total, _ = await self.run_tests(state.extra["files"], task["tests"])
        return {
            "passed": passed / total if total else 0.0,
            "tool_penalty": 0.0 - self.invalid_penalty * state.invalid_calls,
        }

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """A correct episode without tool results that need running: read each fixed file, write its fix, answer."""
        messages = self.prompt(task)
        for path, content in task.get("solution", {}).items():
            for name, args, result in (
                ("read_file", {"path": path}, task["files"].get(path, "")),
                ("write_file", {"path": path, "content": content}, f"wrote {path} ({len(content)} characters)"),
            ):
                call = json.dumps({"name": name, "arguments": args})
                messages += [
                    {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                    {"role": "tool", "content": result},
                ]
        return messages + [{"role": "assistant", "content": "Fixed."}]
