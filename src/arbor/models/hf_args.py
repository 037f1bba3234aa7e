"""What arbor reads of a transformers checkpoint's `config.json` (`HFArgs`, the transformers path's args class):
kept apart from the family descriptor (arbor.models.families.transformers) and the model
(arbor.models.hf_causal), which both use it. No torch here: preflight reads configs through it."""

from __future__ import annotations

import dataclasses
from typing import Any

from arbor.models.family import UnsupportedArchitecture

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
"""`config.layer_types` entries that are softmax attention; any other (Qwen3.5's `linear_attention`, Mamba
mixers) is a recurrent layer: no packed rows, no prefix-tree mask, no KV cache (`HFArgs.recurrent`)."""


ALIASES = {
    "vocab_size": ("padded_vocab_size",),
    "hidden_size": ("d_model", "n_embd", "dim"),
    "num_hidden_layers": ("num_layers", "n_layer", "n_layers", "decoder_layers"),
    "num_attention_heads": ("n_head", "n_heads", "num_heads", "attention_heads", "decoder_attention_heads"),
    "num_key_value_heads": ("num_kv_heads", "n_head_kv"),
    "intermediate_size": ("ffn_dim", "ffn_hidden_size", "n_inner", "decoder_ffn_dim"),
    "max_position_embeddings": ("n_positions", "max_seq_len", "seq_length"),
}
"""Other names configs give the fields arbor reads (transformers maps them by each config class's
`attribute_map`, which this torch-free reader does not load): LongCat-Flash's and XGLM's `num_layers`, GPT-style
`n_embd` / `n_head` / `n_positions`."""


BLOCK_TYPES = {"attention": "full_attention"}
"""RecurrentGemma's `block_types` words that are transformers' `layer_types` ones."""
RECURRENT_FIELD_PREFIXES = ("mamba_", "ssm_")
"""Config fields of a state-space mixer: the model keeps recurrent state whatever its layer types say."""


def _text(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's fields: a multimodal config's `text_config`, else the config itself."""
    return {**config, **config["text_config"]} if isinstance(config.get("text_config"), dict) else config


@dataclasses.dataclass
class HFArgs:
    """A transformers checkpoint's `config.json`, and what arbor reads of it (same attribute names as ModelArgs)."""

    config: dict[str, Any]
    """`config.json`'s contents, written back unchanged when arbor publishes the model."""
    architecture: str
    """`architectures[0]`, the transformers class that builds the model."""

    impl = "transformers"
    is_moe = False
    """Routing stays inside transformers' modules: arbor's MoE machinery (EP, router replay) does not apply."""
    is_dsa = False
    mtp_depth = 0

    def _need(self, name: str) -> Any:
        """A field arbor cannot do without: missing under every name it goes by is one line."""
        value = self._get(name)
        if value is None:
            names = " / ".join((name, *ALIASES.get(name, ())))
            raise UnsupportedArchitecture(f"model.name: {self.architecture}'s config.json has no {names}")
        return value

    def _get(self, name: str, default: Any = None) -> Any:
        text = _text(self.config)
        for key in (name, *ALIASES.get(name, ())):
            if text.get(key) is not None:
                return text[key]
        return default

    @property
    def vocab_size(self) -> int:
        return int(self._need("vocab_size"))

    @property
    def hidden_size(self) -> int:
        return int(self._need("hidden_size"))

    @property
    def num_hidden_layers(self) -> int:
        listed = self._get("layers_block_type") or self._get("layer_types")
        return int(
            len(listed) if listed and self._get("num_hidden_layers") is None else self._need("num_hidden_layers")
        )

    @property
    def num_attention_heads(self) -> int:
        return int(self._need("num_attention_heads"))

    @property
    def num_key_value_heads(self) -> int:
        return int(self._get("num_key_value_heads", self.num_attention_heads))

    @property
    def head_dim(self) -> int:
        return int(self._get("head_dim", self.hidden_size // self.num_attention_heads))

    @property
    def intermediate_size(self) -> int:
        return int(self._get("intermediate_size", 4 * self.hidden_size))

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self._get("tie_word_embeddings", False))

    @property
    def max_position_embeddings(self) -> int:
        return int(self._get("max_position_embeddings", 4096))

    @property
    def layer_types(self) -> list[str]:
        """Each layer's kind, in transformers' `layer_types` words, from whichever field the config lists them in
        (Nemotron-H's `layers_block_type`, RecurrentGemma's repeating `block_types`); all attention if none."""
        if self._get("layer_types") is not None:
            return list(self._get("layer_types"))
        if self._get("layers_block_type") is not None:
            return list(self._get("layers_block_type"))
        cycle = self._get("block_types")
        if cycle:
            named = [BLOCK_TYPES.get(t, t) for t in cycle]
            return [named[i % len(named)] for i in range(self.num_hidden_layers)]
        return ["full_attention"] * self.num_hidden_layers

    @property
    def vision(self) -> bool:
        """Whether the checkpoint is a vision-language model (a `vision_config`: arbor.models.hf_vision)."""
        return isinstance(self.config.get("vision_config"), dict)

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps recurrent state instead of attending (`ATTENTION_LAYER_TYPES`), or beside it
        (Falcon-H1's Mamba mixer in every layer: `mamba_*` fields)."""
        if any(k.startswith(RECURRENT_FIELD_PREFIXES) for k in _text(self.config)):
            return True
        return any(t not in ATTENTION_LAYER_TYPES for t in self.layer_types)

    @property
    def experts(self) -> tuple[int, int]:
        """(routed experts, their intermediate size); (0, 0) for a dense model."""
        n = self._get("num_local_experts") or self._get("n_routed_experts") or self._get("num_experts") or 0
        return int(n), int(self._get("moe_intermediate_size", self.intermediate_size))

    def num_params(self) -> int:
        """An estimate from the config (preflight's disk figure): attention, MLP or routed experts per layer,
        embeddings and head."""
        h, L = self.hidden_size, self.num_hidden_layers
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        n_experts, moe_i = self.experts
        mlp = n_experts * 3 * h * moe_i + n_experts * h if n_experts else 3 * h * self.intermediate_size
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return L * (h * (q + 2 * kv) + q * h + mlp + 2 * h) + emb + h
