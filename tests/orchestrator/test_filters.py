"""Group filters and the easy / normal / hard curriculum sampler."""

from __future__ import annotations

import collections

import pytest

from arbor.config.orchestrator import AdvantageConfig, CurriculumConfig, FilterConfig
from arbor.orchestrator.advantages import compute_advantages
from arbor.orchestrator.filters import CurriculumSampler, difficulty, filter_reason, solve_rate
from arbor.orchestrator.rollout import Rollout


def _group(*rewards):
    g = [Rollout(0, [1], [2, 3], [-1.0, -1.0], [0, 0], "x", "stop", r) for r in rewards]
    compute_advantages([g], AdvantageConfig())
    return g


def test_zero_advantage_and_difficulty_filters():
    same, mixed, easy = _group(0.5, 0.5, 0.5), _group(1.0, 0.0, 0.0), _group(1.0, 1.0, 0.0)
    cfg = FilterConfig(drop_zero_advantage=True)
    assert filter_reason(same, cfg) == "zero_advantage" and filter_reason(mixed, cfg) is None
    assert filter_reason(same, FilterConfig()) is None  # off by default
    assert solve_rate(easy, 1.0) == pytest.approx(2 / 3)
    band = FilterConfig(min_solve_rate=0.1, max_solve_rate=0.5)
    assert filter_reason(mixed, band) is None and filter_reason(easy, band) == "difficulty"
    assert filter_reason(_group(0.0, 0.0), band) == "difficulty"
    with pytest.raises(ValueError, match="min_solve_rate"):
        FilterConfig(min_solve_rate=0.9, max_solve_rate=0.1)


def test_curriculum_pools_weights_and_resume():
    tasks = [{"id": i} for i in range(6)]
    cfg = CurriculumConfig(weights=(0.0, 0.0, 1.0), easy_above=0.8, hard_below=0.2, history=2)
    s = CurriculumSampler(tasks, 0, cfg)
    assert s.pools()["normal"] == list(range(6))  # unseen tasks are normal
    # hard pool empty and the others weigh 0: falls back to any populated pool
    assert s.next() in tasks
    s.record(tasks[1], 0.0)
    s.record(tasks[2], 0.1)
    s.record(tasks[3], 1.0)
    assert difficulty(s.rate(3), cfg) == "easy" and s.pools()["hard"] == [1, 2]
    draws = collections.Counter(s.next_index() for _ in range(200))
    assert set(draws) == {1, 2}  # only the hard pool has weight
    s.record(tasks[1], 1.0)  # history 2: mean (0 + 1) / 2 = 0.5 -> normal
    assert s.pools()["hard"] == [2]
    # Resume from the saved state continues with exactly the same draws.
    state = s.state()
    clone = CurriculumSampler(tasks, 0, cfg, state)
    assert [clone.next_index() for _ in range(20)] == [s.next_index() for _ in range(20)]
    mixed = CurriculumSampler(tasks, 1, CurriculumConfig(weights=(1.0, 1.0, 0.0)))
    mixed.record(tasks[0], 1.0)
    counts = collections.Counter(difficulty(mixed.rate(mixed.next_index()), mixed.cfg) for _ in range(400))
    assert 150 < counts["easy"] < 250 and counts["hard"] == 0  # half easy (1 task), half normal (5 tasks)
    with pytest.raises(ValueError, match="hard_below"):
        CurriculumConfig(easy_above=0.2, hard_below=0.5)
