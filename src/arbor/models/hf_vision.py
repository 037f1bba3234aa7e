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
from arbor.models.hf_attention import ATTN_IMPLEMENTATION, ArborAttention, SlotCache, carry_to_attention
from arbor.models.hf_causal import HFCausalLM, build_hf, head_transform, hf_config
from arbor.models.qwen3 import HeadFn, linear_weight

VISION_TOWER_MODES = ("frozen", "trainable")
"""`model.vision_tower`: the tower's parameters are left out of the optimizer (frozen) or trained with the rest."""


def sample_spans(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """The samples of a packed row `[T]` (arbor positions restart at 0 at each sample) as (start, end)."""
    starts = (position_ids == 0).nonzero().flatten().tolist() or [0]
    if starts[0] != 0:
        starts = [0, *starts]
    return list(zip(starts, [*starts[1:], int(position_ids.shape[0])]))


_NOT_QWEN_VL = (
    "model.name: {} is not a Qwen-VL-style model (a `language_model` decoder with 3-D rotary positions); arbor's "
    "vision-language path serves Qwen2-VL, Qwen2.5-VL and Qwen3-VL"
)


class HFVisionLM(HFCausalLM):
    """A transformers vision-language model with arbor's forward (see the module docstring)."""

    def __init__(self, args: HFArgs) -> None:
        nn.Module.__init__(self)
        self.args = args
        config = hf_config(args)
        if not hasattr(config, "text_config"):
            raise UnsupportedArchitecture(_NOT_QWEN_VL.format(args.architecture))
        config.text_config._attn_implementation = ATTN_IMPLEMENTATION
        config.vision_config._attn_implementation = "sdpa"
        self.head_scale, self.logit_softcap = head_transform(args, config)
        hf = build_hf(args, config)
        for name, child in hf.named_children():
            self.add_module(name, child)
        inner = getattr(self, "model", None)
        if not hasattr(inner, "language_model") or not hasattr(inner, "get_rope_index"):
            raise UnsupportedArchitecture(_NOT_QWEN_VL.format(args.architecture))
        # The decoder stack where arbor's parallelisation looks for it (`model.model.layers`): an alias in the
        # instance's dict, not a registered child, so parameter names stay the checkpoint's.
        object.__setattr__(inner, "layers", inner.language_model.layers)
        self._hf = [hf]
        for layer in inner.layers:
            carry_to_attention(layer)
        self.train()
        self.image_token_id = int(config.image_token_id)
        self.start_token_id = int(config.vision_start_token_id)
        self.merge = int(config.vision_config.spatial_merge_size)

    def image_tokens(self, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Placeholder tokens per image `[I]`."""
        return image_grid_thw.prod(-1) // (self.merge * self.merge)

    def placeholders(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, image_grid_thw: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Which tokens of one packed row `[T]` stand for image patches (`[T]` int, 1 = placeholder), and each
        sample's grids. The row's grids are matched in order to runs of the image token that follow a vision-start
        token and have exactly the grid's token count; an image token the policy sampled in a completion matches no
        grid and stays a text token (as it was when the engine decoded it)."""
        types = torch.zeros_like(input_ids, dtype=torch.int)
        n_grids = 0 if image_grid_thw is None else int(image_grid_thw.shape[0])
        counts = [] if image_grid_thw is None else self.image_tokens(image_grid_thw).tolist()
        used, per_sample = 0, []
        ids = input_ids.tolist()
        for start, end in sample_spans(position_ids):
            first, i = used, start
            while i < end and used < n_grids:
                n = counts[used]
                if ids[i] == self.start_token_id and ids[i + 1 : i + 1 + n] == [self.image_token_id] * n:
                    types[i + 1 : i + 1 + n] = 1
                    used, i = used + 1, i + 1 + n
                else:
                    i += 1
            per_sample.append(image_grid_thw[first:used] if used > first else None)
        if used != n_grids:
            raise ValueError(f"the row carries {n_grids} images but only {used} match placeholder runs in its prompts")
        return types, per_sample

    def mrope_positions(self, input_ids: torch.Tensor, position_ids: torch.Tensor, types, grids) -> torch.Tensor:
        """Rotary positions `[3, 1, T]` of one packed row `[T]`: each sample's own, from its ids, its placeholder
        tokens and its images' grids (`placeholders`)."""
        pieces = []
        for (start, end), sample_grids in zip(sample_spans(position_ids), grids):
            pos, _ = self.model.get_rope_index(input_ids[None, start:end], types[None, start:end], sample_grids)
            pieces.append(pos[:, 0])
        return torch.cat(pieces, dim=1)[:, None]

    def rope_delta(self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None) -> int:
        """A prompt's (rotary position - sequence index) after its last token: what every later token adds."""
        if image_grid_thw is None:
            return 0
        positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        types, (grids,) = self.placeholders(input_ids, positions, image_grid_thw)
        _, delta = self.model.get_rope_index(input_ids[None], types[None], grids)
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
        embeds = self.model.get_input_embeddings()(input_ids)
        if rope_positions is None or pixel_values is not None:
            if B != 1:
                raise ValueError("a vision-language forward with images or without rope_positions takes one row")
            types, grids = self.placeholders(input_ids[0], position_ids[0], image_grid_thw)
            if rope_positions is None:
                rope_positions = self.mrope_positions(input_ids[0], position_ids[0], types, grids)
            if pixel_values is not None:
                features = self.model.get_image_features(pixel_values, image_grid_thw, return_dict=True)
                features = torch.cat(features.pooler_output).to(embeds.dtype)
                embeds = embeds.masked_scatter(types.bool()[None, :, None].to(embeds.device), features)
        ctx = ArborAttention(attn_mask, position_ids, kv_cache, cache_slots)
        out = self.model.language_model(inputs_embeds=embeds, position_ids=rope_positions, use_cache=False, arbor=ctx)
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
