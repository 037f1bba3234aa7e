"""A black-box agent: it knows only the `openai` package and an OpenAI-compatible endpoint, nothing of arbor.

It answers one task with one chat completion and prints the answer. The endpoint comes from the standard
`OPENAI_BASE_URL` / `OPENAI_API_KEY` variables (or `solve`'s arguments), the task from argv, else stdin.

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=none python agent.py "Reverse: abc"
"""

from __future__ import annotations

import os
import sys

from openai import OpenAI


def solve(task: str, base_url: str | None = None, api_key: str | None = None) -> str:
    client = OpenAI(
        base_url=base_url or os.environ["OPENAI_BASE_URL"],
        api_key=api_key or os.environ.get("OPENAI_API_KEY", "none"),
        timeout=120.0,
        max_retries=2,
    )
    try:
        reply = client.chat.completions.create(
            model=os.environ.get("AGENT_MODEL", "arbor"),
            messages=[{"role": "user", "content": task}],
            max_tokens=16,
        )
    finally:
        client.close()
    return reply.choices[0].message.content or ""


if __name__ == "__main__":
    task = " ".join(sys.argv[1:]) or sys.stdin.read()
    print(solve(task.strip()))
