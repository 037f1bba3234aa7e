"""Gateway sessions: the model calls of one black-box agent run, kept token-exact, turned into training samples.

Every call the gateway serves is a `Turn`: the prompt ids the gateway rendered, the completion ids, logprobs,
policy versions and routed experts the engine returned. A new call *extends* an earlier turn when its messages
are that turn's messages plus the reply the gateway gave, plus new messages (tool results, user turns): its
prompt is then the earlier turn's exact tokens (prompt + completion, never re-tokenised) followed by the chat
template's rendering of what is new. A call that does not extend any turn (the agent truncated, summarised or
rewrote its history, or the template re-renders old turns differently) starts a new root. When the session
closes, every chain root -> leaf becomes one sample: the root's prompt is the sample's prompt, and the rest
(model tokens and injected tokens alike) its completion with `completion_mask` marking the model's tokens.

Departures: like AReaL's and slime's proxies we render the chat template in the gateway and send token ids to
the backend; unlike them, a turn that fails the token-prefix check is never spliced (it branches), so no sample
ever holds tokens the model did not see. A turn extended by two later calls (the agent retried from the same
point) yields two samples sharing that turn's tokens; prefix merging in the trainer removes the duplicate work.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Callable

from arbor.orchestrator.rollout import Rollout

Render = Callable[[list[dict[str, Any]], "list[dict] | None", bool], list[int]]
"""(messages, tools, add_generation_prompt) -> token ids: the chat template."""


def normalize_message(m: dict[str, Any]) -> dict[str, Any]:
    """The parts of a chat message the template renders, in a canonical form for comparing histories
    (clients echo replies back with extra null fields, `arguments` as a string or a dict, content as parts)."""
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    out: dict[str, Any] = {"role": m.get("role"), "content": content or ""}
    calls = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function") or {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        calls.append({"name": fn.get("name"), "arguments": args})
    if calls:
        out["tool_calls"] = calls
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            out[key] = m[key]
    return out


@dataclasses.dataclass
class Turn:
    messages: list[dict[str, Any]] | None
    """The request's normalised messages (None for a /v1/completions call)."""
    reply: dict[str, Any] | None
    """The normalised assistant message the gateway answered with."""
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: str
    text: str
    parent: int | None
    """Index of the turn whose tokens this turn's prompt extends, None for a root."""
    routed_experts: Any = None
    tools: list[dict] | None = None

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


class SessionClosed(Exception):
    pass


@dataclasses.dataclass
class Session:
    id: str
    task_id: int | str = -1
    group_id: int = -1
    created: float = dataclasses.field(default_factory=time.monotonic)
    turns: list[Turn] = dataclasses.field(default_factory=list)
    closed: bool = False
    reward: float | None = None
    components: dict[str, float] = dataclasses.field(default_factory=dict)
    external: bool = False
    """Opened over HTTP (POST /v1/sessions) rather than by an environment: served and recorded, not trained on."""
    pending: int = 0
    """Calls being generated; a session closed meanwhile still records them (the agent saw their answers)."""

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict] | None, render: Render,
                    eos_id: int) -> tuple[list[int], int | None]:
        """Prompt ids for a chat call and the turn they extend (see the module docstring)."""
        norm = [normalize_message(m) for m in messages]
        full = render(messages, tools, True)
        best: int | None = None
        for i, t in enumerate(self.turns):
            if t.messages is None or t.tools != tools:
                continue
            k = len(t.messages)
            if len(norm) > k and norm[:k] == t.messages and norm[k] == t.reply:
                if best is None or k >= len(self.turns[best].messages or []):
                    best = i
        if best is None:
            return full, None
        t = self.turns[best]
        spliced = _splice(t, messages[: len(t.messages) + 1], tools, full, render, eos_id)
        return (full, None) if spliced is None else (spliced, best)

    def completion_prompt(self, prompt_ids: list[int]) -> int | None:
        """The longest earlier turn whose exact tokens `prompt_ids` starts with (/v1/completions calls)."""
        best, best_len = None, -1
        for i, t in enumerate(self.turns):
            ids = t.ids
            if len(prompt_ids) > len(ids) > best_len and prompt_ids[: len(ids)] == ids:
                best, best_len = i, len(ids)
        return best

    def rollouts(self, episode_id: int = -1) -> list[Rollout]:
        """One sample per root -> leaf chain, carrying the session's reward; `episode_id` (the session's index in
        its group) makes group advantages count a branched session once (arbor.orchestrator.advantages)."""
        parents = {t.parent for t in self.turns if t.parent is not None}
        out = []
        for i, leaf in enumerate(self.turns):
            if i in parents:
                continue
            chain = [leaf]
            while chain[-1].parent is not None:
                chain.append(self.turns[chain[-1].parent])
            chain.reverse()
            out.append(_chain_rollout(chain, self, episode_id))
        return out


def _splice(t: Turn, history: list[dict[str, Any]], tools: list[dict] | None, full: list[int], render: Render,
            eos_id: int) -> list[int] | None:
    """t's exact tokens + the template's rendering of the messages after t's reply, or None when the template
    does not render the shared history as a prefix (then the call branches)."""
    base = render(history[:-1], tools, True)
    hist = render(history, tools, False)
    if hist[: len(base)] != base or full[: len(hist)] != hist:
        return None
    reply = hist[len(base):]  # the template's tokens for the reply: the model's tokens stand in for them
    end = len(reply) - 1 - reply[::-1].index(eos_id) if eos_id in reply else len(reply)
    ids = t.ids
    if not t.completion_ids or t.completion_ids[-1] != eos_id:
        ids = ids + reply[end:end + 1]  # a truncated or stop-string reply: close it as the template does
    return ids + reply[end + 1:] + full[len(hist):]


def _chain_rollout(chain: list[Turn], s: Session, episode_id: int) -> Rollout:
    root = chain[0]
    P = len(root.prompt_ids)
    completion: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    routes = []
    for t in chain:
        injected = t.prompt_ids[P + len(completion):]
        completion += injected + t.completion_ids
        mask += [0] * len(injected) + [1] * len(t.completion_ids)
        logprobs += [0.0] * len(injected) + list(t.logprobs)
        versions += [-1] * len(injected) + list(t.policy_versions)  # inserted tokens: no policy sampled them
        routes.append(t.routed_experts)
    leaf = chain[-1]
    # Router replay needs every token's experts: the leaf's prompt holds the whole chain, so its array does.
    experts = leaf.routed_experts if all(r is not None for r in routes) else None
    if experts is not None and len(experts) != P + len(completion):
        experts = None
    return Rollout(
        s.task_id, list(root.prompt_ids), completion, logprobs, versions, leaf.text, leaf.finish_reason,
        reward=s.reward or 0.0, components=dict(s.components), routed_experts=experts, group_id=s.group_id, completion_mask=mask,
        episode_id=episode_id,
    )

