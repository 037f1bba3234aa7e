"""MTP draft modules: the model side (HF layout, initialisation) and their online training in the trainer step
(arbor.trainer.draft): the draft loss falls, and the policy's loss, gradients and update are unchanged by it."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from arbor.config.environment import EnvironmentConfig
from arbor.config.model import ModelConfig
from arbor.config.sft import SFTConfig
from arbor.config.trainer import DraftConfig, LossConfig
from arbor.models import build_model, build_tokenizer, model_args
from arbor.models.attention import position_ids_for, subtree_end_for
from arbor.models.hf import load_weights, read_safetensors_dir, save_checkpoint_dir
from arbor.models.mtp import mtp_from_hf, mtp_to_hf
from arbor.trainer.draft import draft_loss, make_draft_fn, path_steps
from arbor.trainer.loss import ppo_clip
from arbor.trainer.sft import main as sft_main
from arbor.trainer.sft_data import load_examples
from arbor.trainer.sft_train import pack
from arbor.trainer.step import packed_logprobs, train_step
from arbor.transport.batch import MicroBatch, StepBatch

CPU = torch.device("cpu")
MTP = ModelConfig(name="qwen3-test-mtp")


def _batch(model: torch.nn.Module, seed: int = 0, lens=(10, 9, 5), row_len: int = 26) -> StepBatch:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (row_len,), generator=gen)
    mask = torch.zeros(row_len, dtype=torch.bool)
    off = 0
    for n in lens:
        mask[off + 2 : off + n] = True
        off += n
    pos = position_ids_for(list(lens), row_len)[0]
    with torch.no_grad():
        lp, _ = packed_logprobs(model, ids, pos, list(lens), 1.0, CPU, False)
    mb = MicroBatch(
        ids,
        pos,
        mask,
        torch.randn(row_len, generator=gen),
        lp,
        torch.zeros(row_len, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
    )
    return StepBatch(0, [mb], int(mask.sum()), len(lens), 1.0)


def test_mtp_preset_shares_the_decoder_and_round_trips_through_hf_names(tmp_path):
    model, plain = build_model(MTP), build_model(ModelConfig(name="qwen3-test"))
    ids = torch.randint(0, 256, (1, 12))
    assert torch.equal(model(ids), plain(ids))  # the decoder draws the same weights with or without MTP
    assert sum(p.numel() for p in model.parameters()) == model_args(MTP).num_params()
    state = model.state_dict()
    hf = mtp_to_hf(state, 2)
    assert "model.layers.2.eh_proj.weight" in hf and "model.layers.2.self_attn.q_proj.weight" in hf
    assert (
        mtp_from_hf({**hf, "model.layers.2.embed_tokens.weight": hf["model.embed_tokens.weight"]}, 2).keys()
        == state.keys()
    )
    save_checkpoint_dir(state, model.args, tmp_path)
    other = build_model(ModelConfig(name="qwen3-test-mtp", init_seed=5))
    load_weights(other, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(state.values(), other.state_dict().values()))


def test_mtp_starts_from_the_last_layer_when_the_checkpoint_has_none(tmp_path):
    plain = build_model(ModelConfig(name="qwen3-test", init_seed=2))
    save_checkpoint_dir(plain.state_dict(), plain.args, tmp_path)
    model = build_model(MTP)
    load_weights(model, tmp_path)
    last = plain.model.layers[-1].state_dict()
    assert all(torch.equal(v, model.mtp[0].block.state_dict()[k]) for k, v in last.items())
    assert torch.equal(model.model.embed_tokens.weight, plain.model.embed_tokens.weight)


def test_path_steps_follow_samples_and_tree_children():
    end = subtree_end_for([3, 2], 6)  # two samples then one padding token
    assert path_steps(end).tolist() == [True, True, False, True, False, False]
    tree = torch.tensor([4, 3, 3, 4])  # root 0 with children 1 (child 2) and 3
    assert path_steps(tree).tolist() == [True, True, False, False]


def _grads(model, names):
    return {n: p.grad.clone() for n, p in model.named_parameters() if n in names and p.grad is not None}


def test_draft_training_leaves_the_policy_loss_gradients_and_update_unchanged():
    base = build_model(MTP)
    batch = _batch(base)
    cfg = LossConfig()
    runs = {}
    for label, draft in (("with", DraftConfig()), ("without", DraftConfig(enabled=False))):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        figures = train_step(model, opt, batch, ppo_clip, cfg, 0.5, CPU, draft=draft)
        runs[label] = (model, figures)
    (m_with, f_with), (m_without, f_without) = runs["with"], runs["without"]
    for key in ("loss", "grad_norm", "mismatch_kl"):
        assert f_with[key] == f_without[key]
    assert "draft/kl" in f_with and "draft/kl" not in f_without
    for (name, a), b in zip(m_with.named_parameters(), m_without.parameters()):
        if name.startswith("mtp."):
            continue
        assert torch.equal(a, b), name
    changed = [
        n
        for (n, a), b in zip(m_with.named_parameters(), base.parameters())
        if n.startswith("mtp.") and not torch.equal(a, b)
    ]
    assert changed  # the drafts did train
    assert all(
        torch.equal(a, b) for (n, a), b in zip(m_without.named_parameters(), base.parameters()) if n.startswith("mtp.")
    )


def test_draft_gradients_reach_only_the_mtp_modules():
    model = build_model(MTP)
    mb = _batch(model).micro_batches[0]
    model.draft_fn = make_draft_fn(subtree_end_for(mb.seq_lens, 26), 1.0, 8)
    try:
        model(mb.input_ids[None], mb.position_ids[None])
        out = model.draft_out
    finally:
        model.draft_fn = model.draft_out = None
    out.loss.backward()
    touched = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert touched and all(n.startswith("mtp.") for n in touched)
    assert float(out.positions) == sum(n - 2 for n in (10, 9, 5))  # token i + 2 in i's own sample


def test_draft_loss_is_the_top_k_kl_and_falls_with_training():
    model = build_model(ModelConfig(name="qwen3-test-mtp", init_seed=1))
    batch = _batch(model, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = last = None
    for _ in range(30):
        figures = train_step(model, opt, batch, ppo_clip, LossConfig(), 1.0, CPU, draft=DraftConfig(top_k=264))
        first = figures["draft/kl"] if first is None else first
        last = figures["draft/kl"]
    assert last < 0.5 * first
    # with K = V the top-K KL is the full KL(policy || draft) at the counted positions
    mb = batch.micro_batches[0]
    end = subtree_end_for(mb.seq_lens, 26)
    with torch.no_grad():
        model.draft_fn = lambda m, h, ids, rope, pos, mask: (h, rope, pos)  # captures the forward's hidden states
        model(mb.input_ids[None], mb.position_ids[None])
        h, rope, pos = model.draft_out
        model.draft_fn = model.draft_out = None
        out = draft_loss(model, h, mb.input_ids[None], rope, pos, None, end, 1.0, 264, 0)
        policy = torch.log_softmax(model.lm_head(model.model.norm(h))[0], -1)
        nxt = torch.cat([mb.input_ids[1:], mb.input_ids.new_zeros(1)])[None]
        q = torch.log_softmax(
            model.mtp_logits(0, model.mtp[0](h, model.model.embed_tokens(nxt), rope, pos, None, None, None))[0], -1
        )
    valid = path_steps(end) & torch.cat([path_steps(end)[1:], torch.zeros(1, dtype=torch.bool)])
    rows = valid.nonzero().squeeze(1)
    p = policy[rows + 1].exp()
    kl = (p * (policy[rows + 1] - q[rows])).sum(-1)
    assert float(out.kl_sum) == pytest.approx(float(kl.sum()), rel=1e-3)  # the tail outcome holds fp32 rounding


def _draft_kl(model: torch.nn.Module, ids: torch.Tensor, lens: list[int]) -> float:
    """The mean draft KL of `model`'s MTP module to its policy on one packed row."""
    end = subtree_end_for(lens, ids.shape[0])
    with torch.no_grad():
        model.draft_fn = make_draft_fn(end, 1.0, 16)
        packed_logprobs(model, ids, position_ids_for(lens)[0], lens, 1.0, CPU, False)
        out, model.draft_fn, model.draft_out = model.draft_out, None, None
    return float(out.kl_sum / out.positions)


@pytest.mark.slow
def test_sft_warm_up_fits_the_drafts_and_rl_loads_them(tmp_path):
    """The SFT warm-up trains the MTP module towards the policy it fine-tunes and writes it into `sft/`, where RL
    (a model built from that directory) finds it instead of re-initialising it: on the fine-tuned policy its
    draft KL is well below that of the module as built (`--draft.enabled false`, whose policy training is the
    same)."""
    common = [
        "--model.name",
        "qwen3-test-mtp",
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
    losses = {}
    for arm, extra in (("on", []), ("off", ["--draft.enabled", "false"])):
        assert sft_main(["--output-dir", str(tmp_path / arm), *common, *extra]) == 0
        rows = [json.loads(x) for x in (tmp_path / arm / "metrics" / "sft.jsonl").read_text().splitlines()]
        losses[arm] = [x["sft/loss"] for x in rows if "step" in x]
        assert (arm == "on") == any("sft/draft_kl" in x for x in rows)
    assert losses["on"] == losses["off"]  # the drafts' loss never touches the policy
    on = build_model(ModelConfig(name=str(tmp_path / "on" / "sft")))
    saved = mtp_from_hf(read_safetensors_dir(tmp_path / "on" / "sft"), on.args.num_hidden_layers)
    mtp = {k: v for k, v in on.state_dict().items() if k.startswith("mtp.")}
    assert mtp and all(torch.equal(v, saved[k]) for k, v in mtp.items())
    off = build_model(ModelConfig(name=str(tmp_path / "off" / "sft")))
    policy = {k: v for k, v in on.state_dict().items() if not k.startswith("mtp.")}
    assert all(torch.equal(v, off.state_dict()[k]) for k, v in policy.items())
    cfg = SFTConfig(model=ModelConfig(name="qwen3-test-mtp"), environment=EnvironmentConfig(args={"num_tasks": 200}))
    ids, _, lens = pack(load_examples(cfg, build_tokenizer(cfg.model))[:8], 512)[0]  # the data it trained on
    trained, built = _draft_kl(on, ids, lens), _draft_kl(off, ids, lens)
    assert trained < 0.8 * built, (trained, built)  # 0.025 against 0.041 here
