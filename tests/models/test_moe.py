"""Qwen3-MoE model: Hugging Face parity, checkpoint round trip, router replay, grouped matmul, aux loss."""

from __future__ import annotations

import pytest
import torch

from arbor.config.model import ModelConfig
from arbor.models import build_model
from arbor.models.attention import packed_causal_mask, position_ids_for
from arbor.models.dsa import index_scores
from arbor.models.hf import save_checkpoint_dir
from arbor.models.qwen3_moe import Qwen3MoeForCausalLM, grouped_mm
from arbor.models.tokenizer import ByteTokenizer


@pytest.mark.parametrize("norm_topk", [True, False])
def test_hf_moe_checkpoint_logits_match_transformers(tmp_path, norm_topk):
    from transformers import Qwen3MoeConfig
    from transformers import Qwen3MoeForCausalLM as HF

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk,
        mlp_only_layers=[1],
        max_position_embeddings=128,
        rope_theta=10000.0,
    )
    hf = HF(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.05)  # transformers leaves 3-D expert weights and the router at zero/empty
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    model = build_model(ModelConfig(name=str(tmp_path))).eval()
    assert isinstance(model, Qwen3MoeForCausalLM) and model.args.moe_layers == [0, 2]
    x = torch.randint(0, 300, (2, 17))
    with torch.no_grad():
        ours = model(x)
        theirs = hf(x).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert model.last_routed_experts.shape == (2, 17, 2, 2)

    # Saving writes per-expert tensors that load back identically (what the trainer publishes to inference).
    out = tmp_path / "again"
    save_checkpoint_dir(model.state_dict(), model.args, out, ByteTokenizer())
    again = build_model(ModelConfig(name=str(out)))
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    assert HF.from_pretrained(str(out)).config.num_experts == 6


def test_router_replay_uses_given_experts_and_gathers_their_scores():
    model = build_model(ModelConfig(name="qwen3-moe-test")).eval()
    x = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        free = model(x)
        chosen = model.last_routed_experts.clone()
        replayed = model(x, routed_experts=chosen)
        assert torch.equal(model.last_routed_experts, chosen)
        assert torch.allclose(free, replayed, atol=1e-6)
        forced = (chosen + 1) % model.args.num_experts  # other experts: different output, recorded as used
        other = model(x, routed_experts=forced)
        assert torch.equal(model.last_routed_experts, forced)
        assert not torch.allclose(free, other, atol=1e-4)
    with pytest.raises(ValueError, match="routed_experts has shape"):
        model(x, routed_experts=chosen[:, :5])


def test_router_logits_are_fp32_in_a_bf16_model():
    """Trainer and engine share this router: its logits are computed in fp32 from the bf16 weights and inputs, so
    near-tied experts are ranked identically on both sides; the mixing weights come back in the compute dtype."""
    model = build_model(ModelConfig(name="qwen3-moe-test")).to(torch.bfloat16)
    gate = model.model.layers[0].mlp.gate
    x = torch.randn(7, model.args.hidden_size, dtype=torch.bfloat16)
    logits, weights, _ = gate(x)
    assert logits.dtype == torch.float32 and weights.dtype == torch.bfloat16
    assert torch.equal(logits, x.float() @ gate.weight.float().T)


def test_routers_and_the_dsa_indexer_stay_fp32_under_a_bf16_autocast():
    """The SFT warm-up and a one-rank trainer run bf16 as an autocast over fp32 weights, which would round any
    matmul to bf16, `.float()` inputs or not: the softmax router, the sigmoid router and DSA's indexer each turn
    it off, so they score in fp32 as the engine does with bf16 weights (before, all three ran in bf16 there)."""
    torch.manual_seed(0)
    qwen = build_model(ModelConfig(name="qwen3-moe-test")).model.layers[0].mlp.gate
    deepseek = build_model(ModelConfig(name="dsa-moe-test")).model.layers[1].mlp.gate
    x = torch.randn(9, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = qwen(x)[0]
        ds_weights = deepseek(x)[0]
        q, w, k = torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2), torch.randn(1, 5, 8)
        score = index_scores(q, w, k, torch.ones(1, 5, 5, dtype=torch.bool))
    assert logits.dtype == torch.float32 and torch.equal(logits, x @ qwen.weight.T)
    assert torch.equal(ds_weights, deepseek(x)[0])
    assert score.dtype == torch.float32
    assert torch.equal(score, index_scores(q, w, k, torch.ones(1, 5, 5, dtype=torch.bool)))


def test_moe_packed_forward_equals_separate_and_kv_cache_decoding():
    model = build_model(ModelConfig(name="qwen3-moe-test")).eval()
    seqs = [torch.randint(0, 256, (n,)) for n in (5, 9, 3)]
    lens = [len(s) for s in seqs]
    with torch.no_grad():
        packed = model(torch.cat(seqs)[None], position_ids_for(lens), packed_causal_mask(lens))[0]
        alone = torch.cat([model(s[None])[0] for s in seqs])
        assert (packed - alone).abs().max().item() < 1e-5
        ids = torch.randint(0, 256, (1, 12))
        cache = model.make_kv_cache(num_slots=2, max_len=32)
        full = model(ids)[0]
        pre = model(ids[:, :8], torch.arange(8)[None], kv_cache=cache, cache_slots=torch.tensor([1]))[0]
        step = model(ids[:, 8:9], torch.tensor([[8]]), kv_cache=cache, cache_slots=torch.tensor([1]))[0, 0]
    assert (pre - full[:8]).abs().max() < 1e-5 and (step - full[8]).abs().max() < 1e-5


def test_grouped_mm_fallback_matches_per_group_matmul():
    torch.manual_seed(0)
    w = torch.randn(4, 6, 5)
    counts = torch.tensor([3, 0, 2, 4])
    x = torch.randn(int(counts.sum()), 5)
    ref = torch.cat([x[s : s + n] @ w[e].T for e, (s, n) in enumerate(zip([0, 3, 3, 5], counts.tolist()))])
    assert torch.allclose(grouped_mm(x, w, counts), ref, atol=1e-6)


@pytest.mark.gpu(reason="torch's grouped_mm CUDA kernel")
def test_grouped_mm_cuda_kernel_matches_fallback():
    torch.manual_seed(0)
    w = torch.randn(4, 64, 32, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([16, 0, 32, 48], device="cuda")
    x = torch.randn(96, 32, device="cuda", dtype=torch.bfloat16)
    ref = grouped_mm(x.float().cpu(), w.float().cpu(), counts.cpu())
    assert torch.allclose(grouped_mm(x, w, counts).float().cpu(), ref, atol=5e-2, rtol=2e-2)


def test_aux_loss_matches_transformers_and_has_gradient():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = build_model(ModelConfig(name="qwen3-moe-test")).train()
    x = torch.randint(0, 256, (1, 16))
    model(x)
    assert model.aux_loss is not None
    # Recompute router logits per MoE layer to compare with transformers' formula.
    logits = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: logits.append(o[0])) for layer in model.model.layers]
    model(x)
    for h in hooks:
        h.remove()
    ref = load_balancing_loss_func(tuple(logits), model.args.num_experts, model.args.num_experts_per_tok)
    assert model.aux_loss.item() == pytest.approx(model.args.router_aux_loss_coef * ref.item(), rel=1e-5)
    model.aux_loss.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
