"""FP8 block-scaled linear layers (arbor.models.fp8) against fp32, on CPU through the torch reference.

Error bounds used below (e4m3: 3 mantissa bits, round to nearest even, smallest normal 2^-6, subnormal spacing
2^-9). A tile/block with scale s = amax / 448 stores v = x / s; a normal v is rounded with relative error at
most half an ulp, 2^-4, and a subnormal one (|v| < 2^-6) with absolute error at most 2^-10. Hence, per element,

    |x - deq(q(x))| <= 2^-4 |x| + 2^-10 s        (EPS = 2^-4, DELTA = 2^-10 s)

and for a GEMM of two quantised operands (products of e4m3 values are exact in fp32), elementwise,

    |y_fp8 - y| <= (EPS|x| + dx) (1 + EPS)|w|^T + |x| (EPS|w| + dw)^T + (dx)(dw)^T

i.e. about 2 EPS = 1/8 of `|x| |w|^T` in the worst case; for random data the errors average out and the
relative (Frobenius) error of outputs and gradients is ~3%, asserted below at 6%.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from arbor.config.inference import InferenceConfig
from arbor.config.model import ModelConfig
from arbor.inference.vllm.model_dir import model_dir
from arbor.models import build_model
from arbor.models.args import ModelArgs
from arbor.models.fp8 import (
    BLOCK,
    FP8,
    FP8Linear,
    apply_fp8,
    block_gemm,
    block_gemm_reference,
    dequantize_blocks,
    dequantize_tiles,
    fp8_linear_forward,
    quantize_blocks,
    quantize_tiles,
)
from arbor.models.hf import hf_config

EPS = 2.0**-4
SUB = 2.0**-10
FP8_CFG = ModelConfig(name="qwen3-test", fp8="block")


def _data(*shape: int, seed: int = 0) -> torch.Tensor:
    """Gaussian values with a wide dynamic range per element (exercises subnormal codes and edge tiles)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.exp(2 * torch.randn(*shape, generator=g))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_round_trip_within_e4m3_bound():
    x = _data(7, 300)  # 300 = 2 full tiles + an edge tile of 44 channels
    q, s = quantize_tiles(x)
    assert q.dtype == FP8 and q.shape == (7, 384) and s.shape == (7, 3)
    err = (dequantize_tiles(q, s, 300) - x).abs()
    delta = SUB * s.repeat_interleave(BLOCK, 1)[:, :300]
    assert (err <= (EPS * x.abs() + delta) * (1 + 1e-6)).all()
    normal = x.abs() >= 2.0**-6 * s.repeat_interleave(BLOCK, 1)[:, :300]
    assert normal.float().mean() > 0.5 and (err[normal] <= EPS * x.abs()[normal] * (1 + 1e-6)).all()
    assert (dequantize_tiles(q, s, 300).abs().amax(1) - x.abs().amax(1)).abs().max() < 1e-6 * x.abs().max()

    w = _data(200, 130, seed=1)  # edge blocks in both dims
    wq, ws = quantize_blocks(w)
    assert wq.shape == (256, 256) and ws.shape == (2, 2)
    err = (dequantize_blocks(wq, ws, (200, 130)) - w).abs()
    delta = SUB * ws.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:200, :130]
    assert (err <= (EPS * w.abs() + delta) * (1 + 1e-6)).all()
    # Requantising dequantised values gives the same codes (the engine relies on it for published FP8 weights).
    wq2, ws2 = quantize_blocks(dequantize_blocks(wq, ws, (200, 130)))
    assert torch.equal(wq2.view(torch.uint8), wq.view(torch.uint8)) and torch.allclose(ws2, ws, rtol=1e-6)


def test_reference_gemm_is_dequantised_matmul():
    x, w = _data(9, 260), _data(140, 260, seed=1)
    xq, xs = quantize_tiles(x)
    wq, ws = quantize_blocks(w)
    y = block_gemm_reference(xq, xs, wq, ws)[:, :140]
    expect = dequantize_tiles(xq, xs, 260).double() @ dequantize_blocks(wq, ws, (140, 260)).double().T
    assert _rel(y.double(), expect) < 1e-6
    # 1x128 scales on both operands (the wgrad recipe) through the same function.
    bq, bs = quantize_tiles(w)
    y2 = block_gemm_reference(xq, xs, bq, bs)[:, :140]
    assert _rel(y2.double(), dequantize_tiles(xq, xs, 260).double() @ dequantize_tiles(bq, bs, 260).double().T) < 1e-6


def test_fp8_linear_output_and_gradients_within_bound():
    torch.manual_seed(0)
    layer = torch.nn.Linear(300, 200, bias=False)
    ref = copy.deepcopy(layer)
    layer.__class__ = FP8Linear
    x = torch.randn(4, 33, 300)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, y_ref = layer(x1), ref(x2)
    assert y.dtype == torch.float32 and y.shape == y_ref.shape
    # Elementwise worst-case bound (module docstring).
    xs = quantize_tiles(x.reshape(-1, 300))[1].repeat_interleave(BLOCK, 1)[:, :300]
    ws = quantize_blocks(ref.weight.detach())[1].repeat_interleave(BLOCK, 0)[:200].repeat_interleave(BLOCK, 1)[:, :300]
    ax, aw = x.reshape(-1, 300).abs(), ref.weight.detach().abs()
    dx, dw = SUB * xs, SUB * ws
    bound = (EPS * ax + dx) @ ((1 + EPS) * aw).T + ax @ (EPS * aw + dw).T + dx @ dw.T
    assert ((y - y_ref).detach().reshape(-1, 200).abs() <= bound * (1 + 1e-5) + 1e-6).all()
    assert _rel(y.detach(), y_ref.detach()) < 0.06
    grad = torch.randn_like(y)
    y.backward(grad)
    y_ref.backward(grad)
    assert _rel(x1.grad, x2.grad) < 0.06, "dgrad (1x128 grad tiles x 128x128 weight blocks)"
    assert _rel(layer.weight.grad, ref.weight.grad) < 0.06, "wgrad (128x1 tiles of grad and input)"
    assert layer.weight.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32


def test_apply_fp8_swaps_linear_layers_in_place_and_keeps_masters():
    model = build_model(FP8_CFG)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    swapped = apply_fp8(model, FP8_CFG)
    assert len(swapped) == 2 * 7 and "lm_head" not in swapped
    assert isinstance(model.model.layers[0].self_attn.q_proj, FP8Linear)
    assert type(model.lm_head) is torch.nn.Linear
    assert dict(model.named_parameters()) == params and list(model.state_dict()) == keys  # same tensors, same names
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert (
        apply_fp8(model, FP8_CFG) == [] and apply_fp8(build_model(ModelConfig(name="qwen3-test")), ModelConfig()) == []
    )

    moe = build_model(ModelConfig(name="qwen3-moe-test", fp8="block"))
    names = apply_fp8(moe, FP8_CFG)
    assert names and all("self_attn" in n or ".mlp." in n for n in names)
    assert not any(n.endswith("mlp.gate") or "experts" in n for n in names), (
        "router and routed experts stay high precision"
    )
    moe(torch.randint(0, 256, (1, 12))).sum().backward()  # runs, gradients reach the masters


def _train(fp8: bool, steps: int) -> list[float]:
    torch.manual_seed(0)
    cfg = ModelConfig(name="qwen3-tiny", fp8="block" if fp8 else "none")
    model = build_model(cfg)
    apply_fp8(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        # Arithmetic sequences with a per-row stride: learnable in context.
        start, stride = torch.randint(0, 64, (8, 1), generator=g), torch.randint(1, 5, (8, 1), generator=g)
        ids = (start + stride * torch.arange(65)) % 64 + 32
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_tiny_model_trains_with_fp8_and_tracks_fp32(capsys):
    torch.set_num_threads(1)
    steps = 40
    ref, fp8 = _train(False, steps), _train(True, steps)
    ref_end, fp8_end = sum(ref[-5:]) / 5, sum(fp8[-5:]) / 5
    with capsys.disabled():
        print(
            f"\nloss start {ref[0]:.4f}/{fp8[0]:.4f}, end (mean of last 5) fp32 {ref_end:.4f} fp8 {fp8_end:.4f} "
            f"({(fp8_end - ref_end) / ref_end:+.2%})"
        )
    assert ref_end < 0.6 * ref[0], "the fp32 run must learn"
    assert abs(fp8[0] - ref[0]) < 0.01 * ref[0]
    # Both curves are still falling steeply at step 40, where a small phase shift is a few % of the loss
    # (measured with one thread: fp32 1.360, fp8 1.390, +2.2%).
    assert abs(fp8_end - ref_end) < 0.05 * ref_end
    assert max(abs(a - b) / b for a, b in zip(fp8, ref)) < 0.1, "the curves track at every step"


def test_fp8_checkpoint_format_and_loading(tmp_path):
    from arbor.models.hf import save_checkpoint_dir
    from arbor.models.tokenizer import ByteTokenizer

    model = build_model(FP8_CFG)
    save_checkpoint_dir(model.state_dict(), model.args, tmp_path, ByteTokenizer(), fp8=True)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    tensors = load_file(str(tmp_path / "model.safetensors"))
    q = tensors["model.layers.0.mlp.down_proj.weight"]
    assert q.dtype == FP8 and q.shape == (32, 64)  # stored unpadded, as DeepSeek's checkpoints are
    assert tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 1)
    emb = tensors["model.embed_tokens.weight"]  # tied with lm_head: high precision, as in DeepSeek-V3
    assert emb.dtype == torch.float32 and "model.embed_tokens.weight_scale_inv" not in tensors
    loaded = build_model(ModelConfig(name=str(tmp_path)))  # dequantised on load
    w = model.model.layers[0].mlp.down_proj.weight
    assert torch.equal(loaded.model.layers[0].mlp.down_proj.weight, dequantize_blocks(*quantize_blocks(w), w.shape))
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize("name", ["qwen3-test", "dsa-test"])
def test_engine_fp8_logprobs_match_trainer(tmp_path, name):
    """Trainer (fp32 masters, FP8 forward over packed rows) vs the local engine (FP8 checkpoint as published,
    dequantised, same FP8 forward, token-by-token decoding with a KV cache): per-token activation tiles make the
    quantisation independent of how tokens are batched, so the two agree to fp32 rounding."""
    from arbor.inference.engine.core import Engine
    from arbor.inference.engine.params import SamplingParams
    from arbor.models.attention import position_ids_for
    from arbor.models.hf import save_checkpoint_dir
    from arbor.models.tokenizer import ByteTokenizer
    from arbor.trainer.parallel_state import ParallelState
    from arbor.trainer.step import packed_logprobs

    cfg = ModelConfig(name=name, fp8="block")
    tok = ByteTokenizer()
    trainer = build_model(cfg)
    trainer.init_weights(0, std=0.3)
    state = ParallelState(vocab=tok.vocab_size)  # as `parallelize` prepares it: the policy spans the tokenizer's ids
    assert apply_fp8(trainer, cfg)
    save_checkpoint_dir(trainer.state_dict(), trainer.args, tmp_path / "step_1", fp8=True)
    served = build_model(cfg)
    apply_fp8(served, cfg)
    prompts = [tok.encode(p) for p in ("hello fp8", "block scaled")]
    engine = Engine(served.eval(), tok, seq_len=64, max_batch_size=4, seed=0).start()
    try:
        assert engine.update_weights(tmp_path / "step_1", 1).result(timeout=60) == 1
        outs = [engine.submit(p, SamplingParams(max_tokens=10, temperature=0)) for p in prompts]
        completions = [f.result(timeout=120).completions[0] for f in outs]
    finally:
        engine.stop()
    rows = [p + c.token_ids for p, c in zip(prompts, completions)]
    ids = torch.tensor([t for r in rows for t in r])
    lens = [len(r) for r in rows]
    with torch.no_grad():
        lp, _ = packed_logprobs(
            trainer, ids, position_ids_for(lens)[0], lens, 1.0, torch.device("cpu"), False, state=state
        )
    at = 0
    worst = 0.0
    for p, c, n in zip(prompts, completions, lens):
        mine = lp[at + len(p) : at + n]  # logprob of token t is at position t (shifted_logprobs' convention)
        worst = max(worst, (mine - torch.tensor(c.logprobs)).abs().max().item())
        at += n
    assert worst < 1e-4, f"trainer/engine logprob mismatch {worst:.2e}"
    # Without FP8 on the engine side the mismatch is the FP8 error itself (far larger): the check has teeth.
    plain = build_model(cfg)
    plain.load_state_dict(trainer.state_dict())
    with torch.no_grad():
        lp_plain, _ = packed_logprobs(plain, ids, position_ids_for(lens)[0], lens, 1.0, torch.device("cpu"), False)
    assert (lp_plain - lp).abs().max().item() > 100 * max(worst, 1e-7)


def test_trainer_and_engine_builders_apply_fp8():
    """`parallelize` swaps first (here with activation checkpointing on one rank: same gradients as the plain FP8
    model) and the engine builder gives inference the same FP8 layers."""
    from arbor.config.trainer import TrainerConfig
    from arbor.inference.engine.core import build_engine
    from arbor.trainer.parallel import ParallelDims, parallelize

    cfg = TrainerConfig(model=FP8_CFG, parallel={"activation_checkpointing": True})
    model = build_model(FP8_CFG)
    parallelize(model, ParallelDims(1, 1, 1, 1, 1), cfg, "cpu")
    plain = build_model(FP8_CFG)
    apply_fp8(plain, FP8_CFG)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    model(ids).square().mean().backward()
    plain(ids).square().mean().backward()
    assert isinstance(model.model.layers[1].mlp.up_proj, FP8Linear)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-9), name
    engine, _ = build_engine(InferenceConfig(model={"name": "qwen3-test", "fp8": "block"}))
    assert isinstance(engine.model.model.layers[0].self_attn.o_proj, FP8Linear)


def _fsdp_worker(rank: int, world: int, out_path: str) -> None:
    from torch.distributed.tensor import DTensor

    from arbor.config.trainer import TrainerConfig
    from arbor.trainer.parallel import ParallelDims, parallelize

    cfg = TrainerConfig(model=FP8_CFG)
    model = build_model(FP8_CFG)
    parallelize(model, ParallelDims.from_world(), cfg, "cpu")
    assert isinstance(model.model.layers[0].self_attn.q_proj, FP8Linear)
    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    # Each rank one row of 128 tokens: the wgrad's 128-token tiles are the same as on one rank with both rows.
    logits = model(ids[rank : rank + 1])
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[rank, 1:])
    loss.backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}
    losses = [torch.zeros(()) for _ in range(world)]
    torch.distributed.all_gather(losses, loss.detach())
    if rank == 0:
        torch.save({"loss": torch.stack(losses).mean(), "grads": grads}, out_path)


@pytest.mark.slow
def test_fsdp2_two_ranks_fp8_matches_one_rank(tmp_path):
    from test_parallel import _spawn

    out = tmp_path / "fsdp.pt"
    _spawn(_fsdp_worker, str(out))
    got = torch.load(out)
    model = build_model(FP8_CFG)
    apply_fp8(model, FP8_CFG)
    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    logits = model(ids)
    loss = torch.stack([torch.nn.functional.cross_entropy(logits[r, :-1], ids[r, 1:]) for r in range(2)]).mean()
    loss.backward()
    assert abs(got["loss"].item() - loss.item()) <= 1e-5 * abs(loss.item())
    for name, p in model.named_parameters():
        err = (got["grads"][name] - p.grad).abs().max().item()
        assert err <= 1e-5 * p.grad.abs().max().item() + 1e-9, f"{name}: {err:.3g}"


@pytest.mark.gpu(reason="DeepGEMM and torch._scaled_mm FP8 GEMM kernels (Hopper)")
@pytest.mark.parametrize("backend", ["deep_gemm", "scaled_mm"])
def test_gpu_gemm_matches_reference(backend):
    """The Hopper kernels against the reference on the same quantised operands: forward, dgrad and wgrad shapes."""
    from arbor.models.fp8 import _deep_gemm

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("block-scaled FP8 GEMMs need Hopper or newer")
    if backend == "deep_gemm" and _deep_gemm() is None:
        pytest.skip("DeepGEMM is not installed (scripts/install_deep_kernels.sh) and vLLM's copy is absent")
    x, w = _data(256, 512).cuda(), _data(384, 512, seed=1).cuda()
    xq, xs = quantize_tiles(x)
    wq, ws = quantize_blocks(w)
    y = block_gemm(xq, xs, wq, ws, backend).float()
    assert _rel(y, block_gemm_reference(xq, xs, wq, ws)) < 1e-2  # bf16 output, fp32 accumulation
    gq, gs = quantize_tiles(x.t())  # 1x128 x 1x128 (wgrad)
    bq, bs = quantize_tiles(w.t()[:, :256].contiguous())
    yw = block_gemm(gq, gs, bq, bs, backend, wgrad=True).float()
    assert _rel(yw, block_gemm_reference(gq, gs, bq, bs)) < 1e-4
    layer = torch.nn.Linear(512, 384, bias=False, device="cuda", dtype=torch.bfloat16)
    ref = copy.deepcopy(layer).float()
    layer.__class__ = FP8Linear
    layer.fp8_backend = backend
    xin = x.bfloat16().requires_grad_()
    out = layer(xin)
    out.float().sum().backward()
    with torch.no_grad():
        expect = fp8_linear_forward(x.bfloat16(), layer.weight, "reference")
    assert _rel(out.float(), expect.float()) < 1e-2 and _rel(out.float(), ref(x).float()) < 0.06
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()


def test_config_and_vllm_checkpoint_dir(tmp_path, monkeypatch):
    from pydantic import ValidationError

    from arbor.config.rl import RLConfig

    with pytest.raises(ValidationError, match="fp8"):
        ModelConfig(fp8="e5m2")
    with pytest.raises(ValidationError, match="model.fp8 = 'block' needs weights.kind = 'filesystem'"):
        InferenceConfig(backend="vllm", model={"fp8": "block"}, weights={"kind": "nccl", "nccl_inference_ranks": 1})
    rl = RLConfig(model={"name": "qwen3-test", "fp8": "block"})
    assert rl.trainer.model.fp8 == rl.inference.model.fp8 == rl.orchestrator.model.fp8 == "block"

    # vLLM gets a DeepSeek-format FP8 checkpoint: presets and plain checkpoints are quantised once...
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    path, skip_tok = model_dir(InferenceConfig(backend="vllm", model={"name": "qwen3-test", "fp8": "block"}))
    assert path.endswith("-fp8") and not skip_tok  # the byte tokenizer's Hugging Face export is written with it
    assert json.loads((tmp_path / "arbor-vllm" / path.rsplit("/", 1)[1] / "config.json").read_text())[
        "quantization_config"
    ]
    assert load_file(path + "/model.safetensors")["model.layers.1.self_attn.o_proj.weight"].dtype == FP8
    # ... a checkpoint already in that format is served as it is.
    assert model_dir(InferenceConfig(backend="vllm", model={"name": path, "fp8": "block"}))[0] == path


@pytest.mark.slow  # quantises two checkpoints (~10 s)
def test_fp8_moe_checkpoints_keep_routers_and_experts_as_arbor_trains_them(tmp_path, monkeypatch):
    """An MoE model's FP8 checkpoint for vLLM: attention and dense projections block-FP8, the routers and routed
    experts in the model's dtype (arbor trains them so) and listed in `modules_to_not_convert`, which vLLM's fp8
    method reads as the layers it serves unquantised (next test). An FP8 MoE checkpoint whose experts are
    quantised is quantised again our way."""
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    path, _ = model_dir(InferenceConfig(backend="vllm", model={"name": "qwen3-moe-test", "fp8": "block"}))
    quant = json.loads((Path(path) / "config.json").read_text())["quantization_config"]
    args = build_model(ModelConfig(name="qwen3-moe-test")).args
    keep = quant["modules_to_not_convert"]
    assert keep == [f"model.layers.{i}.mlp.{m}" for i in args.moe_layers for m in ("gate", "experts")]
    tensors = load_file(path + "/model.safetensors")
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == FP8
    assert tensors["model.layers.0.mlp.gate.weight"].dtype != FP8
    assert tensors["model.layers.0.mlp.experts.0.up_proj.weight"].dtype != FP8
    assert not any(k.startswith("model.layers.0.mlp.experts.") and k.endswith("weight_scale_inv") for k in tensors)
    # served as it is: it is already in this form
    assert model_dir(InferenceConfig(backend="vllm", model={"name": path, "fp8": "block"}))[0] == path
    # an FP8 checkpoint that quantised its experts (no modules_to_not_convert) is re-quantised our way
    other = tmp_path / "experts-fp8"
    shutil.copytree(path, other)
    cfg = json.loads((other / "config.json").read_text())
    del cfg["quantization_config"]["modules_to_not_convert"]
    (other / "config.json").write_text(json.dumps(cfg))
    assert model_dir(InferenceConfig(backend="vllm", model={"name": str(other), "fp8": "block"}))[0] != str(other)


VLLM_SKIPS = """
import json, sys
from vllm.model_executor.layers.quantization.fp8 import Fp8Config
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
cfg = Fp8Config.from_config(json.loads(sys.argv[1]))
print(json.dumps({p: is_layer_skipped(p, cfg.ignored_layers) for p in sys.argv[2:]}))
"""


@pytest.mark.slow
@pytest.mark.vllm
def test_vllms_fp8_method_serves_the_listed_moe_layers_unquantised():
    """vLLM's own config parser and layer matcher (in a process of its own: importing vLLM here would change
    what later tests see) read arbor's FP8 MoE `quantization_config` as: routers and routed experts unquantised
    (its unquantised fused-MoE method), attention in block FP8."""
    args = build_model(ModelConfig(name="qwen3-moe-test")).args
    quant = hf_config(args, fp8=True)["quantization_config"]
    moe = [f"model.layers.{i}.mlp.{m}" for i in args.moe_layers for m in ("experts", "gate")]
    attention = ["model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.qkv_proj"]
    res = subprocess.run(
        [sys.executable, "-c", VLLM_SKIPS, json.dumps(quant), *moe, *attention],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    skipped = json.loads(res.stdout.strip().splitlines()[-1])
    assert all(skipped[m] for m in moe) and not any(skipped[a] for a in attention), skipped


def test_published_fp8_step_loads_everywhere(tmp_path):
    """The trainer's FP8 publish: DeepSeek-format shards + manifest, read back by the transport and `load_weights`."""
    from arbor.models.hf import load_weights
    from arbor.weights.transport import FilesystemTransport

    model = build_model(FP8_CFG)
    step = FilesystemTransport().publish(tmp_path, 1, model.state_dict(), model.args, fp8=True)
    tensors = FilesystemTransport().load(step)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == FP8
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" in tensors
    other = build_model(ModelConfig(name="qwen3-test", init_seed=7))
    load_weights(other, step)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(other.model.layers[0].self_attn.q_proj.weight, dequantize_blocks(*quantize_blocks(q), q.shape))


def _serve_fp8_and_compare(tmp_path, args) -> None:
    """Serves a checkpoint of `args` with vLLM in block FP8, loads an FP8 update, and compares a completion's
    logprobs with arbor's FP8 forward of the update's weights (vLLM computes in bf16)."""
    pytest.importorskip("vllm")

    from vllm_server import post_json, vllm_server  # starts vLLM: only the GPU tests need it

    from arbor.models.hf import save_checkpoint_dir
    from arbor.models.qwen3 import Qwen3ForCausalLM
    from arbor.models.qwen3_moe import Qwen3MoeForCausalLM
    from arbor.trainer.step import shifted_logprobs
    from arbor.weights.transport import FilesystemTransport

    cls = Qwen3MoeForCausalLM if args.is_moe else Qwen3ForCausalLM
    base, new = cls(args), cls(args)
    base.init_weights(0, std=0.05)
    new.init_weights(1, std=0.05)
    save_checkpoint_dir(base.state_dict(), args, tmp_path / "model")
    published = FilesystemTransport().publish(tmp_path / "run", 1, new.state_dict(), args, fp8=True)
    with vllm_server(tmp_path, tmp_path / "model", 128, "--model.fp8", "block", dtype="bfloat16") as url:
        assert post_json(url, "/update_weights", {"path": str(published), "version": 1})["policy_version"] == 1
        prompt = [5, 17, 99, 3, 42]
        out = post_json(
            url, "/v1/completions", {"prompt": prompt, "max_tokens": 16, "temperature": 1.0, "logprobs": 0, "seed": 3}
        )
        (c,) = out["choices"]
        apply_fp8(new, FP8_CFG)
        ids = torch.tensor(prompt + c["token_ids"])
        with torch.no_grad():
            ref, _ = shifted_logprobs(new(ids[None])[0], ids, temperature=1.0, with_entropy=False)
        got = torch.tensor(c["logprobs"]["token_logprobs"])
        assert (got - ref[len(prompt) :]).abs().max().item() < 0.1


FP8_SERVED = dict(
    vocab_size=264,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=128,
    rope_theta=10_000.0,
    max_position_embeddings=512,
)
"""A Qwen3 whose projections are multiples of 128, as vLLM's block-FP8 layers need."""


@pytest.mark.gpu(reason="vLLM's block-FP8 linear kernels (DeepGEMM/CUTLASS) and arbor's FP8 GEMMs are CUDA only")
def test_real_vllm_serves_block_fp8_like_the_trainer(tmp_path):
    """`inference --backend vllm` with model.fp8 = "block": the served checkpoint and an update are DeepSeek-format
    FP8, and the completion's logprobs match arbor's FP8 forward of the trainer's weights."""
    _serve_fp8_and_compare(tmp_path, ModelArgs(**FP8_SERVED))


@pytest.mark.gpu(reason="vLLM's block-FP8 linear and fused-MoE kernels are CUDA only")
def test_real_vllm_serves_block_fp8_moe_with_routers_and_experts_as_trained(tmp_path):
    """The same for an MoE model (glm5_swe's layout): attention in block FP8, routers and routed experts in bf16
    as arbor trains them (`modules_to_not_convert`), served by vLLM's unquantised fused-MoE method."""
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
    _serve_fp8_and_compare(tmp_path, ModelArgs(**FP8_SERVED, **moe))
