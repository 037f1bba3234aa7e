"""LoRA on the transformers path (arbor.models.hf_causal + arbor.models.lora): adapters on transformers' own linear
layers, the same PEFT keys as the native family's (peft names a module by its path in the transformers model,
which is what these modules are), a step that trains the adapters only, and the local engine serving the
published adapter as the trainer computes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_tiny import write_tiny
from test_trainer import trainer_args, write_rollouts

from arbor.config.model import LoRAConfig, ModelConfig
from arbor.inference.engine.core import Engine
from arbor.inference.engine.params import SamplingParams
from arbor.models import build_model, build_tokenizer
from arbor.models.hf_causal import HFCausalLM
from arbor.models.lora import apply_lora, lora_parameters, merged_state
from arbor.models.lora_peft import ADAPTER_WEIGHTS, adapter_config, load_adapter, peft_tensors, save_adapter
from arbor.run_dir import broadcast_dir
from arbor.trainer.main import main as trainer_main

LORA = LoRAConfig(rank=4, alpha=8.0)
PROJS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
PROJS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return str(write_tiny("LlamaForCausalLM", tmp_path_factory.mktemp("hf") / "llama"))


def _adapted(path: str, impl: str = "transformers") -> torch.nn.Module:
    model = build_model(ModelConfig(name=path, impl=impl, lora=LORA))
    apply_lora(model, LORA, 0)
    return model


def test_adapters_sit_on_transformers_linear_layers_under_peft_names(llama):
    """A fresh adapter (B = 0) leaves the logits exactly the base model's; the PEFT keys are those peft writes
    for a LlamaForCausalLM (`base_model.model.model.layers.{i}.<proj>.lora_{A,B}.weight`), the native family's
    the same, so an adapter moves between the two paths."""
    model = _adapted(llama)
    assert isinstance(model, HFCausalLM)
    ids = torch.arange(5, 17)[None]
    with torch.no_grad():
        assert torch.equal(model(ids), build_model(ModelConfig(name=llama, impl="transformers"))(ids))
    keys = set(peft_tensors(dict(lora_parameters(model))))
    want = {
        f"base_model.model.model.layers.{i}.{proj}.lora_{ab}.weight" for i in range(2) for proj in PROJS for ab in "AB"
    }
    assert keys == want
    assert set(peft_tensors(dict(lora_parameters(_adapted(llama, "native"))))) == want


def test_a_step_trains_the_adapters_only(llama):
    model = _adapted(llama)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.arange(5, 17)[None]
    for _ in range(2):  # B moves on the first step, A (its gradient is B's) on the second
        torch.log_softmax(model(ids), -1)[0, :-1].gather(1, ids[0, 1:, None]).mean().neg().backward()
        opt.step()
        opt.zero_grad()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {n for n, _ in lora_parameters(model)}


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3_5ForCausalLM"])
def test_the_engine_serves_the_adapter_as_the_merged_model(arch, llama, tmp_path):
    """The local engine loads the PEFT directory onto the transformers modules; a request for the adapter and one
    for the base model decode together, each as its own model does (the adapter merged into the weights; logprobs
    within 1e-5). Qwen3.5's recurrent layers recompute each row alone: rows of different adapters go by slot."""
    path = llama if arch == "LlamaForCausalLM" else str(write_tiny(arch, tmp_path / "model"))
    model = _adapted(path)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    adapters = dict(lora_parameters(model))
    save_adapter(tmp_path / "a", adapter_config(LORA, path, adapters), adapters)
    merged = build_model(ModelConfig(name=path, impl="transformers"))
    merged.load_state_dict(merged_state(model))
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    tokenizer = build_tokenizer(ModelConfig(name=path))

    def serve(served: torch.nn.Module, adapters: list[str | None]) -> list:
        engine = Engine(served.eval(), tokenizer, seq_len=64, max_batch_size=4).start()
        try:
            if "a" in adapters:
                engine.load_adapter("a", tmp_path / "a", 1).result()
            futures = [engine.submit([5, 6, 7, 8], greedy, adapter=a) for a in adapters]
            return [f.result().completions[0] for f in futures]
        finally:
            engine.stop()

    with torch.inference_mode():
        got = serve(build_model(ModelConfig(name=path, impl="transformers")), ["a", None])
        want = serve(merged, [None]) + serve(build_model(ModelConfig(name=path, impl="transformers")), [None])
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert max(abs(x - y) for x, y in zip(g.logprobs, w.logprobs, strict=True)) < 1e-5
    assert got[0].logprobs != got[1].logprobs  # the adapter does something


def test_the_trainer_publishes_a_peft_adapter_from_the_transformers_path(llama, tmp_path: Path):
    out = tmp_path / "run"
    write_rollouts({1: out}, steps=2)
    flags = ["--model.name", llama, "--model.impl", "transformers", "--model.lora.rank", "4"]
    assert trainer_main(trainer_args(out, 2, *flags)) == 0
    config, step1 = load_adapter(broadcast_dir(out, 1))
    _, step2 = load_adapter(broadcast_dir(out, 2))
    assert config["r"] == 4 and "q_proj" in config["target_modules"]
    assert (broadcast_dir(out, 2) / ADAPTER_WEIGHTS).is_file()
    assert step1.keys() == {n for n, _ in lora_parameters(_adapted(llama))}
    assert any(not torch.equal(step1[k], step2[k]) for k in step1)  # the adapter trained
