"""Vision-language models of the transformers path (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: a `*ForConditionalGeneration`
whose config has a `vision_config`) behind arbor's model interface, with the image inputs as two more keywords:
`pixel_values [P, D]` (every image's patches, in the order the images appear in the row) and `image_grid_thw
[I, 3]` (each image's patch grid).

The decoder is transformers' own; its attention is arbor's (packed mask, slot KV cache), the vision tower's
stays transformers' SDPA. The tower runs inside the forward that sees the images' placeholder tokens (a prompt's
prefill in the engine: once per prompt; a packed row in the trainer: each sample's images) and its outputs
replace the placeholders' embeddings. Rotary positions are the model's 3-D multimodal ones (`mrope_positions`),
computed per sample from its ids and its images' grids; arbor's own `position_ids` stay the sequence index,
which the mask, the KV cache and packing read. Text tokens only carry losses: an image's placeholder tokens are
prompt tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from arbor.models.attention import KVCache
from arbor.models.family import UnsupportedArchitecture
from arbor.models.hf_args import HFArgs
from arbor.models.hf_attention import ATTN_IMPLEMENTATION, ArborAttention, SlotCache
from arbor.models.hf_causal import HFCausalLM, check_head, hf_class, hf_config
from arbor.models.qwen3 import HeadFn, linear_weight

VISION_TOWER_MODES = ("frozen", "trainable")
"""`model.vision_tower`: the tower's parameters are left out of the optimizer (frozen) or trained with the rest."""


def sample_spans(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """The samples of a packed row `[T]` (arbor positions restart at 0 at each sample) as (start, end)."""
    starts = (position_ids == 0).nonzero().flatten().tolist() or [0]
    if starts[0] != 0:
        starts = [0, *starts]
    return list(zip(starts, [*starts[1:], int(position_ids.shape[0])]))


class HFVisionLM(HFCausalLM):
    """A transformers vision-language model with arbor's forward (see the module docstring)."""

    def __init__(self, args: HFArgs) -> None:
        nn.Module.__init__(self)
        self.args = args
        config = hf_config(args)
        config.text_config._attn_implementation = ATTN_IMPLEMENTATION
        config.vision_config._attn_implementation = "sdpa"
        check_head(args, config)
        hf = hf_class(args)(config)
        for name, child in hf.named_children():
            self.add_module(name, child)
        inner = getattr(self, "model", None)
        if not hasattr(inner, "language_model") or not hasattr(inner, "get_rope_index"):
            raise UnsupportedArchitecture(
                f"model.name: {args.architecture} is not a Qwen-VL-style model (a `language_model` decoder with "
                "3-D rotary positions); arbor's vision-language path serves Qwen2-VL, Qwen2.5-VL and Qwen3-VL"
            )
        # The decoder stack where arbor's parallelisation looks for it (`model.model.layers`): an alias in the
        # instance's dict, not a registered child, so parameter names stay the checkpoint's.
        object.__setattr__(inner, "layers", inner.language_model.layers)
        self._hf = [hf]
        self.image_token_id = int(config.image_token_id)
        self.merge = int(config.vision_config.spatial_merge_size)

    def image_tokens(self, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Placeholder tokens per image `[I]`."""
        return image_grid_thw.prod(-1) // (self.merge * self.merge)

    def mrope_positions(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, image_grid_thw: torch.Tensor | None
    ) -> torch.Tensor:
        """Rotary positions `[3, 1, T]` of one packed row `[T]`: each sample's own, from its ids and the grids
        of its images (consumed in row order)."""
        types = (input_ids == self.image_token_id).to(torch.int)
        pieces, used = [], 0
        for start, end in sample_spans(position_ids):
            n_images = _runs(types[start:end])
            grids = None if image_grid_thw is None else image_grid_thw[used : used + n_images]
            if n_images and (grids is None or grids.shape[0] != n_images):
                raise ValueError(f"a sample has {n_images} images but the row carries grids for fewer")
            used += n_images
            pos, _ = self.model.get_rope_index(input_ids[None, start:end], types[None, start:end], grids)
            pieces.append(pos[:, 0])
        return torch.cat(pieces, dim=1)[:, None]

    def rope_delta(self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None) -> int:
        """A prompt's (rotary position - sequence index) after its last token: what every later token adds."""
        if image_grid_thw is None:
            return 0
        types = (input_ids == self.image_token_id).to(torch.int)
        _, delta = self.model.get_rope_index(input_ids[None], types[None], image_grid_thw)
        return int(delta.flatten()[0])

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        cache_slots: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        head_fn: HeadFn | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        rope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As HFCausalLM.forward, with the row's images; `rope_positions [3, B, T]` (the engine's, from each
        slot's rope delta) replace the per-sample ones computed from a single packed row."""
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        if rope_positions is None:
            if B != 1:
                raise ValueError("a vision-language forward without rope_positions takes one packed row")
            rope_positions = self.mrope_positions(input_ids[0], position_ids[0], image_grid_thw)
        ctx = ArborAttention(attn_mask, position_ids, kv_cache, cache_slots)
        out = self.model(
            input_ids=input_ids,
            position_ids=rope_positions,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            use_cache=False,
            arbor=ctx,
        )
        x = out.last_hidden_state
        if head_fn is not None:
            return head_fn(x, linear_weight(self.lm_head))
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return self.lm_head(x)

    def make_kv_cache(self, num_slots: int, max_len: int) -> SlotCache:
        p = next(self.parameters())
        return SlotCache(self.args.num_hidden_layers, num_slots, max_len, p.dtype, p.device)

    def set_vision_tower(self, mode: str) -> None:
        """`frozen`: the tower's parameters take no gradient (and no optimizer state); `trainable`: they do."""
        if mode not in VISION_TOWER_MODES:
            raise ValueError(f"model.vision_tower must be one of {VISION_TOWER_MODES}, got {mode!r}")
        for p in self.model.visual.parameters():
            p.requires_grad_(mode == "trainable")


def _runs(types: torch.Tensor) -> int:
    """Runs of 1s in a 0/1 vector: the images of a sample (each image's placeholders are contiguous)."""
    if types.numel() == 0:
        return 0
    starts = types[0:1].sum() + ((types[1:] == 1) & (types[:-1] == 0)).sum()
    return int(starts)
