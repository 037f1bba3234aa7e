"""DeepSeek sparse attention (DSA) model: the sparse MLA kernel against dense attention, packed rows, Hugging Face
checkpoint round trips, cached decoding in the inference engine, and DSA context parallelism on 2 gloo ranks
(forward, parameter gradients and top-k selection against one process; the trainer under torchrun)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from checkpoint_reads import recording_safe_open
from safetensors.torch import load_file
from test_parallel import _spawn, assert_close
from test_trainer import read_metrics, write_rollouts
from test_trainer_dist import assert_same_weights, run_torchrun

from arbor.config.model import ModelConfig
from arbor.config.trainer import TrainerConfig
from arbor.inference.engine.core import Engine
from arbor.inference.engine.params import SamplingParams
from arbor.models import build_model, build_tokenizer, hf
from arbor.models.attention import packed_causal_mask, position_ids_for
from arbor.models.dsa import dense_mla, index_scores, select_topk, sparse_mla
from arbor.models.hf import save_checkpoint_dir
from arbor.run_dir import broadcast_dir
from arbor.trainer.main import main as trainer_main
from arbor.trainer.step import packed_logprobs

LENS = [7, 13, 2, 9, 12]  # packed documents of unequal lengths, several longer than the presets' index_topk (8)


def _mla_inputs(gen: torch.Generator, T: int, H: int = 3, Dn: int = 8, Dr: int = 4, Dv: int = 6, R: int = 10):
    q_nope = torch.randn(1, T, H, Dn, generator=gen, requires_grad=True)
    q_pe = torch.randn(1, T, H, Dr, generator=gen, requires_grad=True)
    c_kv = torch.randn(1, T, R, generator=gen, requires_grad=True)
    k_pe = torch.randn(1, T, Dr, generator=gen, requires_grad=True)
    kv_b = torch.randn(H * (Dn + Dv), R, generator=gen, requires_grad=True)
    return q_nope, q_pe, c_kv, k_pe, kv_b, Dv


def test_sparse_mla_over_all_keys_equals_dense_mla():
    """With k covering every visible key, the absorbed sparse kernel is dense MLA (forward and gradients)."""
    gen = torch.Generator().manual_seed(0)
    T = sum(LENS)
    inputs = _mla_inputs(gen, T)
    mask = packed_causal_mask(LENS)[:, 0]
    scores = torch.randn(1, T, T, generator=gen).masked_fill(~mask, float("-inf"))
    idx, valid = select_topk(scores, T)
    out = sparse_mla(*inputs[:5], idx, valid, inputs[5], 0.3)
    ref = dense_mla(*inputs[:5], mask, inputs[5], 0.3)
    assert_close(out, ref.detach(), "sparse vs dense forward")
    g = torch.randn(ref.shape, generator=gen)
    grads = torch.autograd.grad((out * g).sum(), inputs[:5])
    ref_grads = torch.autograd.grad((ref * g).sum(), inputs[:5])
    for a, b, name in zip(grads, ref_grads, ("q_nope", "q_pe", "c_kv", "k_pe", "kv_b")):
        assert_close(a, b, f"grad {name}")


def test_sparse_mla_attends_exactly_the_selected_keys():
    """Top-k of 5: the output equals dense attention under a mask of the selected keys, and every selected key
    is visible (same document, not in the future)."""
    gen = torch.Generator().manual_seed(1)
    T = sum(LENS)
    q_nope, q_pe, c_kv, k_pe, kv_b, Dv = _mla_inputs(gen, T)
    mask = packed_causal_mask(LENS)[:, 0]
    iq, iw, ik = (
        torch.randn(1, T, 2, 6, generator=gen),
        torch.randn(1, T, 2, generator=gen),
        torch.randn(1, T, 6, generator=gen),
    )
    idx, valid = select_topk(index_scores(iq, iw, ik, mask), 5)
    chosen = torch.zeros_like(mask)
    for q in range(T):
        chosen[0, q, idx[0, q][valid[0, q]]] = True
    assert not (chosen & ~mask).any()
    assert torch.equal(chosen.sum(-1), mask.sum(-1).clamp(max=5))  # min(k, visible keys) per query
    out = sparse_mla(q_nope, q_pe, c_kv, k_pe, kv_b, idx, valid, Dv, 0.3)
    assert_close(out, dense_mla(q_nope, q_pe, c_kv, k_pe, kv_b, chosen, Dv, 0.3), "sparse vs masked dense")


def test_query_blocks_do_not_change_the_result(monkeypatch):
    """The indexer, top-k and sparse attention run in blocks of queries; blocks of 5 give the same logits and
    gradients as one block."""
    import arbor.models.dsa as dsa

    model = build_model(ModelConfig(name="dsa-test"))
    model.init_weights(0, std=0.3)
    ids = torch.randint(0, 256, (1, sum(LENS)), generator=torch.Generator().manual_seed(9))
    args = (ids, position_ids_for(LENS), packed_causal_mask(LENS))
    ref = model(*args)
    ref_grad = torch.autograd.grad(ref.square().mean(), model.lm_head.weight)[0]
    monkeypatch.setattr(dsa, "QUERY_CHUNK", 5)
    out = model(*args)
    assert_close(out, ref.detach(), "blocked logits")
    assert_close(torch.autograd.grad(out.square().mean(), model.lm_head.weight)[0], ref_grad, "blocked grad")


@pytest.mark.parametrize("name", ["dsa-test", "dsa-moe-test"])
def test_packed_row_equals_separate_sequences(name):
    model = build_model(ModelConfig(name=name)).eval()
    model.init_weights(0, std=0.3)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (sum(LENS),), generator=gen)
    with torch.no_grad():
        packed = model(ids[None], position_ids_for(LENS), packed_causal_mask(LENS))[0]
        off = 0
        for n in LENS:
            assert_close(packed[off : off + n], model(ids[None, off : off + n])[0], f"document at {off}")
            off += n


def test_indexer_matters_only_where_a_query_sees_more_than_index_topk_keys():
    """Unless `trainer.indexer.train` trains it, the indexer keeps its loaded weights, so it must not matter where
    selection is dense: documents of at most `index_topk` (8) tokens give the same logits whatever its weights
    (the reverse_text recipes: `seq_len` 64, dsa-tiny's top-64) up to summation order, and longer ones do not."""
    model = build_model(ModelConfig(name="dsa-test")).eval()
    model.init_weights(0, std=0.3)
    gen = torch.Generator().manual_seed(4)
    for lens, dense in (([8, 5, 8], True), (LENS, False)):
        ids = torch.randint(0, 256, (1, sum(lens)), generator=gen)
        other = copy.deepcopy(model)
        with torch.no_grad():
            for layer in other.model.layers:
                for p in layer.self_attn.indexer.parameters():
                    p.normal_(0, 1.0, generator=gen)
            a = model(ids, position_ids_for(lens), packed_causal_mask(lens))
            b = other(ids, position_ids_for(lens), packed_causal_mask(lens))
        gap = (a - b).abs().max().item()  # dense: the same keys, summed in another (score) order
        assert gap < 1e-4 if dense else gap > 1e-1, (lens, gap)  # measured: 3.7e-06 and 6.0


@pytest.mark.parametrize("name", ["dsa-test", "dsa-moe-test"])
def test_hf_checkpoint_round_trip(tmp_path: Path, name: str):
    """A random model saved in Hugging Face layout (DeepSeek-V3.2 config and parameter names) reloads through
    `build_model` with identical logits."""
    model = build_model(ModelConfig(name=name))
    model.init_weights(3, std=0.2)
    save_checkpoint_dir(model.state_dict(), model.args, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v32" and cfg["architectures"] == ["DeepseekV32ForCausalLM"]
    assert cfg["index_topk"] == model.args.index_topk and cfg["kv_lora_rank"] == model.args.kv_lora_rank
    names = set(load_file(str(tmp_path / "model.safetensors")))
    attn = "model.layers.1.self_attn."
    expected = {
        attn + n
        for n in (
            "kv_a_proj_with_mqa.weight",
            "kv_a_layernorm.weight",
            "kv_b_proj.weight",
            "o_proj.weight",
            "indexer.wq_b.weight",
            "indexer.wk.weight",
            "indexer.k_norm.weight",
            "indexer.k_norm.bias",
            "indexer.weights_proj.weight",
        )
    }
    if model.args.q_lora_rank:
        expected |= {attn + "q_a_proj.weight", attn + "q_a_layernorm.weight", attn + "q_b_proj.weight"}
    else:
        expected.add(attn + "q_proj.weight")
    if model.args.is_moe:
        mlp = "model.layers.1.mlp."
        expected |= {
            mlp + "gate.weight",
            mlp + "gate.e_score_correction_bias",
            mlp + "experts.3.down_proj.weight",
            mlp + "experts.0.gate_proj.weight",
            mlp + "shared_experts.up_proj.weight",
        }
        expected.add("model.layers.0.mlp.gate_proj.weight")  # first_k_dense_replace = 1
    assert expected <= names, sorted(expected - names)
    loaded = build_model(ModelConfig(name=str(tmp_path)))
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_deepseek_fp8_checkpoint_with_mtp_layer_loads(tmp_path: Path, monkeypatch):
    """A checkpoint laid out like the published DeepSeek-V3.2 one: FP8 weights with `weight_scale_inv` and a
    multi-token-prediction layer after the decoder layers (`num_nextn_predict_layers`): the MTP weights are
    skipped (not even read), the FP8 ones dequantised, and the model computes what the dequantised weights give."""
    from safetensors.torch import save_file

    from arbor.models.fp8 import dequantize_state

    model = build_model(ModelConfig(name="dsa-test"))
    model.init_weights(5, std=0.2)
    save_checkpoint_dir(model.state_dict(), model.args, tmp_path, fp8=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    L = cfg["num_hidden_layers"]
    state = load_file(str(tmp_path / "model.safetensors"))
    mtp = {
        f"model.layers.{L}.{k.split('.', 3)[3]}": v.clone() for k, v in state.items() if k.startswith("model.layers.0.")
    }
    assert any(k.endswith("weight_scale_inv") for k in mtp)
    save_file({**state, **mtp}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected"):
        build_model(ModelConfig(name=str(tmp_path)))  # without the config field the extra layer is an error
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"num_nextn_predict_layers": 1}))
    read: list[str] = []
    monkeypatch.setattr(hf, "safe_open", recording_safe_open(read))
    loaded = build_model(ModelConfig(name=str(tmp_path)))
    assert read and not any(n.startswith(f"model.layers.{L}.") for n in read)
    expected = dequantize_state(state)
    for name, p in loaded.named_parameters():
        assert torch.equal(p, expected[name].to(p.dtype)), name


def test_glm5_config_with_yarn_round_trip(tmp_path: Path):
    """A GLM-5-style config (GlmMoeDsaForCausalLM, per-layer mlp_layer_types, YaRN rope_scaling, plain q_proj):
    the fields map onto DSAArgs (indexer RoPE interleaved by default), the YaRN frequencies interpolate the low
    frequencies only, and a saved checkpoint reloads with identical logits."""
    from arbor.models.deepseek_v32 import DeepseekV32ForCausalLM, DSAArgs, rope_setup

    cfg = {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "vocab_size": 264,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "head_dim": 8,
        "v_head_dim": 8,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 8,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "n_shared_experts": 1,
        "mlp_layer_types": ["dense", "sparse", "sparse"],
        "scoring_func": "sigmoid",
        "rope_scaling": {
            "type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    args = DSAArgs.from_hf_config(cfg)
    assert args.indexer_rope_interleave and args.first_k_dense_replace == 1 and args.moe_layers == [1, 2]
    plain, _, _ = rope_setup(DSAArgs(**{**args.__dict__, "rope_scaling": None}))
    inv_freq, attn, softmax = rope_setup(args)
    assert torch.equal(inv_freq[0], plain[0]) and torch.allclose(inv_freq[-1], plain[-1] / 40)
    assert attn == 1.0 and softmax == pytest.approx((0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2)
    model = DeepseekV32ForCausalLM(args)
    model.init_weights(7, std=0.2)
    save_checkpoint_dir(model.state_dict(), args, tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["model_type"] == "glm_moe_dsa"
    loaded = build_model(ModelConfig(name=str(tmp_path / "ckpt")))
    assert loaded.args.rope_scaling["factor"] == 40.0 and loaded.args.indexer_rope_interleave
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_engine_decoding_matches_full_forward():
    """The inference engine on a DSA model (latent KV + index-key slot cache, indexer over the cached keys while
    decoding) gives the tokens and logprobs of plain full forwards, past index_topk tokens."""
    cfg = ModelConfig(name="dsa-test")
    tok = build_tokenizer(cfg)
    model = build_model(cfg)
    model.init_weights(0, std=0.3)
    ref = copy.deepcopy(model).eval()
    prompts = [tok.encode(p) for p in ("reverse this text", "abc")]
    engine = Engine(model, tok, seq_len=64, max_batch_size=4, seed=0).start()
    try:
        engine.pause().result()
        futures = [engine.submit(p, SamplingParams(max_tokens=16, temperature=0)) for p in prompts]
        engine.resume().result()
        outputs = [f.result(timeout=120) for f in futures]
    finally:
        engine.stop()
    for p, out in zip(prompts, outputs):
        (c,) = out.completions
        ids = list(p)
        with torch.no_grad():
            for t, lp in zip(c.token_ids, c.logprobs):
                logits = ref(torch.tensor([ids]))[0, -1].float()
                assert int(logits[: tok.vocab_size].argmax()) == t  # the engine never picks a padding row
                assert abs(float(torch.log_softmax(logits[: tok.vocab_size], -1)[t]) - lp) < 1e-5  # the policy's ids
                ids.append(t)
        assert len(ids) > model.args.index_topk + 4  # the cached decode really selected among more keys than k


def test_cp_style_must_fit_the_model():
    with pytest.raises(ValueError, match="cannot split DeepSeek sparse attention"):
        TrainerConfig(model=ModelConfig(name="dsa-test"), parallel={"cp": 2, "cp_style": "ring"})
    with pytest.raises(ValueError, match="needs a DeepSeek sparse attention model"):
        TrainerConfig(model=ModelConfig(name="qwen3-test"), parallel={"cp": 2, "cp_style": "dsa"})
    TrainerConfig(model=ModelConfig(name="dsa-test"), parallel={"cp": 2})  # auto -> dsa


# --- DSA context parallel on 2 ranks ---------------------------------------------------------------------------


def _selected(topk: torch.Tensor) -> list[list[int]]:
    return [sorted(int(i) for i in row if i >= 0) for row in topk]


def _dsa_cp_worker(rank: int, world: int, name: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from arbor.trainer.dsa_cp import apply_dsa_cp
    from arbor.trainer.parallel_state import ParallelState

    ref = build_model(ModelConfig(name=name))
    ref.init_weights(5, std=0.2)
    model = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(6)
    T = sum(LENS) + 3  # trailing padding as the batcher leaves it
    ids = torch.randint(0, 256, (T,), generator=gen)
    pos = position_ids_for(LENS, T)[0]
    w = torch.randn(T, generator=gen)
    lp_ref, ent_ref = packed_logprobs(ref, ids, pos, LENS, 1.0, torch.device("cpu"))
    (lp_ref * w).sum().backward()

    cp = apply_dsa_cp(model, init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)))
    lp, ent = packed_logprobs(model, ids, pos, LENS, 1.0, torch.device("cpu"), state=ParallelState(cp=cp))
    assert_close(lp, lp_ref.detach(), "dsa cp logprobs")
    assert_close(ent, ent_ref, "dsa cp entropy")
    local = cp.local_indices
    real = local < T
    for layer, layer_ref in zip(model.model.layers, ref.model.layers):
        mine = _selected(layer.self_attn.last_topk[0][real])
        assert mine == _selected(layer_ref.self_attn.last_topk[0][local[real]]), "top-k selection differs"
        assert any(len(s) == model.args.index_topk for s in mine)  # some queries really were sparse
    (lp * w).sum().backward()
    for (n, p), (_, p_ref) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if p_ref.grad is None:  # the indexer (no gradient through top-k) and the router bias
            assert p.grad is None, n
            continue
        g = p.grad.clone()
        dist.all_reduce(g)  # every cp rank computed the same loss: the sum over ranks is cp x the gradient
        assert_close(g / world, p_ref.grad, f"dsa cp grad {n}")


@pytest.mark.slow
def test_dsa_moe_expert_parallel_matches_one_process():
    """EP=2 on the DSA MoE preset (DeepSeek router, shared experts): forward and gradients as one process."""
    from test_parallel import _ep_worker

    _spawn(_ep_worker, "dsa-moe-test")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dsa-test", "dsa-moe-test"])
def test_dsa_context_parallel_matches_one_process(name):
    _spawn(_dsa_cp_worker, name)


@pytest.mark.slow
@pytest.mark.parametrize("indexer", [False, True])
def test_dsa_context_parallel_trainer_matches_one_rank(tmp_path: Path, indexer: bool):
    """`trainer` under torchrun with cp = 2 on dsa-test (cp_style auto -> dsa, FSDP2 over the cp ranks, activation
    checkpointing) trains exactly as one rank: loss figures and published weights after each step; with
    `indexer.train` also the indexer's KL and gradient norm (arbor.models.dsa_indexer_loss)."""
    one, cp = tmp_path / "one", tmp_path / "cp"
    write_rollouts({1: one}, steps=2)
    shutil.copytree(one / "rollouts", cp / "rollouts")
    common = ["--max-steps", "2", "--model.name", "dsa-test", "--optim.lr", "1e-3", "--num-threads", "1"]
    common += ["--indexer.train", "true"] if indexer else []
    assert trainer_main(["--output-dir", str(one), *common]) == 0
    run_torchrun(
        2,
        [
            "--output-dir",
            str(cp),
            *common,
            "--parallel.nproc",
            "2",
            "--parallel.cp",
            "2",
            "--parallel.activation-checkpointing",
            "true",
        ],
    )
    for r1, r2 in zip(read_metrics(one), read_metrics(cp), strict=True):
        assert r1["loss"] == pytest.approx(r2["loss"], abs=1e-5)
        assert r1["grad_norm"] == pytest.approx(r2["grad_norm"], rel=1e-5)
        assert r1["num_tokens"] == r2["num_tokens"]
        assert ("indexer/kl" in r1) == ("indexer/kl" in r2) == indexer
        if indexer:
            # ~1.8e-5 at init: a difference of O(1) fp32 entropies, so compared in absolute terms
            assert r1["indexer/kl"] == pytest.approx(r2["indexer/kl"], abs=1e-7)
            assert r1["indexer/grad_norm"] == pytest.approx(r2["indexer/grad_norm"], rel=1e-5)
    for version in (1, 2):
        assert_same_weights(broadcast_dir(one, version), broadcast_dir(cp, version), atol=1e-5)


@pytest.mark.slow
def test_rl_run_on_dsa_with_context_parallel_trainer_stays_on_policy(tmp_path: Path):
    """`rl` end to end with model.name = dsa-test: the CPU engine samples with the latent KV cache, the trainer
    runs 2 ranks with DSA context parallelism (cp_style auto), and synchronous steps stay on policy (engine and
    trainer logprobs agree: mismatch KL ~ 0)."""
    import subprocess
    import sys

    from test_rl_e2e import TINY

    from arbor.monitor.metrics import read_jsonl

    args = [a if a != "qwen3-test" else "dsa-test" for a in TINY]
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "arbor.launch.rl",
            "--output-dir",
            str(out),
            *args,
            "--max-steps",
            "3",
            "--orchestrator.scheduler.mode",
            "sync",
            "--trainer.parallel.nproc",
            "2",
            "--trainer.parallel.cp",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["staleness/max"] == 0
        assert r["mismatch_kl"] < 1e-3
