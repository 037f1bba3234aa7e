"""Rollout files and weight broadcasts: atomic visibility, round trips, retention."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from arbor.models.attention import position_ids_for
from arbor.run_dir import STABLE, latest_published, poll_interval, published_steps
from arbor.run_dir import rollout_rank_file as rank_file
from arbor.transport.batch import MicroBatch, StepBatch
from arbor.transport.files import read_step, wait_for_step, write_step
from arbor.weights.transport import publish_weights


def _batch(step: int, n_tokens: int, fill: int) -> StepBatch:
    lens = [n_tokens // 2, n_tokens - n_tokens // 2]
    mb = MicroBatch(
        input_ids=torch.full((n_tokens,), fill, dtype=torch.long),
        position_ids=position_ids_for(lens)[0],
        loss_mask=torch.ones(n_tokens, dtype=torch.bool),
        advantages=torch.full((n_tokens,), float(fill)),
        inference_logprobs=torch.full((n_tokens,), -1.0),
        policy_versions=torch.full((n_tokens,), step, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
    )
    return StepBatch(
        step=step, micro_batches=[mb, mb], loss_tokens_total=2 * n_tokens, num_samples_total=4, temperature=0.7
    )


def test_step_batch_roundtrip(tmp_path):
    write_step(tmp_path, 3, [_batch(3, 10, 1), _batch(3, 12, 2)])
    back = read_step(rank_file(tmp_path, 3, 1))
    assert back.step == 3 and back.temperature == 0.7 and back.loss_tokens_total == 24
    assert len(back.micro_batches) == 2 and back.micro_batches[0].input_ids.tolist() == [2] * 12
    assert back.micro_batches[0].loss_mask.dtype == torch.bool
    assert wait_for_step(tmp_path, 3, 0, timeout=1).micro_batches[0].num_tokens == 10


def test_micro_batch_rejects_ragged_fields():
    with pytest.raises(ValueError, match="advantages"):
        MicroBatch(
            input_ids=torch.zeros(4, dtype=torch.long),
            position_ids=torch.arange(4),
            loss_mask=torch.ones(4, dtype=torch.bool),
            advantages=torch.zeros(3),
            inference_logprobs=torch.zeros(4),
            policy_versions=torch.zeros(4, dtype=torch.int32),
            seq_lens=torch.tensor([4], dtype=torch.int32),
        )


def _writer(out: str, rounds: int) -> None:
    for i in range(rounds):
        write_step(out, 0, [_batch(0, 200_000 + i, i % 7)])


@pytest.mark.slow
def test_reader_never_sees_a_partial_file(tmp_path):
    """A writer rewrites a ~5 MB rank file over and over; every read that finds the file gets a whole batch."""
    proc = mp.get_context("spawn").Process(target=_writer, args=(str(tmp_path), 15))
    proc.start()
    path, reads = rank_file(tmp_path, 0, 0), 0
    deadline = time.monotonic() + 60
    while proc.is_alive() and time.monotonic() < deadline:
        if path.exists():
            batch = read_step(path)  # raises on a truncated or half-written safetensors file
            mb = batch.micro_batches[0]
            assert mb.num_tokens >= 200_000 and int(mb.seq_lens.sum()) == mb.num_tokens
            reads += 1
    proc.join()
    assert proc.exitcode == 0 and reads > 0
    assert not [p for p in path.parent.iterdir() if p.name != path.name]  # no temporary file left behind


def test_wait_for_step_times_out_naming_the_file(tmp_path):
    with pytest.raises(TimeoutError, match="rank_1.safetensors"):
        wait_for_step(tmp_path, 5, 1, timeout=0.2)


def test_publish_weights_is_atomic_and_pruned(tmp_path):
    from arbor.config.model import ModelConfig
    from arbor.models import build_model

    model = build_model(ModelConfig(name="qwen3-test"))
    for step in range(1, 5):
        publish_weights(tmp_path, step, model.state_dict(), model.args, keep=2)
    assert published_steps(tmp_path) == [3, 4] and latest_published(tmp_path) == 4
    assert (tmp_path / "broadcasts" / "step_4" / STABLE).exists()
    (tmp_path / "broadcasts" / "step_9").mkdir()  # a directory without STABLE is invisible
    assert latest_published(tmp_path) == 4


class FakeClock:
    """`time.monotonic` and `time.sleep` for arbor.transport.files: sleeping advances the clock, and a callback
    runs at a given time (a writer that finishes then)."""

    def __init__(self, at: float, action) -> None:
        self.now, self.at, self.action, self.sleeps = 100.0, 100.0 + at, action, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        before, self.now = self.now, self.now + seconds
        if before < self.at <= self.now:
            self.action()


@pytest.mark.parametrize("appears_after", [0.003, 0.12, 0.4, 5.0])
def test_wait_for_step_notices_a_file_within_a_tenth_of_the_wait(tmp_path, monkeypatch, appears_after):
    """The handoff's poll grows with the wait (arbor.run_dir.poll_interval): a rollout file is seen at most ~10% of
    the wait (at least 2 ms) after it appears, and past its first half second a wait looks 20 times a second."""
    clock = FakeClock(appears_after, lambda: write_step(tmp_path, 2, [_batch(2, 8, 1)]))
    monkeypatch.setattr("arbor.transport.files.time", clock)
    batch = wait_for_step(tmp_path, 2, 0, timeout=60)
    assert batch.step == 2
    waited = clock.now - 100.0
    assert appears_after <= waited <= max(appears_after * 1.1, appears_after + 0.002) + 1e-9
    assert min(clock.sleeps) >= 0.002 and max(clock.sleeps) <= 0.05
    if appears_after >= 5:
        assert clock.sleeps[-1] == 0.05 and len(clock.sleeps) <= 20 * appears_after + 40  # ~35 looks ramping up


def test_poll_interval_is_a_tenth_of_the_wait_within_bounds():
    assert poll_interval(0.0) == 0.002
    assert poll_interval(0.2) == pytest.approx(0.02)
    assert poll_interval(3600.0) == 0.05
    assert all(poll_interval(w) <= poll_interval(w + 0.01) for w in [i / 100 for i in range(100)])
