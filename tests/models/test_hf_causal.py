"""The transformers path (arbor.models.hf_causal): any transformers causal LM behind arbor's model interface.

Over tiny random checkpoints of ten families written locally: the trainer's packed, vocabulary-chunked logprobs
equal transformers' own forward of each sample alone; the engine's slot-cache decoding equals a full forward;
what arbor publishes is the checkpoint's own layout, which transformers loads back.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from hf_tiny import MORE_HF, REFUSED_HF, TINY_HF, tiny_config, write_tiny

from arbor.config.loader import ConfigError, load_config
from arbor.config.model import ModelConfig
from arbor.config.rl import RLConfig
from arbor.models import build_model
from arbor.models.attention import SegmentMask, row_attention_mask, subtree_end_for
from arbor.models.family import UnsupportedArchitecture, args_from_dir, choose_family
from arbor.models.hf import save_checkpoint_dir
from arbor.models.hf_args import HFArgs
from arbor.models.hf_causal import HFCausalLM
from arbor.models.tokenizer import ByteTokenizer
from arbor.trainer.parallel import apply_ac
from arbor.trainer.parallel_state import ParallelState
from arbor.trainer.step import packed_logprobs

CPU = torch.device("cpu")
LENS = [7, 9, 6]
PAD = 3


FAST = ("LlamaForCausalLM", "Qwen3_5ForCausalLM", "GptOssForCausalLM")
"""The fast tier's share of the matrix: a plain decoder, a recurrent hybrid, sinks + sliding window + MoE."""
MATRIX = [arch if arch in FAST else pytest.param(arch, marks=pytest.mark.slow) for arch in TINY_HF]
RING = MATRIX + [pytest.param(arch, marks=pytest.mark.slow) for arch in MORE_HF]
"""The matrix and the second ring (tests/hf_tiny.py): logprobs and engine decoding."""


class TinyDirs(dict):
    """Each family's checkpoint, written on first use."""

    def __init__(self, root) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, arch: str) -> str:
        self[arch] = str(write_tiny(arch, self.root / arch))
        return self[arch]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> TinyDirs:
    return TinyDirs(tmp_path_factory.mktemp("hf"))


def _model(path: str):
    """The transformers path's model, also for the families arbor builds natively (tests/models/
    test_native_families.py compares those with transformers)."""
    return build_model(ModelConfig(name=path, tokenizer="byte", impl="transformers"))


def _reference(arch: str, path: str):
    return getattr(transformers, arch).from_pretrained(path, attn_implementation="eager", dtype=torch.float32)


@pytest.mark.parametrize("arch", RING)
def test_trainer_logprobs_of_a_packed_row_equal_transformers_per_sample(arch, tiny_dirs):
    """The row is attended as chunks of whole samples (arbor.models.attention.SegmentMask), each under the
    layer's own sliding window, sinks and soft-capping. The model is in training mode, as the trainer's is:
    transformers' modules still run their inference forward (no dropout: Seed-OSS; no sampled routes: PhiMoE)."""
    assert choose_family(arch, "transformers")[1].startswith(f"{arch}: transformers' own modules")
    _check_packed_row(arch, tiny_dirs[arch], CPU)


@pytest.mark.gpu(
    reason="the transformers path's chunked attention on CUDA: SDPA's kernels and the sinks' explicit path"
)
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM", "GptOssForCausalLM"])
def test_trainer_logprobs_of_a_packed_row_equal_transformers_per_sample_on_cuda(arch, tiny_dirs):
    _check_packed_row(arch, tiny_dirs[arch], torch.device("cuda"))


def _check_packed_row(arch: str, path: str, device: torch.device) -> None:
    """`packed_logprobs` of a row of three samples and padding, on `device`, against transformers' eager forward
    of each sample alone on the CPU (fp32, <= 1e-4)."""
    model, ref = _model(path).to(device).train(), _reference(arch, path)
    samples, ids, pos = _packed_row()
    lp, _ = packed_logprobs(model, ids, pos, LENS, 1.0, device, state=ParallelState(logprob_chunk=16))
    lp, start = lp.cpu(), 0
    with torch.no_grad():
        for s in samples:
            want = torch.log_softmax(ref(s[None]).logits[0, :-1].float(), -1).gather(1, s[1:, None])[:, 0]
            got = lp[start + 1 : start + len(s)]
            assert (got - want).abs().max() <= 1e-4, (arch, (got - want).abs().max())
            start += len(s)


def _packed_row() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    samples = [torch.randint(3, 250, (n,), generator=gen) for n in LENS]
    ids = torch.cat(samples + [torch.zeros(PAD, dtype=torch.long)])
    pos = torch.cat([torch.arange(n) for n in LENS] + [torch.zeros(PAD, dtype=torch.long)])
    return samples, ids, pos


@pytest.mark.parametrize("arch", ["MistralForCausalLM", "GptOssForCausalLM"])
def test_chunked_attention_equals_the_dense_mask_in_bfloat16(arch, tiny_dirs, monkeypatch):
    """bf16 (production's dtype), sliding window (Mistral) and sinks (gpt-oss): the packed row's logprobs with the
    row cut into chunks equal those under the dense mask, within bf16 rounding."""
    model = build_model(ModelConfig(name=tiny_dirs[arch], tokenizer="byte", impl="transformers", dtype="bfloat16"))
    _, ids, pos = _packed_row()
    state = ParallelState(logprob_chunk=16)
    end = subtree_end_for(LENS, ids.shape[0])
    assert isinstance(row_attention_mask(end, CPU, model.accepts_block_mask, model.accepts_segment_mask), SegmentMask)
    with torch.no_grad():
        chunked, _ = packed_logprobs(model, ids, pos, LENS, 1.0, CPU, state=state)
        monkeypatch.setattr(HFCausalLM, "accepts_segment_mask", False)
        dense, _ = packed_logprobs(model, ids, pos, LENS, 1.0, CPU, state=state)
    assert (chunked.float() - dense.float()).abs().max() <= 5e-2  # measured: Mistral 6e-4, gpt-oss 0


@pytest.mark.parametrize("arch", RING)
def test_engine_decoding_through_the_slot_cache_equals_a_full_forward(arch, tiny_dirs):
    model = _model(tiny_dirs[arch]).eval()
    cache = model.make_kv_cache(3, 32)
    prompts = [torch.arange(10, 16), torch.arange(40, 49)]
    with torch.no_grad():
        for slot, p in zip((2, 0), prompts):  # prefill each in its own slot
            model(p[None], torch.arange(len(p))[None], kv_cache=cache, cache_slots=torch.tensor([slot]))
        seqs = [p.tolist() for p in prompts]
        for step in range(4):  # batched decode of both slots, rows at different positions
            nxt = [100 + step, 200 + step]
            ids = torch.tensor(nxt)[:, None]
            pos = torch.tensor([[len(s)] for s in seqs])
            got = model(ids, pos, kv_cache=cache, cache_slots=torch.tensor([2, 0]))[:, -1]
            for b, s in enumerate(seqs):
                s.append(nxt[b])
                want = model(torch.tensor(s)[None])[0, -1]
                assert (got[b] - want).abs().max() <= 1e-4, (arch, step, (got[b] - want).abs().max())


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "MiniMaxM2ForCausalLM"])
def test_published_checkpoint_is_the_checkpoints_own_layout_and_loads_back(arch, tiny_dirs, tmp_path):
    model = _model(tiny_dirs[arch])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    save_checkpoint_dir(model.state_dict(), model.args, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [arch]
    ids = torch.arange(5, 17)[None]
    with torch.no_grad():
        want = model(ids)
        reloaded = _reference(arch, str(tmp_path))(ids).logits
        again = _model(str(tmp_path))(ids)
    assert (reloaded - want).abs().max() <= 1e-5
    assert (again - want).abs().max() <= 1e-6


def test_a_recurrent_model_refuses_a_prefix_tree_row_in_one_line(tiny_dirs):
    model = _model(tiny_dirs["Qwen3_5ForCausalLM"])
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    mask[3, 2] = False  # token 3 is a sibling of token 2: a tree, not chains
    with pytest.raises(ValueError, match="prefix-tree merged row: set orchestrator.batching.prefix_merge = false"):
        model(torch.arange(4)[None], torch.tensor([[0, 1, 2, 2]]), mask[None, None])


def test_model_impl_decides_the_path_in_one_place(tiny_dirs):
    gemma = tiny_dirs["Gemma3ForCausalLM"]
    assert args_from_dir(gemma).impl == "transformers"
    with pytest.raises(UnsupportedArchitecture, match=r"^model.impl = 'native': .* 'Gemma3ForCausalLM' checkpoint"):
        args_from_dir(gemma, "native")
    llama = tiny_dirs["LlamaForCausalLM"]
    assert args_from_dir(llama).architecture == "LlamaForCausalLM"  # native where arbor has it
    assert getattr(args_from_dir(llama), "impl", None) is None
    assert args_from_dir(llama, "transformers").impl == "transformers"
    assert (
        choose_family("Qwen3ForCausalLM")[1] == "Qwen3ForCausalLM: arbor's native implementation (model.impl = 'auto')"
    )
    family, why = choose_family("Qwen3ForCausalLM", "transformers")
    assert family.args_class.__name__ == "HFArgs" and "model.impl = 'transformers'" in why


def test_an_architecture_neither_path_builds_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"], "model_type": "x"}))
    with pytest.raises(UnsupportedArchitecture) as e:
        args_from_dir(tmp_path)
    assert "\n" not in str(e.value)
    assert str(e.value).startswith(f"model.name: {tmp_path} is a 'NoSuchForCausalLM' checkpoint; arbor builds")


def test_a_head_arbor_cannot_reproduce_is_refused_in_one_line(tmp_path):
    """Gemma 2's soft-capping, Cohere's and Granite's scales are honoured (the second ring's parity); a scale
    field on a model arbor does not know it of (its meaning differs: Granite divides by `logits_scaling`,
    HyperCLOVA X multiplies), or a head with a bias, is one line."""
    config = transformers.LlamaConfig(
        vocab_size=264, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, logits_scaling=2.0,
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "scaled")
    with pytest.raises(UnsupportedArchitecture, match="applies logits_scaling = 2.0 after its head, which arbor does"):
        _model(str(tmp_path / "scaled"))
    config = tiny_config("PhimoeForCausalLM")
    config.lm_head_bias = True
    transformers.PhimoeForCausalLM(config).save_pretrained(tmp_path / "bias")
    with pytest.raises(UnsupportedArchitecture, match="PhimoeForCausalLM's head has a bias"):
        _model(str(tmp_path / "bias"))


@pytest.mark.parametrize(
    "flags, setting",
    [
        (["--trainer.parallel.nproc", "2", "--trainer.parallel.ep", "2"], "trainer.parallel.ep > 1"),
        (["--trainer.parallel.nproc", "2", "--trainer.parallel.cp", "2"], "trainer.parallel.cp > 1"),
        (["--model.router-replay", "true"], "model.router_replay = true"),
        (["--model.fp8", "block"], 'model.fp8 = "block"'),
        (["--model.mtp-depth", "1"], "model.mtp_depth > 0"),
    ],
)
def test_what_the_transformers_path_cannot_honour_is_refused_at_config_time(flags, setting, tiny_dirs):
    argv = ["@", "examples/reverse_text/rl.toml", "--model.name", tiny_dirs["Phi3ForCausalLM"], *flags]
    with pytest.raises(ConfigError, match=re.escape(f"{setting}: Phi3ForCausalLM runs on the transformers path")):
        load_config(RLConfig, argv, env={})


def test_a_recurrent_model_with_prefix_merge_is_refused_at_config_time(tiny_dirs):
    argv = ["@", "examples/reverse_text/rl.toml", "--model.name", tiny_dirs["Qwen3_5ForCausalLM"]]
    with pytest.raises(ConfigError, match="prefix_merge = true: Qwen3_5ForCausalLM has recurrent layers"):
        load_config(RLConfig, argv, env={})
    load_config(RLConfig, argv + ["--orchestrator.batching.prefix-merge", "false"], env={})


def test_auto_falls_back_to_transformers_where_the_native_family_refuses_a_setting(tiny_dirs):
    """The tiny Mistral has a 5-token sliding window, which arbor's native Llama-family attention does not
    implement: "auto" builds it through transformers and says why; "native" refuses it in one line."""
    mistral = tiny_dirs["MistralForCausalLM"]
    config = json.loads((Path(mistral) / "config.json").read_text())
    family, why = choose_family("MistralForCausalLM", "auto", mistral, config)
    assert family.args_class.__name__ == "HFArgs"
    assert "native family refuses this checkpoint: sliding_window = 5" in why and "\n" not in why
    assert args_from_dir(mistral).impl == "transformers"
    with pytest.raises(ValueError, match="sliding_window = 5"):
        args_from_dir(mistral, "native")


@pytest.mark.parametrize("arch", REFUSED_HF)
def test_a_model_that_does_not_attend_through_the_registry_is_refused_in_one_line(arch, tiny_dirs):
    """ALiBi or state-space layers of their own, two attention calls a layer, a head that is more than a linear
    layer: arbor's packed-row mask would not hold, so the model is refused when built or on its first forward."""
    _, ids, pos = _packed_row()
    with pytest.raises(UnsupportedArchitecture) as e:
        model = _model(tiny_dirs[arch])
        packed_logprobs(model, ids, pos, LENS, 1.0, CPU, state=ParallelState(logprob_chunk=16))
    assert str(e.value).startswith(f"model.name: {arch}") and "\n" not in str(e.value), str(e.value)


def test_a_checkpoint_transformers_cannot_run_either_is_told_from_a_refused_architecture(tmp_path, tiny_dirs):
    """A model whose two-token forward fails under arbor's attention is one line, which says whose fault it is:
    the checkpoint's (transformers' own eager forward fails too: 4 query heads over 3 key heads) or the
    architecture's (Moshi runs on its own, not under arbor's attention)."""
    config = transformers.LlamaConfig(**{**tiny_config("LlamaForCausalLM").to_dict(), "num_key_value_heads": 3})
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "broken")
    ByteTokenizer().save(tmp_path / "broken")
    with pytest.raises(UnsupportedArchitecture) as e:
        _model(str(tmp_path / "broken"))
    why = str(e.value)
    assert why.startswith("model.name: LlamaForCausalLM: transformers' own forward of this checkpoint fails on two")
    assert why.endswith("check its config.json") and "RuntimeError" in why and "\n" not in why
    with pytest.raises(UnsupportedArchitecture, match="where transformers' own forward runs; this architecture"):
        _model(tiny_dirs["MoshiForCausalLM"])


def test_activation_checkpointing_recomputes_a_layer_that_does_not_pass_its_keywords_on(tiny_dirs):
    """StableLM's decoder layer calls its attention without the layer's keywords: arbor's context reaches it
    anyway (`carry_to_attention`), also when activation checkpointing recomputes the layer in backward."""
    _, ids, pos = _packed_row()
    grads = []
    for ac in (False, True):
        model = _model(tiny_dirs["StableLmForCausalLM"])
        if ac:
            apply_ac(model)
        lp, _ = packed_logprobs(model, ids, pos, LENS, 1.0, CPU, state=ParallelState(logprob_chunk=16))
        lp.sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(g is not None for g in grads[0].values())
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], atol=1e-6), name


def test_config_fields_under_other_names_and_missing_ones(tmp_path):
    """XGLM's and LongCat-Flash's `num_layers`, GPT-style `n_embd` / `n_head`: read; a field missing under every
    name is one line naming them."""
    args = HFArgs(config={"vocab_size": 9, "n_embd": 8, "num_layers": 3, "n_head": 2}, architecture="XForCausalLM")
    assert (args.hidden_size, args.num_hidden_layers, args.num_attention_heads, args.head_dim) == (8, 3, 2, 4)
    with pytest.raises(UnsupportedArchitecture, match="config.json has no num_hidden_layers / num_layers"):
        _ = HFArgs(config={"vocab_size": 9}, architecture="XForCausalLM").num_hidden_layers
