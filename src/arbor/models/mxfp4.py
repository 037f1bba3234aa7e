"""OpenAI's MXFP4 checkpoint format (gpt-oss as published), read by dequantisation.

A quantised tensor `X` of shape `[*lead, in, out]` (gpt-oss's experts: `gate_up_proj [E, hidden, 2 * inter]`,
`down_proj [E, inter, hidden]`) is stored transposed and blocked along its input dimension, per the OCP
Microscaling spec: `X_blocks` uint8 `[*lead, out, in / 32, 16]`, two FP4 E2M1 codes a byte (the low nibble is
the earlier element), and `X_scales` uint8 `[*lead, out, in / 32]`, one E8M0 exponent per block of 32 (value =
code * 2^(scale - 127)). Every value is exact in bfloat16 (two significant bits), so dequantising loses nothing;
arbor trains and publishes the unquantised tensor under the name `X` (arbor.models.quantization says which
checkpoints are read this way).
"""

from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 FP4 E2M1 values by code (bit 3 is the sign)."""
BLOCKS, SCALES = "_blocks", "_scales"
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`blocks [*lead, out, G, 16]` (uint8) and `scales [*lead, out, G]` (uint8 or float8_e8m0fnu) -> the tensor
    `[*lead, G * 32, out]` in `dtype`. Meta inputs give a meta tensor of that shape (a checkpoint's layout is
    checked before any data is read). One leading index at a time, so the int64 code indices stay small."""
    *lead, out, groups, width = blocks.shape
    if blocks.dtype != torch.uint8 or width != 16 or tuple(scales.shape) != (*lead, out, groups):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} ({blocks.dtype}) and scales {tuple(scales.shape)} are not "
            "uint8 [..., rows, G, 16] and [..., rows, G]"
        )
    shape = (*lead, groups * 32, out)
    if blocks.is_meta or scales.is_meta:
        return torch.empty(shape, dtype=dtype, device="meta")
    if scales.dtype == torch.float8_e8m0fnu:
        scales = scales.view(torch.uint8)
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    flat_blocks, flat_scales = blocks.reshape(-1, out, groups, 16), scales.reshape(-1, out, groups)
    result = torch.empty(flat_blocks.shape[0], groups * 32, out, dtype=dtype, device=blocks.device)
    for i in range(flat_blocks.shape[0]):
        codes = flat_blocks[i].long()
        values = torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=-1).reshape(out, groups, 32)
        exponents = flat_scales[i].to(torch.int32) - SCALE_BIAS
        result[i] = torch.ldexp(values, exponents[..., None]).reshape(out, groups * 32).T.to(dtype)
    return result.reshape(shape)


def dequantize_mxfp4_state(
    state: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors with every `X_blocks` + `X_scales` pair replaced by the dequantised `X`; the others as
    they are. A pair with one half missing is refused in one line (a checkpoint read in parts keeps a layer's
    tensors together: arbor.models.hf.checkpoint_groups)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(BLOCKS) and tensor.dtype == torch.uint8:
            base = name[: -len(BLOCKS)]
            if base + SCALES not in state:
                raise ValueError(f"MXFP4 tensor {name} has no {base + SCALES} in the checkpoint")
            out[base] = dequantize_mxfp4(tensor, state[base + SCALES], dtype)
        elif name.endswith(SCALES) and name[: -len(SCALES)] + BLOCKS in state:
            continue
        else:
            out[name] = tensor
    return out
