"""What arbor reads of a transformers checkpoint's `config.json` (`HFArgs`, the transformers path's args class):
kept apart from the family descriptor (arbor.models.families.transformers) and the model
(arbor.models.hf_causal), which both use it. No torch here: preflight reads configs through it."""

from __future__ import annotations

import dataclasses
from typing import Any

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
"""`config.layer_types` entries that are softmax attention; any other (Qwen3.5's `linear_attention`, Mamba
mixers) is a recurrent layer: no packed rows, no prefix-tree mask, no KV cache (`HFArgs.recurrent`)."""


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

    def _get(self, name: str, default: Any = None) -> Any:
        value = _text(self.config).get(name)
        return default if value is None else value

    @property
    def vocab_size(self) -> int:
        return int(self._get("vocab_size"))

    @property
    def hidden_size(self) -> int:
        return int(self._get("hidden_size"))

    @property
    def num_hidden_layers(self) -> int:
        return int(self._get("num_hidden_layers"))

    @property
    def num_attention_heads(self) -> int:
        return int(self._get("num_attention_heads"))

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
        return list(self._get("layer_types", ["full_attention"] * self.num_hidden_layers))

    @property
    def vision(self) -> bool:
        """Whether the checkpoint is a vision-language model (a `vision_config`: arbor.models.hf_vision)."""
        return isinstance(self.config.get("vision_config"), dict)

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps recurrent state instead of attending (`ATTENTION_LAYER_TYPES`)."""
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
