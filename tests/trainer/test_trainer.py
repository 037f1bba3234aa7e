"""Trainer tests: losses, shifted packed logprobs, the trainer process end to end, checkpoint resume, SFT.

The 2-rank FSDP2 equivalence test lives in test_trainer_dist.py. Everything uses the tiny qwen3-test preset.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from arbor.config.model import ModelConfig
from arbor.config.trainer import LossConfig
from arbor.models import build_model
from arbor.models.attention import position_ids_for
from arbor.models.hf import load_weights, read_safetensors_dir
from arbor.run_dir import DONE, STABLE, broadcast_dir, checkpoint_dir, latest_checkpoint, prune_checkpoints
from arbor.trainer.loss import LossFn, LossOutput, is_mask, ppo_clip, resolve_loss
from arbor.trainer.main import main as trainer_main
from arbor.trainer.step import packed_logprobs
from arbor.transport.batch import MicroBatch, StepBatch
from arbor.transport.files import write_step

TEST_MODEL = ModelConfig(name="qwen3-test")
ROW_LEN = 24
# Per step: four packed rows of samples (lengths); the first 3 tokens of each sample are its prompt.
LAYOUT = [[10, 12], [8, 9, 5], [14, 6], [7, 7, 7]]


# --- synthetic rollouts, shared with test_trainer_dist.py --------------------------------------------------------


def make_micro_batch(
    model: torch.nn.Module, gen: torch.Generator, lens: list[int], row_len: int = ROW_LEN
) -> MicroBatch:
    """A packed row whose inference logprobs are the initial model's own, slightly perturbed (ratios near 1)."""
    ids = torch.randint(0, 256, (row_len,), generator=gen)
    mask = torch.zeros(row_len, dtype=torch.bool)
    adv = torch.zeros(row_len)
    versions = torch.full((row_len,), -1, dtype=torch.int32)
    off = 0
    for n in lens:
        mask[off + 3 : off + n] = True
        adv[off : off + n] = torch.randn((), generator=gen)
        versions[off + 3 : off + n] = 0
        off += n
    positions = position_ids_for(lens, row_len)[0]
    with torch.no_grad():
        lp, _ = packed_logprobs(model, ids, positions, lens, 1.0, torch.device("cpu"), False)
    lp = lp + 0.05 * torch.randn(row_len, generator=gen)
    return MicroBatch(ids, positions, mask, adv, lp, versions, torch.tensor(lens, dtype=torch.int32))


def write_rollouts(dirs_by_world: dict[int, Path], steps: int, seed: int = 0) -> None:
    """Writes the same rollouts for each world size: rank r of world w gets micro-batches r*k .. (r+1)*k - 1."""
    model = build_model(TEST_MODEL)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        mbs = [make_micro_batch(model, gen, lens) for lens in LAYOUT]
        total = sum(int(m.loss_mask.sum()) for m in mbs)
        samples = sum(len(lens) for lens in LAYOUT)
        for world, out in dirs_by_world.items():
            k = len(mbs) // world
            write_step(
                out, step, [StepBatch(step, mbs[r * k : (r + 1) * k], total, samples, 1.0) for r in range(world)]
            )


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics" / "trainer.jsonl").read_text().splitlines()]


def trainer_args(output_dir: Path, max_steps: int, *extra: str) -> list[str]:
    return [
        "--output-dir",
        str(output_dir),
        "--max-steps",
        str(max_steps),
        "--model.name",
        "qwen3-test",
        "--optim.lr",
        "1e-3",
        "--num-threads",
        "1",
        *extra,
    ]


# --- losses -------------------------------------------------------------------------------------------------------


def _loss_inputs():
    ratios = torch.tensor([1.0, 1.5, 0.5, 1.2, 3.0])
    logprobs = torch.log(ratios).requires_grad_(True)
    return (
        logprobs,
        torch.zeros(5),
        torch.tensor([1.0, 1.0, -1.0, 2.0, 1.0]),
        torch.tensor([1, 1, 1, 1, 0], dtype=torch.bool),
    )


def test_ppo_clip_matches_hand_computation():
    lp, inf, adv, mask = _loss_inputs()
    out = ppo_clip(lp, inf, adv, mask, LossConfig(clip_low=0.2, clip_high=0.28))
    # token 0: r=1 -> -1; token 1: r=1.5 clipped to 1.28 -> -1.28; token 2: A<0, r=0.5 clipped to 0.8 -> +0.8;
    # token 3: r=1.2 inside -> -2.4; token 4: masked.
    assert out.loss_sum.item() == pytest.approx(-1.0 - 1.28 + 0.8 - 2.4, abs=1e-6)
    assert out.metrics["clip_frac"].item() == 2
    assert out.metrics["ratio_sum"].item() == pytest.approx(1.0 + 1.5 + 0.5 + 1.2, abs=1e-6)
    assert out.metrics["ratio_max"].item() == pytest.approx(1.5)
    assert out.metrics["ratio_min"].item() == pytest.approx(0.5)
    out.loss_sum.backward()
    # d(-r*A)/d logprob = -r*A where unclipped; clipped and masked tokens pass no gradient.
    assert torch.allclose(lp.grad, torch.tensor([-1.0, 0.0, 0.0, -2.4, 0.0]), atol=1e-6)


def test_is_mask_matches_hand_computation():
    lp, inf, adv, mask = _loss_inputs()
    out = is_mask(lp, inf, adv, mask, LossConfig(clip_low=0.2, clip_high=0.28))
    # Tokens 1 (r=1.5) and 2 (r=0.5) fall outside [0.8, 1.28] and are dropped, whatever the advantage's sign.
    assert out.loss_sum.item() == pytest.approx(-1.0 - 2.4, abs=1e-6)
    assert out.metrics["masked_frac"].item() == 2
    out.loss_sum.backward()
    assert torch.allclose(lp.grad, torch.tensor([-1.0, 0.0, 0.0, -2.4, 0.0]), atol=1e-6)


USER_LOSS_CALLS: list[int] = []


def half_ppo(logprobs, inference_logprobs, advantages, loss_mask, cfg: LossConfig) -> LossOutput:
    """A user loss for the tests: half the PPO clip loss, with a marker metric."""
    USER_LOSS_CALLS.append(int(loss_mask.sum()))
    out = ppo_clip(logprobs, inference_logprobs, advantages, loss_mask, cfg)
    return LossOutput(0.5 * out.loss_sum, {"user_tokens": loss_mask.sum().float()})


def not_a_loss(x):
    return x


def test_resolve_loss_builtins_dotted_path_and_errors():
    assert resolve_loss("ppo_clip") is ppo_clip and resolve_loss("is_mask") is is_mask
    user = resolve_loss("test_trainer:half_ppo")
    assert isinstance(user, LossFn)
    lp, inf, adv, mask = _loss_inputs()
    assert user(lp, inf, adv, mask, LossConfig()).loss_sum.item() == pytest.approx(
        0.5 * ppo_clip(lp, inf, adv, mask, LossConfig()).loss_sum.item()
    )
    with pytest.raises(ValueError, match="unknown loss"):
        resolve_loss("ppo")
    with pytest.raises(TypeError, match="must accept"):
        resolve_loss("test_trainer:not_a_loss")


# --- logprobs -----------------------------------------------------------------------------------------------------


def test_packed_logprobs_equal_unpacked_forward():
    model = build_model(TEST_MODEL)
    gen = torch.Generator().manual_seed(1)
    lens = [7, 11, 5]
    samples = [torch.randint(0, 256, (n,), generator=gen) for n in lens]
    row = torch.cat(samples + [torch.zeros(3, dtype=torch.long)])  # 3 padding tokens
    temperature = 0.7
    with torch.no_grad():
        packed, _ = packed_logprobs(
            model, row, position_ids_for(lens, len(row))[0], lens, temperature, torch.device("cpu")
        )
        off = 0
        for ids in samples:
            logits = model(ids[None])[0].float() / temperature  # plain causal attention, positions from 0
            ref = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None]).squeeze(-1)
            assert torch.allclose(packed[off + 1 : off + len(ids)], ref, atol=1e-6), "packed logprobs differ"
            off += len(ids)


# --- the trainer process ------------------------------------------------------------------------------------------


def test_trainer_process_with_user_loss(tmp_path: Path):
    write_rollouts({1: tmp_path}, steps=2)
    USER_LOSS_CALLS.clear()
    rc = trainer_main(trainer_args(tmp_path, 2, "--loss.name", "test_trainer:half_ppo", "--ckpt.interval", "5"))
    assert rc == 0
    assert len(USER_LOSS_CALLS) == 2 * len(LAYOUT)  # the loop called the user's loss for every micro-batch
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["tokens/s"] > 0
        assert r["mismatch_kl"] > 0 and r["entropy"] > 0
        assert r["loss/user_tokens"] == pytest.approx(1.0)  # a sum metric, divided by the loss tokens
        assert r["num_tokens"] == sum(map(sum, LAYOUT))
    assert rows[1]["policy_staleness/mean"] == pytest.approx(1.0)  # step-1 tokens were sampled by version 0
    initial = build_model(TEST_MODEL).state_dict()
    for version in (1, 2):
        d = broadcast_dir(tmp_path, version)
        assert (d / STABLE).exists()
        model = build_model(TEST_MODEL)
        load_weights(model, d)
        assert not torch.equal(
            model.state_dict()["model.layers.0.mlp.up_proj.weight"], initial["model.layers.0.mlp.up_proj.weight"]
        )
    assert latest_checkpoint(tmp_path) == 2  # the last step is always checkpointed


@pytest.mark.slow
def test_resume_from_checkpoint_matches_uninterrupted_run(tmp_path: Path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    write_rollouts({1: full}, steps=3)
    write_rollouts({1: cut}, steps=3)
    assert trainer_main(trainer_args(full, 3, "--ckpt.interval", "2")) == 0
    assert trainer_main(trainer_args(cut, 2, "--ckpt.interval", "2")) == 0  # "killed" after step 2's checkpoint
    (cut / "broadcasts" / "step_2" / STABLE).unlink()  # the resumed run must republish version 2
    assert trainer_main(trainer_args(cut, 3, "--ckpt.interval", "2", "--resume")) == 0
    assert (broadcast_dir(cut, 2) / STABLE).exists()
    assert [r["step"] for r in read_metrics(cut)] == [0, 1, 2]
    a, b = read_safetensors_dir(broadcast_dir(full, 3)), read_safetensors_dir(broadcast_dir(cut, 3))
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-7, rtol=0), name
    assert read_metrics(full)[2]["loss"] == pytest.approx(read_metrics(cut)[2]["loss"], abs=1e-7)


def test_checkpoint_pruning_leaves_orchestrator_state(tmp_path: Path):
    for step in (1, 2, 3, 4):
        d = checkpoint_dir(tmp_path, step)
        d.mkdir(parents=True)
        if step != 3:
            (d / DONE).write_text(str(step))
        if step == 1:
            (d.parent / "orchestrator.json").write_text("{}")
    assert latest_checkpoint(tmp_path) == 4
    prune_checkpoints(tmp_path, keep=1)
    assert not checkpoint_dir(tmp_path, 1).exists() and (tmp_path / "checkpoints/step_1/orchestrator.json").exists()
    assert not (tmp_path / "checkpoints/step_2").exists() and not (tmp_path / "checkpoints/step_3").exists()
    assert latest_checkpoint(tmp_path) == 4 and latest_checkpoint(tmp_path / "nowhere") is None


def test_checkpoint_seconds_are_reported_once_with_the_step_after_the_save(tmp_path: Path):
    write_rollouts({1: tmp_path}, steps=4)
    assert trainer_main(trainer_args(tmp_path, 4, "--ckpt.interval", "2")) == 0
    seconds = [r["time/checkpoint"] for r in read_metrics(tmp_path)]
    assert seconds[0] == 0 and seconds[1] == 0 and seconds[2] > 0 and seconds[3] == 0  # saved after steps 1 and 3


def test_bad_loss_name_fails_fast(tmp_path: Path, capsys):
    assert trainer_main(trainer_args(tmp_path, 1, "--loss.name", "ppo")) == 2
    assert "loss.name: unknown loss 'ppo'" in capsys.readouterr().err


# --- SFT ----------------------------------------------------------------------------------------------------------


def test_sft_on_reverse_text_lowers_loss_and_writes_loadable_dir(tmp_path: Path):
    from arbor.trainer.sft import main as sft_main

    args = [
        "--output-dir",
        str(tmp_path),
        "--model.name",
        "qwen3-test",
        "--steps",
        "30",
        "--batch-size",
        "8",
        "--lr",
        "3e-3",
        "--num-threads",
        "1",
        "--environment.args",
        "{num_tasks = 200}",
    ]
    assert sft_main(args) == 0
    lines = [json.loads(x) for x in (tmp_path / "metrics" / "sft.jsonl").read_text().splitlines()]
    windows = [x["sft/loss"] for x in lines if "step" in x]
    assert len(windows) == 3 and lines[-1]["sft/steps"] == 30
    assert windows[0] > 5.0 > windows[-1] + 0.5, windows  # starts near ln(264) = 5.58 and drops
    model = build_model(ModelConfig(name=str(tmp_path / "sft")))  # reloads as a checkpoint directory
    ref = read_safetensors_dir(tmp_path / "sft")
    assert torch.equal(model.state_dict()["model.norm.weight"], ref["model.norm.weight"])
    assert (tmp_path / "sft" / "arbor_tokenizer.json").exists()


def test_missing_rollouts_time_out_naming_the_file(tmp_path: Path):
    with pytest.raises(TimeoutError, match="rollouts/step_0/rank_0.safetensors"):
        trainer_main(trainer_args(tmp_path, 1, "--rollout-timeout", "0.2"))
    import torch.distributed as dist

    assert not dist.is_initialized()  # torn down, so the same process can start a trainer again
