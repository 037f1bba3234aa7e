"""Vocabulary-chunked logprobs (arbor.trainer.logprobs) against the full-logits reference `shifted_logprobs`:
values, entropy and the gradients of the hidden states and of the head weight, in fp64 and fp32, for several
chunk sizes (some not dividing the tokens), temperatures, masks, prefix-tree merged rows and whole models
(dense, MoE, tied embeddings); that no `[T, V]` tensor is kept for backward; and the config key."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from arbor.config.loader import ConfigError, load_config
from arbor.config.model import ModelConfig
from arbor.config.rl import RLConfig
from arbor.models import build_model
from arbor.models.attention import packed_causal_mask, position_ids_for
from arbor.trainer.logprobs import CHUNK_BYTES, default_chunk, shifted_chunked_logprobs
from arbor.trainer.parallel_state import ParallelState
from arbor.trainer.step import packed_logprobs, shifted_logprobs, unmerged_logprobs

T, H, V = 37, 24, 101
TOL = {torch.float64: 1e-6, torch.float32: 1e-6}


def _inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states and a head scaled like a trained model's (logits of order 1-10)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.5).to(dtype).requires_grad_()
    ids = torch.randint(0, V, (T,), generator=gen)
    return hidden, weight, ids


def _close(a: torch.Tensor, b: torch.Tensor, tol: float, what: str) -> None:
    """Within `tol` of the reference's scale: fp32 sums taken in another order (a chunk's matmul is blocked
    differently from the whole one's) differ by a few ulps of the largest term."""
    scale = max(1.0, float(b.detach().abs().max())) if b.numel() else 1.0
    torch.testing.assert_close(a, b, rtol=0, atol=tol * scale, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 4, 7, T - 1, 64])
@pytest.mark.parametrize("temperature", [0.7, 0.0])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_values_and_gradients_equal_the_full_logits_path(dtype, chunk, temperature, with_entropy):
    hidden, weight, ids = _inputs(dtype)
    gen = torch.Generator().manual_seed(1)
    mask = torch.rand(T, generator=gen) < 0.6  # a loss mask: padding and prompt tokens get no gradient
    upstream = torch.randn(T, generator=gen, dtype=torch.float32) * mask

    ref, ref_ent = shifted_logprobs(F.linear(hidden, weight), ids, temperature, with_entropy)
    ref_gh, ref_gw = torch.autograd.grad((ref * upstream).sum(), (hidden, weight))
    lp, ent = shifted_chunked_logprobs(hidden, weight, ids, temperature, with_entropy, chunk)
    gh, gw = torch.autograd.grad((lp * upstream).sum(), (hidden, weight))

    assert lp.dtype == ref.dtype == torch.float32 and gh.dtype == gw.dtype == dtype
    _close(lp, ref, TOL[dtype], "logprobs")
    assert lp[0] == 0
    _close(gh, ref_gh, TOL[dtype], "hidden gradient")
    _close(gw, ref_gw, TOL[dtype], "weight gradient")
    predicts_masked = torch.cat([mask[1:], torch.tensor([False])])  # row t predicts token t + 1
    assert (gh[~predicts_masked] == 0).all()  # rows predicting tokens outside the loss mask get nothing
    if with_entropy:
        assert not ent.requires_grad
        _close(ent, ref_ent, TOL[dtype], "entropy")
    else:
        assert ent is None and ref_ent is None


def test_pairs_read_shared_rows_like_the_full_logits():
    """Prefix-tree merged rows: several sample tokens predicted by one node (and tokens with no predictor)."""
    hidden, weight, ids = _inputs(torch.float64, seed=3)
    gen = torch.Generator().manual_seed(4)
    K = 60
    token_nodes = torch.randint(0, T, (K,), generator=gen)
    predictors = torch.randint(-1, T, (K,), generator=gen)
    upstream = torch.randn(K, generator=gen)

    logp = torch.log_softmax(F.linear(hidden, weight).float() / 1.3, dim=-1)
    has = predictors >= 0
    src = predictors.clamp(min=0)
    ref = torch.where(has, logp[src, ids[token_nodes]], torch.zeros(K))
    ref_ent = torch.where(has, -(logp.exp() * logp).sum(-1)[src], torch.zeros(K)).detach()
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (hidden, weight))
    for chunk in (3, 10, 100):
        lp, ent = unmerged_logprobs(hidden, weight, ids, token_nodes, predictors, 1.3, True, chunk)
        grads = torch.autograd.grad((lp * upstream).sum(), (hidden, weight))
        _close(lp, ref, 1e-6, f"logprobs (chunk {chunk})")
        _close(ent, ref_ent, 1e-6, f"entropy (chunk {chunk})")
        for g, r, name in zip(grads, ref_grads, ("hidden", "weight")):
            _close(g, r, 1e-6, f"{name} gradient (chunk {chunk})")


def test_only_one_input_needing_a_gradient():
    hidden, weight, ids = _inputs(torch.float64)
    frozen = weight.detach()
    lp, _ = shifted_chunked_logprobs(hidden, frozen, ids, 1.0, False, 5)
    (gh,) = torch.autograd.grad(lp.sum(), (hidden,))
    ref, _ = shifted_logprobs(F.linear(hidden, frozen), ids, 1.0, False)
    _close(gh, torch.autograd.grad(ref.sum(), (hidden,))[0], 1e-6, "hidden gradient, frozen head")
    with torch.no_grad():
        lp, ent = shifted_chunked_logprobs(hidden, weight, ids, 1.0, True, 5)
    assert not lp.requires_grad and ent.shape == (T,)


def test_autocast_runs_the_head_in_the_autocast_dtype_like_nn_linear():
    hidden, weight, ids = _inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, _ = shifted_logprobs(F.linear(hidden, weight), ids, 0.9, False)
        lp, _ = shifted_chunked_logprobs(hidden, weight, ids, 0.9, False, 6)
    ref_g = torch.autograd.grad(ref.sum(), (hidden, weight))
    g = torch.autograd.grad(lp.sum(), (hidden, weight))
    _close(lp, ref, 1e-6, "bf16 logprobs")  # same bf16 logits per row, then the same fp32 arithmetic
    for a, b, name in zip(g, ref_g, ("hidden", "weight")):
        assert a.dtype == torch.float32
        _close(a, b, 2e-2, f"bf16 {name} gradient")  # bf16 products summed in another order


def test_no_tensor_of_the_whole_vocabulary_is_kept_for_backward():
    hidden, weight, ids = _inputs(torch.float32)
    saved: list[torch.Size] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        shifted_chunked_logprobs(hidden, weight, ids, 0.7, True, 8)
    assert saved and all(s.numel() < (T - 1) * V for s in saved), saved
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        shifted_logprobs(F.linear(hidden, weight), ids, 0.7, True)
    assert any(s.numel() >= (T - 1) * V for s in saved)  # the reference keeps its log_softmax


@pytest.mark.parametrize("preset", ["qwen3-test", "qwen3-moe-test", "dsa-test"])
def test_model_gradients_equal_the_full_logits_path(preset):
    """The trainer's path (the forward's head_fn) against logits from the plain forward, every parameter's
    gradient: dense, MoE (its load-balancing loss included) and DSA with tied embeddings."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(name=preset))
    model.train()
    lens = [9, 12, 6]
    ids = torch.randint(0, 256, (sum(lens),))
    pos = position_ids_for(lens, len(ids))[0]
    upstream = torch.randn(len(ids))

    def grads(loss: torch.Tensor) -> dict[str, torch.Tensor]:
        aux = getattr(model, "aux_loss", None)
        total = loss + (aux if aux is not None else 0)
        return dict(
            zip(
                [n for n, _ in model.named_parameters()],
                torch.autograd.grad(total, list(model.parameters()), allow_unused=True),
            )
        )

    lp, ent = packed_logprobs(model, ids, pos, lens, 0.8, torch.device("cpu"), state=ParallelState(logprob_chunk=5))
    got = grads((lp * upstream).sum())
    logits = model(ids[None], pos[None], packed_causal_mask(torch.tensor(lens), len(ids)))[0]
    ref, ref_ent = shifted_logprobs(logits, ids, 0.8)
    want = grads((ref * upstream).sum())
    _close(lp, ref, 1e-6, "logprobs")
    _close(ent, ref_ent, 1e-6, "entropy")
    for name, g in want.items():
        if g is not None:
            _close(got[name], g, 1e-6, name)


def test_default_chunk_and_config_key():
    assert default_chunk(151_936) == CHUNK_BYTES // (4 * 151_936) == 441
    assert default_chunk(10**12) == 1
    cfg = load_config(RLConfig, ["--trainer.logprob-chunk-tokens", "512"], env={})
    assert cfg.trainer.logprob_chunk_tokens == 512
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, ["--trainer.logprob-chunk-tokens", "-1"], env={})
    assert "\n" not in str(e.value) and "logprob_chunk_tokens" in str(e.value)


@pytest.mark.gpu(reason="the chunked path's CUDA kernels (fp32 and bf16 matmuls, CUDA memory accounting)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_values_and_gradients_equal_the_full_logits_path(dtype):
    hidden, weight, ids = (t.detach().cuda() for t in _inputs(torch.float32))
    hidden, weight = hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()
    ref, ref_ent = shifted_logprobs(F.linear(hidden, weight), ids, 0.7)
    ref_g = torch.autograd.grad(ref.sum(), (hidden, weight))
    lp, ent = shifted_chunked_logprobs(hidden, weight, ids, 0.7, True, 7)
    g = torch.autograd.grad(lp.sum(), (hidden, weight))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    _close(lp, ref, tol, "logprobs")
    _close(ent, ref_ent, tol, "entropy")
    for a, b, name in zip(g, ref_g, ("hidden", "weight")):
        _close(a.float(), b.float(), tol, f"{name} gradient")


@pytest.mark.parametrize("top_p", [1.0, 0.8])
@pytest.mark.parametrize("chunk", [4, 64])
def test_soft_capped_logits_values_and_gradients_equal_autograd_through_the_cap(top_p, chunk):
    """Gemma 2's head caps its logits at `softcap * tanh(logits / softcap)` before the temperature: the chunked
    path's values, entropy and exact backward (the chain rule through tanh) equal autograd on the full logits, with
    a cap (5) that the head's logits reach, alone and under a top-p nucleus."""
    hidden, weight, ids = _inputs(torch.float64, seed=5)
    gen = torch.Generator().manual_seed(6)
    upstream = torch.randn(T, generator=gen, dtype=torch.float32)
    logits = F.linear(hidden, weight)
    capped = torch.tanh(logits / 5.0) * 5.0
    assert logits.abs().max() > 5.0  # the cap bites
    ref, ref_ent = shifted_logprobs(capped, ids, 0.7, True, top_p=top_p)
    ref_gh, ref_gw = torch.autograd.grad((ref * upstream).sum(), (hidden, weight))
    lp, ent = shifted_chunked_logprobs(hidden, weight, ids, 0.7, True, chunk, top_p, softcap=5.0)
    gh, gw = torch.autograd.grad((lp * upstream).sum(), (hidden, weight))
    _close(lp, ref, 1e-6, "logprobs")
    _close(ent, ref_ent, 1e-6, "entropy")
    _close(gh, ref_gh, 1e-6, "hidden gradient")
    _close(gw, ref_gw, 1e-6, "weight gradient")
    uncapped, _ = shifted_chunked_logprobs(hidden, weight, ids, 0.7, False, chunk, top_p)
    assert (uncapped - lp).abs().max() > 1e-2  # the cap changes what is scored
