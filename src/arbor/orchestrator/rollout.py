"""The rollout record: one sampled completion (or one branch of a multi-turn episode) with its reward.

A rollout keeps exactly the tokens the engine produced (never re-tokenised text), their logprobs and the
policy version that sampled each token; that is what the trainer's importance ratio and the staleness bound
are computed from. Groups of them are generated and scored by arbor.orchestrator.group.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Rollout:
    task_id: int | str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    text: str
    finish_reason: str
    reward: float = 0.0
    components: dict[str, float] = dataclasses.field(default_factory=dict)
    advantage: float = 0.0
    score_failed: bool = False
    routed_experts: Any = None
    """MoE router replay: `np.ndarray [num_tokens, moe_layers, top_k]` from the engine, carried as is."""
    group_id: int = -1
    """Which group (task instance) of the run this rollout belongs to."""
    turn_rewards: list[tuple[int, float]] | None = None
    """Per-turn or process rewards as (end offset in completion_ids, reward): the reward for the tokens up to
    that offset; multi-turn environments set it and `reward_to_go` turns it into per-token advantages."""
    token_advantages: list[float] | None = None
    """Per-completion-token advantages (reward-to-go); None means `advantage` on every token."""
    latency: float | None = None
    """Seconds from launch to finish, when the environment measures it per rollout (composite time reward)."""
    pieces: int = 1
    """Generation requests it took: > 1 for a partial rollout (aborted, then resumed with its tokens kept)."""
    completion_mask: list[int] | None = None
    """Multi-turn: 1 for completion tokens the policy sampled (trained), 0 for tokens the environment inserted
    (tool results, user turns, template glue: no loss, logprob 0, policy version -1). None means all ones."""
    episode_id: int = -1
    """Multi-turn: the episode a rollout came from; a branched episode gives several rollouts with one id."""
    teacher_logprobs: list[float] | None = None
    """On-policy distillation: the teacher's logprob of each completion token given the tokens before it
    (arbor.orchestrator.teacher); None without a teacher."""
    teacher_topk_ids: Any = None
    """With `orchestrator.teacher.top_k = k`: `np.ndarray [C, k]` int32, the teacher's k most likely tokens at each
    completion position, best first; None otherwise."""
    teacher_topk_logprobs: Any = None
    """Their logprobs, `np.ndarray [C, k]` float32."""
    images: dict[str, Any] | None = None
    """A vision-language prompt's pixel inputs, `pixel_values [P, D]` and `image_grid_thw [I, 3]` (arrays or
    tensors, arbor.models.vision.VisionPrompt), for the placeholder tokens of its ids in order: those of
    `prompt_ids`, then (multi-turn) those a later turn inserted into `completion_ids`; None for text."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def num_trained(self) -> int:
        """Completion tokens that carry loss (the sampled ones)."""
        return len(self.completion_ids) if self.completion_mask is None else int(sum(self.completion_mask))

    def staleness(self, step: int) -> int:
        """Trainer steps between the oldest policy that sampled a token of this rollout and `step` (inserted
        tokens, version -1, do not count)."""
        if self.completion_mask is None:
            return step - min(self.policy_versions) if self.policy_versions else 0
        sampled = [v for v, m in zip(self.policy_versions, self.completion_mask) if m]
        return step - min(sampled) if sampled else 0
