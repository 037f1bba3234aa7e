"""Orchestrator pieces that need no server: packing, advantages, task sampling, state, metrics merging."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from arbor.checkpoint_manifest import CheckpointDamaged
from arbor.config.orchestrator import AdvantageConfig
from arbor.monitor.metrics import MetricsWriter, read_jsonl, trainer_metrics_path, truncate_jsonl
from arbor.orchestrator.advantages import compute_advantages, grpo
from arbor.orchestrator.batcher import build_step_batches
from arbor.orchestrator.rollout import Rollout
from arbor.orchestrator.state import OrchestratorState, TaskSampler, load_state, save_state
from arbor.run_dir import rollout_rank_file
from arbor.transport.batch import DTYPES
from arbor.transport.files import read_step


def _rollout(p: int, c: int, reward: float = 0.0, version: int = 0) -> Rollout:
    return Rollout(0, list(range(1, p + 1)), list(range(10, 10 + c)), [-0.5] * c, [version] * c, "x", "stop", reward)


def test_packing_balances_ranks_and_keeps_every_token():
    rollouts = [_rollout(p, c) for p, c in [(5, 3), (7, 9), (4, 4), (10, 2), (3, 1), (6, 6), (2, 8)]]
    batches = build_step_batches(rollouts, step=4, ranks=2, micro_batch_tokens=16, temperature=1.0, pad_id=0)
    assert len(batches) == 2
    assert len(batches[0].micro_batches) == len(batches[1].micro_batches)
    total = sum(r.num_tokens for r in rollouts)
    real = [sum(int(mb.seq_lens.sum()) for mb in b.micro_batches if mb.loss_mask.any()) for b in batches]
    assert sum(real) == total and abs(real[0] - real[1]) <= max(r.num_tokens for r in rollouts)
    for b in batches:
        assert b.loss_tokens_total == sum(len(r.completion_ids) for r in rollouts)
        for mb in b.micro_batches:
            assert mb.num_tokens <= 16 or len(mb.seq_lens) == 1
            assert int(mb.loss_mask.sum()) == int((mb.policy_versions >= 0).sum())
            # position ids restart at every packed sample
            starts = np.cumsum([0] + mb.seq_lens.tolist()[:-1])
            assert all(int(mb.position_ids[s]) == 0 for s in starts)


def test_loss_mask_covers_completion_only():
    (b,) = build_step_batches([_rollout(4, 3)], step=0, ranks=1, micro_batch_tokens=64, temperature=1.0, pad_id=0)
    mb = b.micro_batches[0]
    assert mb.loss_mask.tolist() == [False] * 4 + [True] * 3
    assert mb.inference_logprobs.tolist() == [0.0] * 4 + [-0.5] * 3


def test_grpo_advantages():
    groups = [[_rollout(2, 2, r) for r in (1.0, 0.0, 0.5, 0.5)], [_rollout(2, 2, r) for r in (1.0, 1.0, 1.0, 1.0)]]
    compute_advantages(groups, AdvantageConfig())
    assert [r.advantage for r in groups[0]] == pytest.approx([0.5, -0.5, 0.0, 0.0])
    assert [r.advantage for r in groups[1]] == pytest.approx([0, 0, 0, 0])
    adv = grpo(np.array([[1.0, 0.0]]), AdvantageConfig(std_normalize=True))
    assert adv.tolist()[0] == pytest.approx([1.0, -1.0], abs=1e-5)


def test_user_advantage_by_dotted_path():
    groups = [[_rollout(2, 2, r) for r in (1.0, 0.0)]]
    compute_advantages(groups, AdvantageConfig(name="test_batcher:double_reward"))
    assert [r.advantage for r in groups[0]] == [2.0, 0.0]


def double_reward(rewards: np.ndarray, cfg: AdvantageConfig) -> np.ndarray:
    return rewards * 2


def test_task_sampler_resumes_exactly():
    tasks = [{"id": i} for i in range(5)]
    a = TaskSampler(tasks, seed=1)
    first = [a.next()["id"] for _ in range(7)]
    b = TaskSampler(tasks, seed=1, epoch=a.epoch, position=a.position)
    assert [a.next()["id"] for _ in range(6)] == [b.next()["id"] for _ in range(6)]
    assert sorted(first[:5]) == list(range(5))  # an epoch visits every task once


def test_orchestrator_state_roundtrip(tmp_path):
    save_state(tmp_path, OrchestratorState(step=3, epoch=1, position=9))
    assert load_state(tmp_path, 3) == OrchestratorState(3, 1, 9)
    with pytest.raises(CheckpointDamaged, match="step_4/orchestrator.json is missing"):
        load_state(tmp_path, 4)  # one line naming the file (arbor.checkpoint_manifest)


def test_metrics_merge_in_step_order_and_truncate(tmp_path):
    w = MetricsWriter(tmp_path)
    w.add(0, {"reward/mean": 0.1})
    w.add(1, {"reward/mean": 0.2})
    tpath = trainer_metrics_path(tmp_path)
    tpath.write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    assert w.poll() == []  # step 0's trainer half is missing, so step 1 waits too
    with open(tpath, "a") as f:
        f.write(json.dumps({"step": 0, "loss": 0.4}) + "\n")
    assert w.poll() == [0, 1]
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1] and rows[1] == {"step": 1, "reward/mean": 0.2, "loss": 0.5}
    truncate_jsonl(tmp_path / "metrics.jsonl", 1)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0]
    # a restarted writer picks up orchestrator halves that were never merged
    w.add(1, {"reward/mean": 0.3})
    again = MetricsWriter(tmp_path)
    assert again.pending == {1: {"reward/mean": 0.3}}  # the newest half of a step wins
    assert again.poll() == [1]


@pytest.mark.slow
def test_wandb_offline_run_receives_merged_steps(tmp_path, monkeypatch):
    from arbor.config.monitor import WandbConfig
    from arbor.monitor.metrics import init_wandb

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = init_wandb(WandbConfig(project="arbor-test"), tmp_path, {"lr": 1.0})
    assert run.settings.mode == "offline"  # no key: never tries the network
    w = MetricsWriter(tmp_path, run)
    w.add(0, {"reward/mean": 0.5})
    path = trainer_metrics_path(tmp_path)
    path.write_text(json.dumps({"step": 0, "loss": 0.1}) + "\n")
    assert w.poll() == [0]
    w.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_completion_mask_trains_only_sampled_tokens():
    """Multi-turn: environment-inserted tokens (mask 0) get no loss, weight 0, and do not count in normalisation."""
    multi = _rollout(3, 6, reward=1.0)
    multi.completion_mask = [1, 1, 0, 0, 1, 1]
    multi.policy_versions = [0, 0, -1, -1, 0, 0]
    multi.advantage = 0.5
    single = _rollout(2, 4)
    single.group_id = 1
    for norm in ("token", "sequence", "group"):
        (b,) = build_step_batches([multi, single], 0, 1, 64, 1.0, 0, normalization=norm)
        assert b.loss_tokens_total == 4 + 4
        mb = b.micro_batches[0]
        rows = {int(n): i for i, n in enumerate(mb.seq_lens.tolist())}
        start = sum(mb.seq_lens.tolist()[: rows[9]])
        mask = mb.loss_mask[start : start + 9].tolist()
        assert mask == [False] * 3 + [True, True, False, False, True, True]
        w = mb.loss_weights[start : start + 9]
        assert (w[~mb.loss_mask[start : start + 9]] == 0).all()
        assert mb.advantages[start + 5].item() == 0.0 and mb.advantages[start + 3].item() == 0.5
        # every normalisation sums to the step's loss-token count over trained tokens
        assert float(mb.loss_weights.sum()) == pytest.approx(8.0)
    assert multi.staleness(2) == 2  # inserted tokens' version -1 is not "oldest"
    with pytest.raises(ValueError, match="completion_mask"):
        bad = _rollout(2, 3)
        bad.completion_mask = [1]
        build_step_batches([bad], 0, 1, 64, 1.0, 0)


def test_reward_to_go_with_inserted_tokens():
    r = _rollout(2, 6, reward=1.0)
    r.completion_mask = [1, 1, 0, 0, 1, 1]
    r.turn_rewards = [(2, 0.0), (6, 1.0)]
    other = _rollout(2, 2, reward=0.0)
    compute_advantages([[r, other]], AdvantageConfig())
    (b,) = build_step_batches([r, other], 0, 1, 64, 1.0, 0)
    mb = b.micro_batches[0]
    # turn rewards (0, 1) and the other rollout's 0 have mean 1/3: turn 2 gets 2/3, turn 1 -1/3 + 2/3
    assert sorted(mb.advantages[mb.loss_mask].tolist()) == pytest.approx(
        sorted([1 / 3] * 2 + [2 / 3] * 2 + [-1 / 3] * 2), abs=1e-6
    )
    assert r.token_advantages[2:4] == pytest.approx([2 / 3] * 2)  # inserted tokens: carried, but masked out


def _image_rollout(i: int, images: int) -> Rollout:
    r = _rollout(3, 2 + i)
    r.prompt_ids = [100 + i] + [261] * (4 * images) + [5, 6]
    if images:
        r.images = {
            "pixel_values": np.full((16 * images, 6), float(i)),
            "image_grid_thw": np.tile([1, 4, 4], (images, 1)),
        }
    return r


def test_packing_keeps_each_samples_images_with_it():
    """Rows of vision-language samples (and a text one) carry their samples' images in row order; prefix merging
    is refused in one line."""
    rollouts = [_image_rollout(i, images) for i, images in enumerate([1, 2, 0, 1, 3])]
    batches = build_step_batches(rollouts, step=0, ranks=2, micro_batch_tokens=24, temperature=1.0, pad_id=0)
    seen = 0
    for b in batches:
        for mb in b.micro_batches:
            starts = np.cumsum([0] + mb.seq_lens.tolist()[:-1])
            owners = [int(mb.input_ids[s]) - 100 for s in starts if int(mb.input_ids[s]) >= 100]
            expected = [
                float(i)
                for i in owners
                for _ in range(16 * (rollouts[i].images is not None and len(rollouts[i].images["image_grid_thw"])))
            ]
            if mb.pixel_values is None:
                assert not expected
                continue
            assert mb.pixel_values[:, 0].tolist() == expected
            assert int(mb.image_grid_thw.prod(-1).sum()) == mb.pixel_values.shape[0]
            assert int((mb.input_ids == 261).sum()) * 4 == mb.pixel_values.shape[0]
            seen += len(owners)
    assert seen >= 4
    with pytest.raises(ValueError, match="prefix_merge cannot merge prompts with images"):
        build_step_batches(
            rollouts, step=0, ranks=1, micro_batch_tokens=64, temperature=1.0, pad_id=0, prefix_merge=True
        )


NO_TORCH_WRITER = """
import sys
from arbor.orchestrator import main  # the orchestrator's whole import graph
from arbor.orchestrator.batcher import build_step_batches
from arbor.orchestrator.rollout import Rollout
from arbor.transport.files import write_step

rollouts = [
    Rollout(g, [1, 2, 3, 4], [10 + g, 11, 12 + k], [-0.5, -0.25, -0.125], [0, 0, 1], "x", "stop", float(k))
    for g in range(3) for k in range(2)
]
for step, merge in ((0, False), (1, True)):
    write_step(sys.argv[1], step, build_step_batches(rollouts, step, 2, 8, 1.0, 0, prefix_merge=merge))
assert "torch" not in sys.modules, "the orchestrator's batches imported torch"
"""


@pytest.mark.slow  # a process of its own: the test process has torch
def test_the_orchestrator_writes_batches_without_torch_and_the_trainer_reads_them_as_tensors(tmp_path):
    """The orchestrator process never imports torch (~2 s of CPU and ~460 MB at each start): it builds its batches
    as numpy arrays and writes them; the trainer reads the same values as torch tensors, in the wire dtypes."""
    proc = subprocess.run([sys.executable, "-c", NO_TORCH_WRITER, str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rollouts = [
        Rollout(g, [1, 2, 3, 4], [10 + g, 11, 12 + k], [-0.5, -0.25, -0.125], [0, 0, 1], "x", "stop", float(k))
        for g in range(3)
        for k in range(2)
    ]
    for step, merge in ((0, False), (1, True)):
        built = build_step_batches(rollouts, step, 2, 8, 1.0, 0, prefix_merge=merge)
        for rank, want in enumerate(built):
            got = read_step(rollout_rank_file(tmp_path, step, rank))
            assert len(got.micro_batches) == len(want.micro_batches) and got.micro_batches
            for g, w in zip(got.micro_batches, want.micro_batches):
                assert isinstance(g.input_ids, torch.Tensor) and g.merged == merge
                for f in dataclasses.fields(w):
                    a, b = getattr(g, f.name), getattr(w, f.name)
                    assert (a is None) == (b is None), f.name
                    if b is not None:
                        assert str(a.dtype).removeprefix("torch.") == DTYPES.get(f.name, str(b.dtype)), f.name
                        assert np.array_equal(a.numpy(), b), f.name
