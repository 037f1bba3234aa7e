"""Token-exact multi-turn records: one tree of model calls per episode or agent session, turned into samples.

Re-tokenising a conversation drifts from what the model sampled, so a `Trajectory` never re-tokenises a reply: a
call extends the longest earlier turn its prompt begins with, a context edit starts a new root, and each leaf is
one sample (sampled tokens trained, inserted glue masked). Used by the episode driver and by the gateway. The
matching rules, the public API and the departures from Forge: docs/agents.md, "Token-exact records".

Images (a vision-language tokenizer, arbor.models.vision): a chat prompt with `image_url`/`image` parts is
rendered by the model's processor, its placeholder tokens in the ids and its pixel inputs kept beside them
(`Prompt.images`, `Turn.images`: every image of the prompt, in order). A call extends a turn only when the
turn's images are the first images of the call, pixel for pixel (placeholder ids alone cannot tell two images of
one size apart), so images from several turns accumulate in order and each sample carries its leaf's images:
exactly those of its ids. A text tokenizer refuses image parts in one line.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from arbor.models.image_parts import image_parts, refuse_images_for_text_model
from arbor.models.tokenizer import Tokenizer
from arbor.orchestrator.rollout import Rollout

Images = dict[str, Any]
"""A prompt's pixel inputs: `pixel_values [P, D]` and `image_grid_thw [I, 3]` (tensors or arrays), in the order
of the images' placeholders in its ids (arbor.models.vision.VisionPrompt)."""


def images_extend(images: Images | None, prefix: Images | None) -> bool:
    """Whether `images` begin with every image of `prefix` (grids and pixels equal); no images extend nothing
    but no images."""
    if prefix is None:
        return True
    if images is None:
        return False
    grid, first = np.asarray(images["image_grid_thw"]), np.asarray(prefix["image_grid_thw"])
    pix, head = np.asarray(images["pixel_values"]), np.asarray(prefix["pixel_values"])
    return (
        grid.shape[0] >= first.shape[0]
        and pix.shape[0] >= head.shape[0]
        and np.array_equal(grid[: first.shape[0]], first)
        and np.array_equal(pix[: head.shape[0]], head)
    )


@dataclasses.dataclass
class Prompt:
    """The ids to send for one call and where its turn will hang in the tree."""

    ids: list[int]
    parent: int | None
    template: list[int] | None = None
    """The chat template's tokens of `messages` with the generation prompt (None: a raw-token call)."""
    messages: list[dict[str, Any]] | None = None
    tools: list[dict] | None = None
    images: Images | None = None
    """The pixel inputs of every image placeholder in `ids` (None: a text prompt)."""


@dataclasses.dataclass
class Turn:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: str
    text: str
    parent: int | None
    """Index of the turn whose exact tokens this turn's prompt begins with, None for a root."""
    routed_experts: Any = None
    """The engine's routes for prompt + completion: they cover the whole chain up to this turn."""
    view: list[int] | None = None
    """The template's tokens of this turn's messages and its reply (None: not extendable by a chat call)."""
    reply_at: int = 0
    """Where the reply starts in `view`."""
    reward: float | None = None
    """The environment's own reward for this turn (StepResult.reward), if any."""
    images: Images | None = None
    """The pixel inputs of the image placeholders in `prompt_ids` (None: a text prompt)."""

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


@dataclasses.dataclass
class Sample:
    """One chain root -> leaf as a training sequence."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    turns: list[tuple[int, int]]
    """(start, end) offsets into completion_ids of each sampled turn."""
    finish_reason: str
    text: str
    """The completion as text (sampled and inserted tokens, special tokens included)."""
    routed_experts: Any = None
    """The leaf's routes: its prompt is the whole chain, so they cover every token."""
    rewards: list[float | None] = dataclasses.field(default_factory=list)
    """Each turn's own reward, None where the environment gave none."""
    images: Images | None = None
    """The leaf's prompt images: every image placeholder of the sample's ids, in order (None: text only)."""

    @property
    def turn_ends(self) -> list[int]:
        return [end for _, end in self.turns]


class Trajectory:
    def __init__(self, tokenizer: Tokenizer, tools: list[dict] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.turns: list[Turn] = []
        self._pending: Prompt | None = None

    # -- the tree --

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> Prompt:
        """The prompt of a chat call: the turn whose view `messages` extend, continued token-exactly, or the
        template's rendering of `messages` as a new root (see the module docstring)."""
        tools = tools if tools is not None else self.tools
        full, images = self._render(messages, tools)
        best: Turn | None = None
        for t in self.turns:
            v = t.view
            if (
                v is not None
                and len(full) > len(v)
                and (best is None or len(v) >= len(best.view))
                and full[len(v) - 1] == v[-1]
                and full[: len(v)] == v
                and images_extend(images, t.images)
            ):  # the last token first: cheap
                best = t
        ids = full if best is None else self._splice(best, full)
        return Prompt(ids, self._longest_prefix(ids, images), full, list(messages), tools, images)

    def _render(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> tuple[list[int], Images | None]:
        """The template's ids of `messages` with the generation prompt, and their images' pixel inputs."""
        if not image_parts(messages):
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools), None
        if not hasattr(self.tokenizer, "render_images"):
            refuse_images_for_text_model(messages, getattr(self.tokenizer, "name", "in use"))
        rendered = self.tokenizer.render_images(messages, add_generation_prompt=True, tools=tools)
        if not rendered.num_images:
            return rendered.ids, None
        return rendered.ids, {"pixel_values": rendered.pixel_values, "image_grid_thw": rendered.image_grid_thw}

    def token_prompt(self, ids: list[int]) -> Prompt:
        """A raw-token call (no images): its ids as given, under the longest text-only turn they extend."""
        return Prompt(list(ids), self._longest_prefix(ids))

    def record(self, prompt: Prompt, completion: Any, reply: dict[str, Any] | None = None) -> Turn:
        """Adds the turn of one engine completion sampled from `prompt.ids`. `reply` is the assistant message
        the caller will append to its history (a chat call); it makes the turn extendable by later chat calls."""
        ids = list(completion.token_ids)
        if not (len(ids) == len(completion.logprobs) == len(completion.policy_versions)):
            raise ValueError("completion token_ids, logprobs and policy_versions differ in length")
        routes = getattr(completion, "routed_experts", None)
        if routes is not None and routes.shape[0] != len(prompt.ids) + len(ids):
            raise ValueError(
                f"routed_experts covers {routes.shape[0]} tokens, the turn has {len(prompt.ids) + len(ids)}"
            )
        view, reply_at = None, 0
        if prompt.template is not None and reply is not None:
            rendered = self._with_reply(prompt, reply)
            if rendered is not None and rendered[: len(prompt.template)] == prompt.template:  # else a leaf
                view, reply_at = rendered, len(prompt.template)
        turn = Turn(
            list(prompt.ids),
            ids,
            [float(x) for x in completion.logprobs],
            [int(v) for v in completion.policy_versions],
            completion.finish_reason,
            completion.text,
            prompt.parent,
            routes,
            view,
            reply_at,
            images=prompt.images,
        )
        self.turns.append(turn)
        return turn

    def _with_reply(self, prompt: Prompt, reply: dict[str, Any]) -> list[int] | None:
        """The template's ids of the prompt's messages and `reply`: an image prompt's from its rendered ids and the
        template's text (its images were processed once, for the prompt), any other's rendered whole."""
        if prompt.images is not None and hasattr(self.tokenizer, "with_reply"):
            return self.tokenizer.with_reply(prompt.template, prompt.messages, reply, prompt.tools)
        return self.tokenizer.apply_chat_template(
            prompt.messages + [reply], add_generation_prompt=False, tools=prompt.tools
        )

    def _splice(self, t: Turn, full: list[int]) -> list[int]:
        """t's exact tokens, then the template's tokens after t's reply (which full begins with)."""
        eos = self.tokenizer.eos_token_id
        reply = t.view[t.reply_at :]
        end = len(reply) - 1 - reply[::-1].index(eos) if eos in reply else len(reply)
        ids = t.prompt_ids + t.completion_ids
        if not t.completion_ids or t.completion_ids[-1] != eos:
            ids += reply[end : end + 1]  # cut by length or a stop string: close the turn as the template does
        return ids + reply[end + 1 :] + full[len(t.view) :]

    def _longest_prefix(self, ids: list[int], images: Images | None = None) -> int | None:
        """The latest of the longest turns whose exact tokens `ids` properly extends (and `images` their images)."""
        best, best_len = None, -1
        for i, t in enumerate(self.turns):
            n, m = len(t.prompt_ids), len(t.prompt_ids) + len(t.completion_ids)
            last = t.completion_ids[-1] if t.completion_ids else t.prompt_ids[-1]
            if (
                len(ids) > m >= best_len
                and ids[m - 1] == last  # the last token first: cheap
                and ids[:n] == t.prompt_ids
                and ids[n:m] == t.completion_ids
                and images_extend(images, t.images)
            ):
                best, best_len = i, m
        return best

    # -- one caller, turn after turn (the episode driver) --

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
        """The token ids to send for the next turn; a second call before `add_completion` replaces the first."""
        self._pending = self.chat_prompt(messages, tools)
        return list(self._pending.ids)

    @property
    def pending_images(self) -> Images | None:
        """The pixel inputs of the last `prompt_ids` (None: a text prompt, or none pending): sent with its ids."""
        return None if self._pending is None else self._pending.images

    def add_completion(self, completion: Any) -> Turn:
        """Records the completion sampled from the last `prompt_ids`; the caller appends its text as the reply."""
        if self._pending is None:
            raise RuntimeError("add_completion before prompt_ids: there is no prompt to complete")
        prompt, self._pending = self._pending, None
        return self.record(prompt, completion, {"role": "assistant", "content": completion.text})

    @property
    def num_branches(self) -> int:
        """Samples so far, counting the one a pending prompt opens (a new root, or a fork off an inner turn)."""
        leaves = self._leaves()
        p = self._pending
        return len(leaves) + (p is not None and (p.parent is None or p.parent not in leaves))

    # -- samples --

    def _leaves(self) -> list[int]:
        parents = {t.parent for t in self.turns if t.parent is not None}
        return [i for i in range(len(self.turns)) if i not in parents]

    def samples(self) -> list[Sample]:
        """One sample per leaf, in the order the leaves were recorded (the record is left as it is)."""
        return [self._sample(i) for i in self._leaves()]

    def _sample(self, leaf: int) -> Sample:
        chain = [self.turns[leaf]]
        while chain[-1].parent is not None:
            chain.append(self.turns[chain[-1].parent])
        chain.reverse()
        root = chain[0]
        s = Sample(list(root.prompt_ids), [], [], [], [], [], chain[-1].finish_reason, "", chain[-1].routed_experts)
        s.images = chain[-1].images  # the leaf's prompt is the whole chain: its images are the sample's
        for t in chain:
            injected = t.prompt_ids[len(root.prompt_ids) + len(s.completion_ids) :]
            s.completion_ids += injected
            s.completion_mask += [0] * len(injected)
            s.logprobs += [0.0] * len(injected)
            s.policy_versions += [-1] * len(injected)  # inserted tokens: no policy sampled them
            start = len(s.completion_ids)
            s.completion_ids += t.completion_ids
            s.completion_mask += [1] * len(t.completion_ids)
            s.logprobs += t.logprobs
            s.policy_versions += t.policy_versions
            s.turns.append((start, len(s.completion_ids)))
            s.rewards.append(t.reward)
        s.text = self.tokenizer.decode(s.completion_ids, skip_special_tokens=False)
        return s

    def rollouts(
        self, task_id: int | str, reward: float, components: dict[str, float], *, per_turn: bool = False, **fields: Any
    ) -> list[Rollout]:
        """One Rollout per sample, each with the episode's reward and components (`fields`: group_id, episode_id,
        latency, score_failed...). With `per_turn` and any turn rewarded by the environment, each carries
        `turn_rewards`: its turns' own rewards, plus the episode's reward on its last turn."""
        per_turn = per_turn and any(t.reward is not None for t in self.turns)
        out = []
        for s in self.samples():
            rewards = None
            if per_turn:
                last = len(s.turns) - 1
                rewards = [
                    (end, (r or 0.0) + (reward if k == last else 0.0))
                    for k, ((_, end), r) in enumerate(zip(s.turns, s.rewards))
                ]
            out.append(
                Rollout(
                    task_id,
                    s.prompt_ids,
                    s.completion_ids,
                    s.logprobs,
                    s.policy_versions,
                    s.text,
                    s.finish_reason,
                    reward=reward,
                    components=dict(components),
                    routed_experts=s.routed_experts,
                    turn_rewards=rewards,
                    completion_mask=s.completion_mask,
                    images=s.images,
                    **fields,
                )
            )
        return out
