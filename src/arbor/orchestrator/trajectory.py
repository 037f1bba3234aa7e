"""Token-exact multi-turn records: the prompt of every turn extends the previous prompt plus the sampled tokens.

Re-tokenising a conversation's text at every turn drifts from what the model sampled (BPE merges across a turn
boundary, templates that rewrite past turns, decode/encode round trips), and then the trainer's logprobs are of
tokens the policy never produced. A `Trajectory` never re-tokenises history. It keeps the current *branch*: the
token ids the model has seen (first prompt + every later token), and the text those tokens stand for (the
template's rendering of the first prompt, then the decoded sampled tokens and the inserted deltas). For the next
turn's messages it renders the whole conversation with the chat template; when the branch's text is a prefix of
that rendering, only the remaining suffix (the end of the assistant turn when generation stopped early, tool
results, a user turn, the next generation prompt: "template glue") is tokenised and appended.

When the new rendering does not extend the branch (a context manager or the agent truncated or edited history,
the template rewrote a past turn, the tools changed), the trajectory *branches*: the current branch is closed as
one sample and a new one starts from the fresh rendering of the new messages. An episode therefore yields one
sample per branch; each is trained as a separate sequence (see arbor.orchestrator.episode for rewards).

Public API:

    traj = Trajectory(tokenizer, tools=None)     # tools: JSON schemas (arbor.environments.tools.tool_schema)
    ids = traj.prompt_ids(messages, tools=None)  # the token ids to send for the next turn (tools: override)
    traj.add_completion(completion)              # an arbor.orchestrator.client.Completion sampled from `ids`
    traj.samples() -> list[Sample]               # the closed branches plus the open one (if it sampled anything)
    traj.num_branches, traj.num_tokens           # branches so far; tokens of the open branch incl. pending delta

A `Sample` holds `prompt_ids` (the branch's first prompt), `completion_ids` (everything after it),
`completion_mask` (1 = sampled by the policy and trained; 0 = inserted by the environment or the template),
`logprobs` (0.0 on mask-0 tokens), `policy_versions` (-1 on mask-0 tokens), `routed_experts` (the last
completion's array, which covers the whole branch since its prompt is the branch so far; None if absent),
`turns` ((start, end) offsets into completion_ids of each sampled turn: the per-turn boundaries that
`Rollout.turn_rewards` uses), `finish_reason` (of the last turn), and `text` (the completion part as text).

Contract for callers: append the assistant's turn as `{"role": "assistant", "content": completion.text}` (the
engine's text, the tool-call markup included). Appending a re-serialised structured `tool_calls` form instead
is allowed but usually renders differently from the sampled text and then branches every turn. A template
that drops past reasoning (Qwen3's `<think>` stripping before the last user turn) branches at such turns; that
is exact, only less mergeable.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from arbor.models.tokenizer import Tokenizer


@dataclasses.dataclass
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    turns: list[tuple[int, int]]
    finish_reason: str
    text: str
    routed_experts: Any = None

    @property
    def turn_ends(self) -> list[int]:
        return [end for _, end in self.turns]


@dataclasses.dataclass
class _Branch:
    prompt: list[int]
    text: str
    completion: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    turns: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    completion_text: str = ""
    pending: list[int] = dataclasses.field(default_factory=list)
    pending_text: str = ""
    finish_reason: str = ""
    routes: Any = None

    def sample(self) -> Sample:
        return Sample(
            list(self.prompt), list(self.completion), list(self.mask), list(self.logprobs), list(self.versions),
            list(self.turns), self.finish_reason, self.completion_text, self.routes,
        )


class Trajectory:
    def __init__(self, tokenizer: Tokenizer, tools: list[dict] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or None
        self._closed: list[_Branch] = []
        self._branch: _Branch | None = None

    @property
    def num_branches(self) -> int:
        return len(self._closed) + (self._branch is not None)

    @property
    def num_tokens(self) -> int:
        b = self._branch
        return 0 if b is None else len(b.prompt) + len(b.completion) + len(b.pending)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of the conversation `messages` ending in the generation prompt: the open branch extended
        by the new suffix when possible, else a new branch."""
        tools = tools if tools is not None else self.tools
        rendered = self.tokenizer.render_chat(messages, add_generation_prompt=True, tools=tools)
        b = self._branch
        if b is not None and b.turns and rendered.startswith(b.text):
            b.pending_text = rendered[len(b.text):]
            b.pending = self.tokenizer.encode_rendered(b.pending_text)
            return b.prompt + b.completion + b.pending
        if b is not None and b.turns:  # history was rewritten: close the branch as a sample of its own
            self._closed.append(b)
        # A branch that never sampled (prompt_ids called twice in a row) is simply replaced.
        self._branch = _Branch(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools), rendered)
        return list(self._branch.prompt)

    def add_completion(self, completion: Any) -> None:
        """Records the tokens sampled from the last `prompt_ids` (mask 1, their logprobs and versions)."""
        b = self._branch
        if b is None:
            raise RuntimeError("add_completion before prompt_ids: there is no prompt to complete")
        ids = list(completion.token_ids)
        if not (len(ids) == len(completion.logprobs) == len(completion.policy_versions)):
            raise ValueError("completion token_ids, logprobs and policy_versions differ in length")
        n = len(b.pending)
        b.completion += b.pending
        b.mask += [0] * n
        b.logprobs += [0.0] * n
        b.versions += [-1] * n
        b.text += b.pending_text
        b.completion_text += b.pending_text
        b.pending, b.pending_text = [], ""
        start = len(b.completion)
        b.completion += ids
        b.mask += [1] * len(ids)
        b.logprobs += [float(x) for x in completion.logprobs]
        b.versions += [int(v) for v in completion.policy_versions]
        b.turns.append((start, len(b.completion)))
        sampled_text = self.tokenizer.decode(ids, skip_special_tokens=False)
        b.text += sampled_text
        b.completion_text += sampled_text
        b.finish_reason = completion.finish_reason
        routes = getattr(completion, "routed_experts", None)
        if routes is not None and routes.shape[0] != len(b.prompt) + len(b.completion):
            raise ValueError(
                f"routed_experts covers {routes.shape[0]} tokens, the branch has {len(b.prompt) + len(b.completion)}"
            )
        b.routes = routes

    def samples(self) -> list[Sample]:
        """One sample per branch that sampled at least one turn, oldest first (the record is left as it is)."""
        branches = self._closed + ([self._branch] if self._branch is not None and self._branch.turns else [])
        return [b.sample() for b in branches]
