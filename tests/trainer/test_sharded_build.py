"""The trainer builds a user's checkpoint without any rank holding the whole model (arbor.models.materialize):
parameters on the meta device, sharded by FSDP2, then each rank allocates and reads only its parts, one layer at a
time. Two gloo ranks build checkpoints transformers wrote (bf16, as published models are): each rank's peak host
memory stays near half of one fp32 copy of the model (the old build held the whole fp32 model plus the checkpoint on
every rank: ~1.5 copies), every parameter equals the checkpoint's, computed buffers (RoPE) survive, a tied head
stays the embedding, a LoRA adapter is the one an unsharded build draws, and the logits equal transformers';
under HSDP too, and MTP modules start from the sharded last layer. A MoE checkpoint's experts, sharded along the
expert dimension by FSDP2 or expert parallelism, are read each by the rank that holds them and by no other."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers
from checkpoint_reads import recording_safe_open
from safetensors.torch import load_file
from test_parallel import _spawn, assert_close

from arbor.config.model import ModelConfig
from arbor.config.parallel import ParallelConfig
from arbor.config.trainer import TrainerConfig
from arbor.models import build_model, hf
from arbor.models.hf import checkpoint_layout
from arbor.models.lora import apply_lora, lora_parameters
from arbor.trainer.loop import build_sharded
from arbor.trainer.parallel import ParallelDims, reshard

pytestmark = pytest.mark.slow  # spawns two processes

CPU = torch.device("cpu")
BF16_REL = 4e-2  # logits in bf16 compute against fp32 (tests/trainer/test_bf16_parallel.py)
IDS = torch.tensor([[5, 9, 200, 7, 31, 8, 100, 3]])


def _write(path: Path, arch: str, **shape) -> str:
    config = transformers.AutoConfig.for_model(
        {
            "LlamaForCausalLM": "llama",
            "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3",
            "Qwen3MoeForCausalLM": "qwen3_moe",
        }[arch],
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        architectures=[arch],
        **shape,
    )
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return str(path)


def _peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: its own, where getrusage's maxrss carries the parent's
    across the spawn's exec)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def _cfg(path: str, world: int, impl: str = "auto", **model) -> TrainerConfig:
    return TrainerConfig(
        model=ModelConfig(name=path, tokenizer="byte", impl=impl, **model), parallel=ParallelConfig(nproc=world)
    )


def _check_against_transformers(model, path: str, what: str, rel: float = 1e-5) -> None:
    """Every parameter equals the checkpoint's, every buffer both models hold is transformers' own, and the logits
    agree (`rel`: the compute dtype's)."""
    from torch.distributed.tensor import DTensor

    state = load_file(str(Path(path) / "model.safetensors"))
    for name, p in model.named_parameters():
        if "lora_" not in name:
            full = (p.full_tensor() if isinstance(p, DTensor) else p).cpu()
            assert torch.equal(full, state[name].float()), f"{what}: {name} differs from the checkpoint"
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    own = dict(model.named_buffers())
    for name, buf in ref.named_buffers():  # RoPE's inverse frequencies: computed at build, not loaded
        assert name not in own or torch.equal(own[name].cpu(), buf), f"{what}: buffer {name}"
    device = next(model.parameters()).device
    with torch.no_grad():
        assert_close(model(IDS.to(device)).float().cpu(), ref(IDS).logits, f"{what} logits", rel)
    reshard(model)  # FSDP2 keeps the root gathered after a forward


def _worker(rank: int, world: int, warm: str, big: str, tied: str) -> None:
    dims = ParallelDims.from_config(ParallelConfig(nproc=world), world)
    build_sharded(_cfg(warm, world), dims, CPU)  # the imports and code paths, paid before measuring
    full_mb = sum(meta.numel() for _, meta in checkpoint_layout(big).values()) * 4 / 2**20  # headers only
    before = _peak_rss_mb()  # the process's peak so far: nothing above its present size was allocated yet
    model, _ = build_sharded(_cfg(big, world), dims, CPU)  # arbor's native Llama
    peak = _peak_rss_mb() - before
    # This rank's half of the fp32 model and a layer being read (measured 0.52); the old build held all of it plus
    # the bf16 checkpoint (>= 1.5).
    assert peak < 0.75 * full_mb, f"rank {rank}: building took {peak:.0f} MB of host memory, the model {full_mb:.0f}"
    _check_against_transformers(model, big, "llama")

    # production's dtype: fp32 masters, bf16 compute (FSDP2's mixed precision)
    lora = {"rank": 4, "target_modules": ["q_proj", "v_proj"]}
    model, _ = build_sharded(_cfg(tied, world, "transformers", lora=lora, dtype="bfloat16"), dims, CPU)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    _check_against_transformers(model, tied, "tied qwen2 on the transformers path, with LoRA, in bf16", BF16_REL)
    plain = build_model(ModelConfig(name=tied, tokenizer="byte", impl="transformers"))
    apply_lora(plain, _cfg(tied, world, lora=lora).model.lora, 0)
    want = dict(lora_parameters(plain))
    for name, p in lora_parameters(model):
        assert torch.equal(p.full_tensor(), want[name]), name


def _hsdp_and_mtp_worker(rank: int, world: int, tied: str, qwen3: str) -> None:
    """HSDP (2 replicas of 1 shard: each rank holds whole tensors, replicated) reads the same weights; a Qwen3
    checkpoint without MTP layers starts `model.mtp_depth = 1`'s module from its last decoder layer on sharded
    parameters."""
    from torch.distributed.tensor import DTensor

    hsdp = TrainerConfig(
        model=ModelConfig(name=tied, tokenizer="byte", impl="transformers"),
        parallel=ParallelConfig(nproc=world, dp_replicate=world),
    )
    model, _ = build_sharded(hsdp, ParallelDims.from_config(hsdp.parallel, world), CPU)
    assert isinstance(model.model.embed_tokens.weight, DTensor)
    _check_against_transformers(model, tied, "tied qwen2 under HSDP")

    fsdp = ParallelDims.from_config(ParallelConfig(nproc=world), world)
    model, _ = build_sharded(_cfg(qwen3, world, mtp_depth=1), fsdp, CPU)
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p) for n, p in model.named_parameters()}
    last, h = model.args.num_hidden_layers - 1, model.args.hidden_size
    block = [n for n in full if n.startswith("mtp.0.block.")]
    assert block and all(torch.equal(full[n], full[n.replace("mtp.0.block.", f"model.layers.{last}.")]) for n in block)
    assert torch.equal(full["mtp.0.eh_proj.weight"], torch.cat([torch.zeros(h, h), torch.eye(h)], 1))
    assert all(torch.equal(full[f"mtp.0.{n}.weight"], torch.ones(h)) for n in ("enorm", "hnorm", "shared_head.norm"))


def _moe_worker(rank: int, world: int, moe: str) -> None:
    """A MoE layer's experts, sharded along the expert dimension by FSDP2 or by expert parallelism: each rank
    reads only its own experts' checkpoint tensors, and the model equals an unsharded build of the checkpoint."""
    from torch.distributed.tensor import DTensor

    read: list[str] = []
    hf.safe_open = recording_safe_open(read)  # a spawned process of its own: nothing to restore
    whole = build_model(ModelConfig(name=moe, tokenizer="byte"))
    want = dict(whole.named_parameters())
    for what, parallel in [("fsdp", ParallelConfig(nproc=world)), ("ep", ParallelConfig(nproc=world, ep=world))]:
        read.clear()
        cfg = TrainerConfig(model=ModelConfig(name=moe, tokenizer="byte"), parallel=parallel)
        model, _ = build_sharded(cfg, ParallelDims.from_config(parallel, world), CPU)
        experts = {int(m.group(1)) for n in read if (m := re.search(r"\.experts\.(\d+)\.", n))}
        assert experts == set(range(4 * rank, 4 * rank + 4)), f"{what}: rank {rank} read experts {sorted(experts)}"
        assert len(read) == len({n for n in read if ".experts." not in n}) + 2 * 4 * 3  # 2 layers x 4 experts x 3
        for name, p in model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            assert torch.equal(full, want[name]), f"{what}: {name}"


def _checkpoints(tmp_path: Path) -> tuple[str, str, str]:
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=300)
    warm = _write(tmp_path / "warm", "LlamaForCausalLM", **small, tie_word_embeddings=False)
    big = _write(
        tmp_path / "llama", "LlamaForCausalLM", hidden_size=512, intermediate_size=1408, num_hidden_layers=16,
        vocab_size=8192, tie_word_embeddings=False,
    )  # fmt: skip
    tied = _write(tmp_path / "qwen2", "Qwen2ForCausalLM", **small, tie_word_embeddings=True)
    return warm, big, tied


def test_two_ranks_build_a_checkpoint_without_holding_it(tmp_path):
    _spawn(_worker, *_checkpoints(tmp_path))


def test_each_rank_reads_only_its_own_experts(tmp_path):
    moe = _write(
        tmp_path / "qwen3-moe", "Qwen3MoeForCausalLM", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, head_dim=8, vocab_size=300,
    )  # fmt: skip
    _spawn(_moe_worker, moe)


def test_hsdp_and_mtp_modules_of_a_sharded_build(tmp_path):
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=300)
    tied = _write(tmp_path / "qwen2", "Qwen2ForCausalLM", **small, tie_word_embeddings=True)
    qwen3 = _write(tmp_path / "qwen3", "Qwen3ForCausalLM", **small, head_dim=8, tie_word_embeddings=False)
    _spawn(_hsdp_and_mtp_worker, tied, qwen3)


def _gpu_worker(rank: int, world: int, warm: str, big: str, tied: str) -> None:
    cuda = torch.device("cuda", rank)
    dims = ParallelDims.from_config(ParallelConfig(nproc=world), world)
    build_sharded(_cfg(warm, world, dtype="bfloat16"), dims, cuda)  # CUDA's own host memory, paid before
    full_mb = sum(meta.numel() for _, meta in checkpoint_layout(big).values()) * 4 / 2**20
    before = _peak_rss_mb()
    model, _ = build_sharded(_cfg(big, world, dtype="bfloat16"), dims, cuda)
    peak = _peak_rss_mb() - before
    assert peak < 0.25 * full_mb, f"building on the GPU took {peak:.0f} MB of host memory, the model {full_mb:.0f}"
    assert all(p.is_cuda for p in model.parameters()) and all(b.is_cuda for b in model.buffers())
    _check_against_transformers(model, big, "llama on the GPU", 1e-3)  # fp32 masters, no autocast here
    lora = {"rank": 4, "target_modules": ["q_proj", "v_proj"]}
    model, _ = build_sharded(_cfg(tied, world, "transformers", lora=lora, dtype="bfloat16"), dims, cuda)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    _check_against_transformers(model, tied, "tied qwen2 on the GPU with LoRA", 1e-3)


@pytest.mark.gpu(reason="a checkpoint read straight into CUDA memory: nothing of the model stays on the host")
def test_one_gpu_builds_a_checkpoint_without_a_host_copy(tmp_path):
    _spawn(_gpu_worker, *_checkpoints(tmp_path), world=1, backend="nccl")
