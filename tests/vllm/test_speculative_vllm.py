"""`[inference.speculative]` rendered into vLLM's `--speculative-config` (method mtp), its config errors, and a real
vLLM server drafting with a tiny DeepSeek-V3-style checkpoint's MTP layer (greedy tokens unchanged by it: those of
the checkpoint's main model run by transformers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from vllm_server import post_json, vllm_server

from arbor.config.inference import InferenceConfig
from arbor.config.loader import ConfigError, load_config
from arbor.config.rl import RLConfig
from arbor.inference.vllm.launch import dry_run_command, serve_argv, speculative_config
from arbor.models.hf import split_experts
from arbor.models.tokenizer import ByteTokenizer


def _spec_flag(argv: list[str]) -> dict | None:
    return json.loads(argv[argv.index("--speculative-config") + 1]) if "--speculative-config" in argv else None


def test_speculative_config_renders_vllm_mtp_method():
    assert _spec_flag(serve_argv(InferenceConfig(), "/m", 1)) is None
    cfg = InferenceConfig.model_validate({"speculative": {"enabled": True, "draft_tokens": 2}})
    assert _spec_flag(serve_argv(cfg, "/m", 1)) == {"method": "mtp", "num_speculative_tokens": 2}
    cfg = InferenceConfig.model_validate(
        {"speculative": {"enabled": True, "method": "deepseek_mtp", "extra": {"draft_tensor_parallel_size": 1}}}
    )
    assert speculative_config(cfg.speculative) == {
        "method": "deepseek_mtp",
        "num_speculative_tokens": 3,
        "draft_tensor_parallel_size": 1,
    }
    assert "--speculative-config" in dry_run_command(cfg)


def test_a_float32_latent_attention_model_on_the_cpu_build_takes_vllms_reference_mla(tmp_path):
    """vLLM's CPU build picks its AMX MLA backend on processors with AMX tiles, which packs bf16/fp16 weights only:
    a float32 MLA model (and its MTP drafts) asks for the reference backend; bf16, the CUDA build, a model without
    latent attention and a backend the config names itself are left to vLLM."""
    (tmp_path / "config.json").write_text(json.dumps({"kv_lora_rank": 512}))
    mla = str(tmp_path)
    spec = {"speculative": {"enabled": True, "draft_tokens": 2}}
    cfg = InferenceConfig.model_validate({"model": {"dtype": "float32"}, **spec})
    argv = serve_argv(cfg, mla, 1, cpu=True)
    assert argv[argv.index("--attention-backend") + 1] == "CPU_MLA"
    assert _spec_flag(argv)["attention_backend"] == "CPU_MLA"
    for argv in (
        serve_argv(InferenceConfig.model_validate({"model": {"dtype": "bfloat16"}, **spec}), mla, 1, cpu=True),
        serve_argv(cfg, mla, 1, cpu=False),
        serve_argv(cfg, "/a/hub/id", 1, cpu=True),
    ):
        assert "--attention-backend" not in argv and "attention_backend" not in _spec_flag(argv)
    own = cfg.model_copy(update={"vllm": cfg.vllm.model_copy(update={"extra_args": {"attention_backend": "X"}})})
    argv = serve_argv(own, mla, 1, cpu=True)
    assert argv.count("--attention-backend") == 1 and "attention_backend" not in _spec_flag(argv)


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--inference.speculative.draft-tokens", "0"], "inference.speculative.draft_tokens"),
        (["--inference.speculative.method", "eagle9"], "inference.speculative.method"),
        (["--trainer.draft.top-k", "0"], "trainer.draft.top_k"),
        (["--trainer.draft.weight", "-1"], "trainer.draft.weight"),
        (["--model.mtp-depth", "99"], "model.mtp_depth"),
    ],
)
def test_bad_speculative_and_draft_values_fail_in_one_line_naming_the_key(argv, key):
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, argv, env={})
    assert "\n" not in str(e.value) and key in str(e.value), str(e.value)


def tiny_dsv3_config() -> DeepseekV3Config:
    """DeepSeek-V3's architecture at toy size: MLA, one dense and one MoE layer, one MTP layer."""
    return DeepseekV3Config(
        vocab_size=264,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=64,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
        num_nextn_predict_layers=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        torch_dtype="float32",  # latent 512 + rope 64: the one width vLLM's CPU MLA serves
        architectures=["DeepseekV3ForCausalLM"],  # without it vLLM resolves the bare DeepseekV3Model as a pooling model
        topk_method="noaux_tc",  # DeepSeek-V3's routing, as its checkpoints say: vLLM then loads the gate's bias
    )


def tiny_dsv3_model() -> DeepseekV3ForCausalLM:
    """The seeded random model of that config, its head scaled 20x: a random model's next-token logits are nearly
    flat (its two best a few 1e-3 apart), so kernels that round differently could flip a greedy choice; scaled, the
    choices stand clear of such near ties."""
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(tiny_dsv3_config())
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model.eval()


def tiny_deepseek_mtp_checkpoint(path: Path) -> Path:
    """A random DeepSeek-V3-architecture checkpoint (MLA, one MoE layer) with one MTP layer stored as DeepSeek
    does (`model.layers.{L}`: enorm, hnorm, eh_proj, shared_head, its own block), and the byte tokenizer."""
    cfg = tiny_dsv3_config()
    state = {k: v.contiguous() for k, v in tiny_dsv3_model().state_dict().items()}
    L = cfg.num_hidden_layers
    for k, v in list(state.items()):  # the MTP layer's block: a copy of the last decoder layer
        if k.startswith(f"model.layers.{L - 1}."):
            state[k.replace(f"model.layers.{L - 1}.", f"model.layers.{L}.")] = v.clone()
    h = cfg.hidden_size
    state.update(
        {
            f"model.layers.{L}.enorm.weight": torch.ones(h),
            f"model.layers.{L}.hnorm.weight": torch.ones(h),
            f"model.layers.{L}.eh_proj.weight": torch.cat([torch.zeros(h, h), torch.eye(h)], 1),
            f"model.layers.{L}.shared_head.norm.weight": torch.ones(h),
            f"model.layers.{L}.shared_head.head.weight": state["lm_head.weight"].clone(),
            f"model.layers.{L}.embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
        }
    )
    state = {k: v.contiguous() for k, v in split_experts(state).items()}  # per-expert names, as vLLM reads
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(cfg.to_json_string())
    ByteTokenizer().save(path)
    return path


def reference_greedy(prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of the checkpoint's main model (transformers' DeepSeek-V3, fp32, no MTP) and at each the gap
    between its two best logits: vLLM without speculation would have to match this anyway, and one forward per
    token of a 64-wide model costs well under the minute a second vLLM server takes to start on CPU."""
    model = tiny_dsv3_model()  # the weights tiny_deepseek_mtp_checkpoint saved
    ids, gaps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            top = model(torch.tensor([ids])).logits[0, -1].float().topk(2)
            ids.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
    return ids[len(prompt) :], gaps


def _speculative_greedy_is_the_models(tmp_path: Path) -> None:
    model = tiny_deepseek_mtp_checkpoint(tmp_path / "dsv3-mtp")
    prompt, n = [72, 101, 108, 108, 111], 24
    body = {"model": str(model), "prompt": prompt, "max_tokens": n, "temperature": 0.0, "logprobs": 1}
    with vllm_server(tmp_path, model, 128, "--speculative.enabled", "true", "--speculative.draft-tokens", "2") as url:
        spec = post_json(url, "/v1/completions", body)["choices"][0]
    want, gaps = reference_greedy(prompt, n)
    got = spec["token_ids"]
    assert 0 < len(got) <= n  # fewer where the model samples its end-of-text id, which transformers' loop ignores
    # Drafts must not change greedy output. vLLM's MLA and MoE kernels round differently from transformers', so a
    # near tie (best two logits within 1e-3) may go either way; the sequences then part, and are compared up to it.
    for t, (a, b) in enumerate(zip(got, want)):
        if a != b:
            assert gaps[t] < 1e-3, f"token {t}: vLLM {a}, transformers {b}, logit gap {gaps[t]:.3g}; {got} vs {want}"
            break


@pytest.mark.gpu(reason="vLLM's CUDA build drafting with the MTP layer of a DeepSeek-V3-style checkpoint")
@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_mtp_speculation_on_gpu(tmp_path):
    _speculative_greedy_is_the_models(tmp_path)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_cpu_build_serves_mtp_speculation(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the CUDA build is covered by test_vllm_serves_mtp_speculation_on_gpu")
    _speculative_greedy_is_the_models(tmp_path)
