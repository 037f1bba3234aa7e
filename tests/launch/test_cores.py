"""The launcher's core split (arbor.launch.cores): the split that minimises the overlapped step, threads set by
hand kept, runs it does not apply to, and a resumed run's own measured figures."""

from __future__ import annotations

import json

import pytest
from tomli_w import dumps

from arbor import run_dir
from arbor.config.rl import RLConfig
from arbor.launch.cores import DEFAULT_WORK, split, split_cores


def rl_config(tmp_path, **over) -> RLConfig:
    return RLConfig.model_validate({"model": {"name": "qwen3-test"}, "output_dir": str(tmp_path), **over})


@pytest.mark.parametrize(
    "cores, work, expected",
    [
        (2, (4.26, 2.04), (1, 1)),
        (1, (4.26, 2.04), (1, 1)),  # one core: one thread each, they share it
        (16, (4.26, 2.04), (11, 5)),
        (16, (1.0, 3.0), (4, 12)),
        (3, (1.0, 1.0), (2, 1)),  # a tie goes to the trainer
    ],
)
def test_split_gives_threads_in_proportion_to_work(cores, work, expected) -> None:
    assert split(cores, *work) == expected


def test_fresh_run_splits_by_the_default_work_ratio(tmp_path) -> None:
    cfg = rl_config(tmp_path)
    note = split_cores(cfg, cores=16)
    assert (cfg.trainer.num_threads, cfg.inference.num_threads) == split(16, *DEFAULT_WORK)
    assert "default work ratio" in note


@pytest.mark.parametrize(
    "over, expected",
    [
        ({"trainer": {"num_threads": 3}}, (3, 5)),
        ({"inference": {"num_threads": 6}}, (2, 6)),
        ({"trainer": {"num_threads": 1}, "inference": {"num_threads": 1}}, (1, 1)),
    ],
)
def test_threads_set_by_hand_are_kept(tmp_path, over, expected) -> None:
    cfg = rl_config(tmp_path, **over)
    split_cores(cfg, cores=8)
    assert (cfg.trainer.num_threads, cfg.inference.num_threads) == expected


@pytest.mark.parametrize(
    "over",
    [
        {"inference": {"backend": "vllm"}},
        {"inference": {"replicas": 2}},
        {"trainer": {"parallel": {"nproc": 2}}},
    ],
)
def test_runs_that_size_their_own_pools_are_left_alone(tmp_path, over) -> None:
    cfg = rl_config(tmp_path, **over)
    assert split_cores(cfg, cores=8) is None
    assert (cfg.trainer.num_threads, cfg.inference.num_threads) == (None, None)


def test_resumed_run_splits_by_its_own_figures(tmp_path) -> None:
    configs = run_dir.configs_dir(tmp_path)
    configs.mkdir(parents=True)
    (configs / "trainer.toml").write_text(dumps({"num_threads": 2}))
    (configs / "inference.toml").write_text(dumps({"num_threads": 2}))
    # generation took 3x the trainer's compute at equal threads: the generator gets three quarters
    rows = [{"step": s, "time/compute": 1.0, "time/generate": 3.0} for s in range(4)]
    run_dir.metrics_path(tmp_path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = rl_config(tmp_path, resume=True)
    note = split_cores(cfg, cores=8)
    assert (cfg.trainer.num_threads, cfg.inference.num_threads) == (2, 6)
    assert "measured" in note
    fresh = rl_config(tmp_path)  # without --resume the figures are not this run's
    split_cores(fresh, cores=8)
    assert (fresh.trainer.num_threads, fresh.inference.num_threads) == split(8, *DEFAULT_WORK)
