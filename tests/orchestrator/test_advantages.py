"""Advantages (GRPO, Dr.GRPO, RLOO, reward-to-go, composite time reward) and the batcher's explicit loss
normalisation, each against hand-computed numbers."""

from __future__ import annotations

import numpy as np
import pytest

from arbor.config.orchestrator import AdvantageConfig
from arbor.orchestrator.advantages import compute_advantages, drgrpo, grpo, rloo
from arbor.orchestrator.batcher import build_step_batches, loss_weights
from arbor.orchestrator.rollout import Rollout


def _r(reward: float = 0.0, c: int = 4, group: int = 0, p: int = 2, **kw) -> Rollout:
    return Rollout(
        0,
        list(range(1, p + 1)),
        list(range(10, 10 + c)),
        [-0.5] * c,
        [0] * c,
        "x",
        "stop",
        reward,
        group_id=group,
        **kw,
    )


def test_grpo_drgrpo_rloo_by_hand():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])
    assert drgrpo(rewards, AdvantageConfig(std_normalize=True)).tolist() == [
        [0.5, -0.5, -0.5, 0.5],
        [1.0, -1.0, 0.0, 0.0],
    ]
    assert grpo(rewards, AdvantageConfig(std_normalize=True))[0].tolist() == pytest.approx([1, -1, -1, 1], abs=1e-5)
    # RLOO: r_i - mean of the other three: 1 - 1/3, 0 - 2/3; 3 - 5/3, 1 - 7/3, 2 - 2.
    assert rloo(rewards, AdvantageConfig()).ravel().tolist() == pytest.approx(
        [2 / 3, -2 / 3, -2 / 3, 2 / 3, 4 / 3, -4 / 3, 0, 0]
    )
    assert rloo(np.array([[5.0]]), AdvantageConfig()).tolist() == [[0.0]]
    with pytest.raises(ValueError, match="unknown advantage"):
        compute_advantages([[_r()]], AdvantageConfig(name="ppo"))


def test_reward_to_go_with_discount():
    # Rollout a: two turns (tokens 0-1 reward 1, tokens 2-3 reward 0); rollout b: no turns, final reward 1 over
    # its 4 tokens. All turn rewards of the group: [1, 0, 1], mean 2/3.
    a = _r(1.0, 4, turn_rewards=[(2, 1.0), (4, 0.0)])
    b = _r(1.0, 4)
    compute_advantages([[a, b]], AdvantageConfig(gamma=0.5))
    n1, n2, m = 1 - 2 / 3, 0 - 2 / 3, 1 - 2 / 3
    assert a.token_advantages == pytest.approx([n1 + 0.5 * n2] * 2 + [n2] * 2)
    assert b.token_advantages == pytest.approx([m] * 4)
    assert a.advantage == pytest.approx(n1 + 0.5 * n2)
    (batch,) = build_step_batches([a, b], 0, 1, 64, 1.0, 0)
    adv = batch.micro_batches[0].advantages
    # Both samples have 6 tokens; packing keeps the input order for equal lengths.
    assert adv[batch.micro_batches[0].loss_mask].tolist() == pytest.approx(a.token_advantages + b.token_advantages)
    bad = _r(1.0, 4, turn_rewards=[(3, 1.0), (2, 0.0)])
    with pytest.raises(ValueError, match="turn_rewards offsets"):
        compute_advantages([[bad]], AdvantageConfig())


def test_composite_completion_time_reward():
    fast, slow, mid, wrong = _r(1.0, 2), _r(1.0, 10), _r(1.0, 6), _r(0.0, 1)
    compute_advantages([[fast, slow, mid, wrong]], AdvantageConfig(completion_time_weight=0.2))
    # Successful rollouts only: cost 2 -> +0.2, 10 -> 0, 6 -> 0.1; the failed one gets nothing despite being fastest.
    assert [fast.reward, slow.reward, mid.reward, wrong.reward] == pytest.approx([1.2, 1.0, 1.1, 0.0])
    assert fast.components["completion_time"] == pytest.approx(0.2) and "completion_time" not in wrong.components
    timed = [_r(1.0, 5, latency=3.0), _r(1.0, 5, latency=1.0)]  # measured latency wins over token counts
    compute_advantages([timed], AdvantageConfig(completion_time_weight=1.0))
    assert [r.reward for r in timed] == pytest.approx([1.0, 2.0])


def test_loss_normalisation_weights():
    rs = [_r(c=2, group=0), _r(c=6, group=0), _r(c=4, group=1)]  # 12 loss tokens, 3 samples, 2 groups
    assert loss_weights(rs, "token") == [1.0, 1.0, 1.0]
    # sequence: L / (N * len) -> each sample's tokens sum to L/N = 4
    assert loss_weights(rs, "sequence") == pytest.approx([2.0, 2 / 3, 1.0])
    # group: L / (G * tokens_g) -> group 0 has 8 tokens, group 1 has 4: 12/16 and 12/8
    assert loss_weights(rs, "group") == pytest.approx([0.75, 0.75, 1.5])
    (b,) = build_step_batches(rs, 0, 1, 64, 1.0, 0, normalization="sequence")
    w = sum(float((mb.loss_weights * mb.loss_mask).sum()) for mb in b.micro_batches)
    assert w == pytest.approx(12.0)  # total weight = loss tokens: the trainer's divisor still gives a mean
    assert b.metadata["normalization"] == "sequence"
    assert all(float(abs(mb.loss_weights[~mb.loss_mask]).sum()) == 0 for mb in b.micro_batches)


def test_std_ddof_is_a_documented_choice():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0]])
    # population std 0.5 -> +-1; sample std sqrt(1/3) -> +-0.866
    assert grpo(rewards, AdvantageConfig(std_normalize=True))[0].tolist() == pytest.approx([1, -1, -1, 1], abs=1e-5)
    v = 0.5 / np.sqrt(1 / 3)
    ddof1 = grpo(rewards, AdvantageConfig(std_normalize=True, std_ddof=1))[0]
    assert ddof1.tolist() == pytest.approx([v, -v, -v, v], abs=1e-5)
    single = grpo(np.array([[1.0]]), AdvantageConfig(std_normalize=True, std_ddof=1))
    assert single.tolist() == [[0.0]]


def test_completion_time_bonus_reaches_per_turn_rewards():
    fast = _r(1.0, 4, turn_rewards=[(2, 0.5), (4, 1.0)])
    slow = _r(1.0, 8, turn_rewards=[(4, 0.5), (8, 1.0)])
    compute_advantages([[fast, slow]], AdvantageConfig(completion_time_weight=0.4))
    assert fast.turn_rewards[-1][1] == pytest.approx(1.4) and slow.turn_rewards[-1][1] == pytest.approx(1.0)
    # The bonus moves the advantages: the faster rollout's last turn is now above the slower one's.
    assert fast.token_advantages[-1] > slow.token_advantages[-1]
