"""Context management as an environment step: trim an episode's history between turns.

The multi-turn driver keeps two conversations: the full one (scored at the end) and the agent's *view*, the
messages the model is actually prompted with. Before each turn it asks the configured `ContextPolicy` whether the
view must be edited (more than `keep_turns` turns, or, with `trigger_tokens`, a prompt longer than that); if so
the view becomes the policy's edit and the agent continues from it. Since an edit rewrites history, the
trajectory branches there (arbor.orchestrator.trajectory), so the trained samples hold exactly the trimmed
contexts the agent saw.

- `truncate`: keep the head (the system prompt and, with `keep_prompt`, the task's prompt messages) and the last
  `keep_turns` turns, where a turn is an assistant message plus the environment messages after it.
- `summarise`: the same, plus one user message after the head, `SUMMARY_HEADER` + the summariser's text for
  the dropped messages (a previous summary among them is carried over whole). The default summariser is
  extractive and deterministic (one clipped line per dropped message): no model call, same input same output.
  A summariser that calls a model can be plugged in by dotted path; it gets the dropped messages only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from arbor.config.environment import ContextConfig
from arbor.registry import load_object

SUMMARY_HEADER = "Summary of earlier turns:\n"
Summariser = Callable[[list[dict[str, Any]]], str]


def extractive_summary(dropped: list[dict[str, Any]], width: int = 100) -> str:
    """One line per dropped message: its role and the first line of its content, clipped to `width`."""
    lines = []
    for m in dropped:
        content = m.get("content") or ""
        if content.startswith(SUMMARY_HEADER):  # an earlier summary: keep what it said
            lines.append(content[len(SUMMARY_HEADER) :])
            continue
        first = content.strip().split("\n", 1)[0]
        lines.append(f"- {m['role']}: {first[:width]}{'...' if len(first) > width else ''}")
    return "\n".join(lines)


def turn_starts(messages: list[dict[str, Any]], head: int) -> list[int]:
    """Indices (after the head) where a turn begins: each assistant message."""
    return [i for i in range(head, len(messages)) if messages[i]["role"] == "assistant"]


class ContextPolicy:
    def __init__(self, cfg: ContextConfig, summariser: Summariser | None = None) -> None:
        self.cfg = cfg
        self.summariser = summariser or (load_object(cfg.summariser) if cfg.strategy == "summarise" else None)
        self.edits = 0

    def _head(self, messages: list[dict[str, Any]], num_prompt: int) -> int:
        if self.cfg.keep_prompt:
            head = num_prompt
        else:
            head = 1 if messages and messages[0]["role"] == "system" else 0
        return head

    def should_edit(self, view: list[dict[str, Any]], num_prompt: int, prompt_tokens: int) -> bool:
        if self.cfg.strategy == "none":
            return False
        starts = turn_starts(view, self._head(view, num_prompt))
        if len(starts) <= self.cfg.keep_turns:
            return False  # nothing to drop
        return self.cfg.trigger_tokens is None or prompt_tokens > self.cfg.trigger_tokens

    def edit(self, view: list[dict[str, Any]], num_prompt: int) -> list[dict[str, Any]]:
        """The trimmed view: head, (summary), last `keep_turns` turns."""
        head = self._head(view, num_prompt)
        starts = turn_starts(view, head)
        if len(starts) <= self.cfg.keep_turns:
            return list(view)
        cut = starts[-self.cfg.keep_turns]
        dropped = view[head:cut]
        out = list(view[:head])
        if self.cfg.strategy == "summarise":
            out.append({"role": "user", "content": SUMMARY_HEADER + self.summariser(dropped)})
        self.edits += 1
        return out + list(view[cut:])
