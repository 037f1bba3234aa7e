"""FP8 block-scaled linear layers as DeepSeek-V3 trains them, with a torch reference that runs anywhere.

e4m3 values, activations in 1x128 tiles and weights in 128x128 blocks, one float32 scale each; forward and both
backward GEMMs in FP8, master weights never leaving their high precision. Backends (`select_backend`): DeepGEMM
on Hopper, torch's block-scaled `scaled_mm`, else the reference, all on the same quantised operands. The format,
the backward's tile layouts and the departures: docs/models.md, "FP8"."""

from __future__ import annotations

import functools
import os
import re
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
AMAX_FLOOR = 1e-30
"""Smallest amax a tile may have, so an all-zero tile gets a finite scale. DeepGEMM's test helpers clamp at 1e-4,
which is fine for activations but not for gradients (often ~1e-5): a floor that large makes quantisation depend
on the loss scale (2 FSDP ranks each averaging half the tokens would then differ from one rank)."""
Backend = Literal["deep_gemm", "scaled_mm", "reference"]
BACKENDS = ("deep_gemm", "scaled_mm", "reference")


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = -x.shape[dim] % multiple
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return F.pad(x, pad)


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # Clamp: x / s can exceed 448 by an fp32 rounding error, and e4m3fn has no infinity to saturate to.
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_tiles(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles along the last dim: `x [M, K]` -> (e4m3 `[M, K128]`, fp32 scales `[M, K128 / 128]`), where
    K128 is K rounded up to 128 (zero padding). `dequantize_tiles` inverts it up to the e4m3 rounding."""
    x = _pad_to(x.float(), 1, BLOCK)
    M, K = x.shape
    tiles = x.view(M, K // BLOCK, BLOCK)
    scale = tiles.abs().amax(dim=-1).clamp(min=AMAX_FLOOR) / FP8_MAX
    return _cast(tiles, scale[..., None]).view(M, K), scale


def dequantize_tiles(q: torch.Tensor, scale: torch.Tensor, k: int | None = None) -> torch.Tensor:
    M, K = q.shape
    x = (q.float().view(M, K // BLOCK, BLOCK) * scale[..., None]).view(M, K)
    return x if k is None else x[:, :k]


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks: `w [N, K]` -> (e4m3 `[N128, K128]`, fp32 `weight_scale_inv [N128 / 128, K128 / 128]`)."""
    w = _pad_to(_pad_to(w.float(), 0, BLOCK), 1, BLOCK)
    N, K = w.shape
    blocks = w.view(N // BLOCK, BLOCK, K // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=AMAX_FLOOR) / FP8_MAX
    return _cast(blocks, scale[:, None, :, None]).view(N, K), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int] | None = None) -> torch.Tensor:
    """Inverse of `quantize_blocks`; `q` may be unpadded (a checkpoint's `[N, K]` weight with ceil-sized scales)."""
    N, K = q.shape
    full = scale.repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
    w = q.float() * full
    return w if shape is None else w[: shape[0], : shape[1]]


def block_gemm_reference(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """`a [M, K]` (1x128 scales `sa [M, K/128]`) times `b [N, K]`^T, `b` scaled per 128x128 block (`sb
    [N/128, K/128]`) or per 1x128 tile (`sb [N, K/128]`); fp32 `[M, N]`. Each 128-wide slice of K is
    accumulated in fp32 and promoted with its scales, as DeepGEMM's kernel does."""
    M, K = a.shape
    N = b.shape[0]
    if sb.shape[0] != N:
        sb = sb.repeat_interleave(BLOCK, 0)[:N]
    af, bf = a.float(), b.float()
    out = torch.zeros(M, N, dtype=torch.float32, device=a.device)
    with torch.autocast(a.device.type, enabled=False):  # an enclosing autocast must not round the fp32 products
        for kb in range(K // BLOCK):
            cols = slice(kb * BLOCK, (kb + 1) * BLOCK)
            out += (af[:, cols] @ bf[:, cols].T) * sa[:, kb, None] * sb[None, :, kb]
    return out


# ---------------------------------------------------------------------------------------------- GPU backends


@functools.cache
def _deep_gemm():
    """DeepGEMM's `fp8_gemm_nt`: the standalone package (see scripts/install_deep_kernels.sh), else vLLM's copy.

    Returns (function, extra kwargs keeping our fp32 scales as they are) or None."""
    try:  # optional GPU kernels (scripts/install_deep_kernels.sh); the fallbacks below cover their absence
        import deep_gemm  # optional, see above

        return deep_gemm.fp8_gemm_nt, {"disable_ue8m0_cast": True}
    except ImportError:
        pass
    try:
        from vllm.utils import deep_gemm as vdg  # optional: vLLM is an extra
    except ImportError:
        return None
    if not vdg.is_deep_gemm_supported():  # vLLM's check: its bundled or an installed DeepGEMM, on Hopper+
        return None
    return vdg.fp8_gemm_nt, {"is_deep_gemm_e8m0_used": False}


def select_backend(device: torch.device) -> Backend:
    """DeepGEMM on Hopper when importable, else torch's block-scaled `scaled_mm` on Hopper/Blackwell, else the
    reference (CPU, older GPUs). `ARBOR_FP8_BACKEND` forces one (benchmarks, debugging)."""
    forced = os.environ.get("ARBOR_FP8_BACKEND")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"ARBOR_FP8_BACKEND={forced!r}: expected one of {BACKENDS}")
        return forced  # type: ignore[return-value]
    if device.type != "cuda":
        return "reference"
    major, _ = torch.cuda.get_device_capability(device)
    if major == 9 and _deep_gemm() is not None:
        return "deep_gemm"
    if major in (9, 10):
        return "scaled_mm"
    return "reference"


def _gemm_deep_gemm(a, sa, b, sb, wgrad: bool) -> torch.Tensor:
    fn, extra = _deep_gemm()
    M, N = a.shape[0], b.shape[0]
    if wgrad:
        # Both operands 1x128 over tokens, fp32 output (the (1, 1, 128) recipe: DeepGEMM's sm90 "1d1d" kernel);
        # compiled for fixed M, N so a new token count (K here) does not trigger a JIT compile.
        out = torch.zeros(M, N, dtype=torch.float32, device=a.device)
        fn((a, sa), (b, sb), out, c=out, recipe=(1, 1, BLOCK), compiled_dims="mn", **extra)
        return out
    # 1x128 x 128x128 (the "1d2d" kernel); DeepGEMM moves the scales into its TMA-aligned layout itself.
    out = torch.empty(M, N, dtype=torch.bfloat16, device=a.device)
    fn((a, sa), (b, sb), out, recipe=(1, BLOCK, BLOCK), **extra)
    return out


def _gemm_scaled_mm(a, sa, b, sb, wgrad: bool) -> torch.Tensor:
    """cuBLASLt block-scaled GEMM. It wants `mat_b` column-major, the activation scales outer-dim-major and the
    scale dims 4-aligned: M is padded to 4 and K to 512 (zero data, unit scales)."""
    M = a.shape[0]
    a, sa = _pad_to(a.view(torch.uint8), 0, 4).view(FP8), _pad_to(sa, 0, 4)
    k_pad = -a.shape[1] % (4 * BLOCK)
    if k_pad:
        a, b = F.pad(a.view(torch.uint8), (0, k_pad)).view(FP8), F.pad(b.view(torch.uint8), (0, k_pad)).view(FP8)
        sa, sb = F.pad(sa, (0, k_pad // BLOCK), value=1.0), F.pad(sb, (0, k_pad // BLOCK), value=1.0)
    recipe_b = F.ScalingType.BlockWise1x128 if wgrad else F.ScalingType.BlockWise128x128
    # 1x128 scales of either operand are `[rows, K/128]` with the rows contiguous (strides (1, rows)); the
    # 128x128 weight scales go in transposed, `[K/128, N/128]`. (An H100 with torch 2.11 refused the wgrad's
    # `[K/128, N]`, the layout of the older `torch._scaled_mm`.)
    scale_b = sb.t().contiguous().t() if wgrad else sb.t()
    out = F.scaled_mm(
        a,
        b.t(),
        sa.t().contiguous().t(),
        F.ScalingType.BlockWise1x128,
        scale_b,
        recipe_b,
        output_dtype=torch.float32 if wgrad else torch.bfloat16,
    )
    return out[:M]


def block_gemm(a, sa, b, sb, backend: Backend, wgrad: bool = False) -> torch.Tensor:
    """`a @ b^T` of quantised operands on `backend` (float32 from the reference and the wgrad GEMM, else bf16)."""
    if backend == "deep_gemm":
        return _gemm_deep_gemm(a, sa, b, sb, wgrad)
    if backend == "scaled_mm":
        return _gemm_scaled_mm(a, sa, b, sb, wgrad)
    return block_gemm_reference(a, sa, b, sb)


# ---------------------------------------------------------------------------------------------- autograd


def fp8_linear_forward(x2d: torch.Tensor, weight: torch.Tensor, backend: Backend) -> torch.Tensor:
    """`x2d [M, K] @ weight [N, K]^T` in the block FP8 format (fp32 or bf16 `[M, N]`); no autograd."""
    N = weight.shape[0]
    xq, xs = quantize_tiles(x2d)
    wq, ws = quantize_blocks(weight)
    return block_gemm(xq, xs, wq, ws, backend)[:, :N]


class FP8LinearFunction(torch.autograd.Function):
    """`y = x W^T` with block-FP8 forward, dgrad and wgrad GEMMs (tilings in the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, backend: Backend, out_dtype: torch.dtype):
        N = weight.shape[0]
        xq, xs = quantize_tiles(x.reshape(-1, x.shape[-1]))
        wq, ws = quantize_blocks(weight)
        # The FP8 weight (a quarter of an fp32 copy) is kept for dgrad rather than quantised again.
        ctx.save_for_backward(x, wq, ws)
        ctx.backend, ctx.weight_shape, ctx.weight_dtype = backend, weight.shape, weight.dtype
        y = block_gemm(xq, xs, wq, ws, backend)[:, :N]
        return y.to(out_dtype).reshape(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, wq, ws = ctx.saved_tensors
        N, K = ctx.weight_shape
        g = grad_out.reshape(-1, N)
        x2d = x.reshape(-1, K)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            # dX = dY W: dY in 1x128 tiles along N; W's 128x128 blocks transposed with their scales.
            gq, gs = quantize_tiles(g)
            wq_t = wq.view(torch.uint8).t().contiguous().view(FP8)
            grad_x = block_gemm(gq, gs, wq_t, ws.t().contiguous(), ctx.backend)[:, :K]
            grad_x = grad_x.to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            # dW = dY^T X reduces over tokens: both quantised in 1x128 tiles along the token dimension.
            # Rows padded to 128 too, so the GPU kernels see aligned M and N (zero rows contribute nothing).
            gq_t, gs_t = quantize_tiles(_pad_to(g.t(), 0, BLOCK))
            xq_t, xs_t = quantize_tiles(_pad_to(x2d.t(), 0, BLOCK))
            grad_w = block_gemm(gq_t, gs_t, xq_t, xs_t, ctx.backend, wgrad=True)[:N, :K].to(ctx.weight_dtype)
        return grad_x, grad_w, None, None


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class FP8Linear(nn.Linear):
    """An `nn.Linear` computing in block FP8; the parameters (and their names) are the original layer's, in
    their own dtype. Made by `apply_fp8`, which swaps the class of existing layers in place."""

    fp8_backend: Backend | None = None
    """None: chosen per call from the input's device (`select_backend`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        backend = self.fp8_backend or select_backend(x.device)
        y = FP8LinearFunction.apply(x, self.weight, backend, _output_dtype(x))
        return y if self.bias is None else y + self.bias


# ---------------------------------------------------------------------------------------------- model level

_FP8_WEIGHT = re.compile(
    r"^model\.layers\.\d+\.("
    r"self_attn\.((q|k|v|o)_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|indexer\.(wq_b|wk))"
    r"|(mlp|mlp\.shared_experts?)\.(gate|up|down)_proj"
    r")\.weight$"
)
"""The layers that run in FP8: attention projections and dense/shared-expert MLPs (Qwen3; DeepSeek-V3.2 / GLM-5
MLA and indexer projections). As in DeepSeek-V3, the embedding, lm_head, norms and the MoE router (and
shared-expert gate) stay in high precision; the routed experts (stacked `GroupedExperts` weights) also stay high
precision here: their grouped GEMM is not block-quantised. MLA's `kv_b_proj` stays high precision too: the
absorbed sparse attention reads its weight directly (arbor.models.deepseek_v32), so an FP8 copy would make the
engine's dequantised weight differ from the trainer's master; the indexer's `weights_proj` stays high precision
as in DeepSeek-V3.2's checkpoints."""


def is_fp8_weight(name: str) -> bool:
    """Whether a (Hugging Face) parameter name is a weight that `apply_fp8` runs in FP8."""
    return _FP8_WEIGHT.match(name) is not None


def apply_fp8(model: nn.Module, cfg, backend: Backend | None = None) -> list[str]:
    """Turns the model's FP8-eligible `nn.Linear` layers into `FP8Linear` in place when `cfg.fp8 == "block"`
    (`cfg` is a ModelConfig) and returns their names. Parameters keep their identity, dtype and names, so it
    works before FSDP2/EP/CP and on a meta-device model, and checkpoints are unchanged."""
    if cfg.fp8 == "none":
        return []
    swapped = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear and is_fp8_weight(name + ".weight"):
            module.__class__ = FP8Linear
            module.fp8_backend = backend
            swapped.append(name)
    return swapped


# ---------------------------------------------------------------------------------------------- checkpoints

SCALE_SUFFIX = "_scale_inv"
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}
"""The `quantization_config` of DeepSeek-V3's config.json, which vLLM's `fp8` method reads (dynamic per-token-
group activation quantisation, 128x128 weight blocks, `weight_scale_inv` tensors)."""


def quantize_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> DeepSeek's FP8 checkpoint format: each FP8 layer's `weight` becomes e4m3 `[N, K]`
    plus `weight_scale_inv [ceil(N/128), ceil(K/128)]` float32; everything else is unchanged."""
    out = {}
    for k, v in state.items():
        if is_fp8_weight(k):
            q, s = quantize_blocks(v)
            out[k] = q[: v.shape[0], : v.shape[1]].contiguous()
            out[k + SCALE_SUFFIX] = s.contiguous()
        else:
            out[k] = v
    return out


def dequantize_state(state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Inverse of `quantize_state` for any e4m3 tensor with a `*_scale_inv` partner (DeepSeek/vLLM checkpoints)."""
    out = {}
    for k, v in state.items():
        if k.endswith(SCALE_SUFFIX):
            continue
        scale = state.get(k + SCALE_SUFFIX)
        if v.dtype == FP8:
            if scale is None:
                raise ValueError(f"FP8 tensor {k} has no {k + SCALE_SUFFIX} in the checkpoint")
            out[k] = dequantize_blocks(v, scale.float()).to(dtype)
        else:
            out[k] = v
    return out
