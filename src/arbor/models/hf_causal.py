"""Any transformers causal LM behind arbor's model interface (`forward(input_ids, position_ids, attn_mask,
kv_cache, cache_slots, logits_to_keep, head_fn)`, `make_kv_cache`, `init_weights`, `args`), built from its own
`config.json` by transformers' own class, so a new architecture trains the day transformers has it.

The model's children are the transformers model's (`model`, `lm_head`), so parameter names are the module's own
and `model.model.layers` is the decoder stack FSDP2 and activation checkpointing wrap. Attention goes through
transformers' attention-function registry: `"arbor"` (arbor.models.hf_attention) applies arbor's packed or
prefix-tree mask, each layer's sliding window, sinks and soft-capping, and in the engine the slot KV cache. The
head is arbor's: the decoder's final (normed) hidden states and `lm_head`'s weight go to `head_fn`, so `[T, V]`
logits never exist; a model whose own head does more (final-logit soft-capping, logit scaling) is refused in one
line. Recurrent layers (Qwen3.5's gated delta net) see one sample per forward: a packed row is cut into its
samples, a prefix-tree row is refused, and the engine recomputes a slot's sequence (`TokenCache`).
"""

from __future__ import annotations

import functools
import json
from copy import deepcopy

import torch
import transformers
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import AutoConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
    revert_weight_conversion,
)

from arbor.models.attention import KVCache
from arbor.models.family import UnsupportedArchitecture
from arbor.models.hf_args import ATTENTION_LAYER_TYPES, HFArgs
from arbor.models.hf_attention import ATTN_IMPLEMENTATION, ArborAttention, SlotCache, TokenCache, carry_to_attention
from arbor.models.lora import LoRALinearMixin
from arbor.models.qwen3 import HeadFn, linear_weight

HEAD_SCALES = {
    "logit_scale": {"cohere": 1},
    "logits_scaling": {"granite": -1, "hyperclovax": 1},
    "output_multiplier_scale": {},
}
"""Config fields a model's own head multiplies its logits by, per model-type prefix: 1 = times the value (Cohere's
`logit_scale`, HyperCLOVA X's `logits_scaling`), -1 = divided by it (Granite's `logits_scaling`). arbor scales the
hidden states instead (exact: the head has no bias); a field with another meaning, or of another model, is refused."""

SOFTCAP_FIELDS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
"""Config fields of the `cap * tanh(logits / cap)` a model's head applies: Gemma 2 / 3 / 4's, VaultGemma's and
nanochat's, RecurrentGemma's, xLSTM's."""


def hf_config(args: HFArgs) -> transformers.PretrainedConfig:
    """The transformers config of `args.config`, attention through arbor's function."""
    raw = _special_floats(dict(args.config))
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    config._attn_implementation = ATTN_IMPLEMENTATION
    return config


def _special_floats(value):
    """transformers' JSON spelling of infinities and NaN (`{"__float__": "Infinity"}`, Falcon-H1's and
    Nemotron-H's `time_step_limit`) read back as floats, as `from_pretrained` does."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in ("Infinity", "-Infinity", "NaN"):
            return float(value["__float__"].lower().replace("infinity", "inf"))
        return {k: _special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_special_floats(v) for v in value]
    return value


def _one_line(e: BaseException) -> str:
    """`e` as `Type: first line of its message`."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def build_hf(args: HFArgs, config: transformers.PretrainedConfig) -> nn.Module:
    """The transformers model of `config`; a model that picks its attention class by name from its own table
    (GPT-J, CodeGen) has no entry for arbor's attention function: refused in one line."""
    try:
        return hf_class(args)(config)
    except KeyError as e:
        if e.args == (ATTN_IMPLEMENTATION,):
            raise UnsupportedArchitecture(
                f"model.name: {args.architecture} does not attend through transformers' attention-function "
                "registry, where arbor applies its packed-row and prefix-tree masks; this architecture cannot "
                "train on the transformers path"
            ) from None
        raise


def hf_class(args: HFArgs) -> type[nn.Module]:
    cls = getattr(transformers, args.architecture, None)
    if cls is None:
        raise UnsupportedArchitecture(
            f"model.name: transformers {transformers.__version__} has no class {args.architecture!r}"
        )
    return cls


def head_transform(args: HFArgs, config: transformers.PretrainedConfig) -> tuple[float, float]:
    """(scale, softcap) of what the model's head applies to its logits after `lm_head` (`HEAD_SCALES`, and the
    soft-capping of `SOFTCAP_FIELDS`, 0 for none); anything else after the head is refused in one line."""
    text = config.get_text_config()
    model_type = str(getattr(text, "model_type", ""))
    scale = 1.0
    for field, by_type in HEAD_SCALES.items():
        value = getattr(text, field, None)
        if value in (None, 1, 1.0, 0, 0.0):
            continue
        sign = next((v for prefix, v in by_type.items() if model_type.startswith(prefix)), None)
        if sign is None:
            raise UnsupportedArchitecture(
                f"model.name: {args.architecture} applies {field} = {value} after its head, which arbor does not "
                "know the meaning of for this model; this checkpoint cannot train on the transformers path"
            )
        scale = scale * float(value) ** sign
    caps = [getattr(text, field, None) for field in SOFTCAP_FIELDS]
    return scale, float(next((c for c in caps if c), 0.0))


DECODER_STACKS = ("layers", "h", "blocks", "decoder.layers")
"""Where a decoder keeps its layers: `model.layers` (Llama-style), `h` (GPT-2 style: GPT-BigCode, GPT-J),
`blocks` (MPT), `decoder.layers` (OPT)."""


def alias_decoder(model: nn.Module, hf: nn.Module, architecture: str) -> None:
    """Makes `model.model` the decoder, `model.model.layers` its stack and `model.lm_head` the head, whatever the
    architecture calls them (GPT-NeoX's `gpt_neox.layers` and `embed_out`, GPT-BigCode's `transformer.h`): plain
    attributes beside the registered children, so parameter names stay the checkpoint's and arbor's
    parallelisation, checkpointing and head find them where they are for Llama."""
    decoder = hf.base_model if hf.base_model is not hf else None
    stack = next((_attr(decoder, path) for path in DECODER_STACKS if _attr(decoder, path) is not None), None)
    head = hf.get_output_embeddings()
    if not isinstance(stack, nn.ModuleList) or not isinstance(head, nn.Linear):
        raise UnsupportedArchitecture(
            f"model.name: {architecture} is not a decoder-only model with a layer stack ({', '.join(DECODER_STACKS)}) "
            "and a linear head; the transformers path cannot wrap it"
        )
    if head.bias is not None:
        raise UnsupportedArchitecture(
            f"model.name: {architecture}'s head has a bias, which arbor's vocabulary-chunked logprobs do not add; "
            "this checkpoint cannot train on the transformers path"
        )
    between = [
        n
        for n, c in hf.named_children()
        if c is not decoder and c is not head and next(c.parameters(), None) is not None
    ]
    if between:
        raise UnsupportedArchitecture(
            f"model.name: {architecture} applies {', '.join(between)} between its decoder and its head, which "
            "arbor's vocabulary-chunked logprobs do not; this checkpoint cannot train on the transformers path"
        )
    for owner, name, module in ((model, "model", decoder), (decoder, "layers", stack), (model, "lm_head", head)):
        if getattr(owner, name, None) is not module:
            object.__setattr__(owner, name, module)


def _attr(module: nn.Module | None, path: str):
    for name in path.split("."):
        module = getattr(module, name, None)
    return module


class HFCausalLM(nn.Module):
    """A transformers `*ForCausalLM` with arbor's forward (see the module docstring)."""

    accepts_block_mask = False
    """The arbor attention function takes dense boolean masks (it combines them with sliding windows)..."""

    @property
    def accepts_segment_mask(self) -> bool:
        """...and a packed row's chunks (`SegmentMask`) on every device, unless the model has recurrent layers
        (`_by_sample` reads the samples off the dense mask)."""
        return not self.args.recurrent

    def __init__(self, args: HFArgs) -> None:
        super().__init__()
        self.args = args
        config = hf_config(args)
        self.head_scale, self.logit_softcap = head_transform(args, config)
        hf = build_hf(args, config)
        for name, child in hf.named_children():
            self.add_module(name, child)
        alias_decoder(self, hf, args.architecture)
        self._hf = [hf]  # a list: the transformers model is not a child (its children are ours)
        for layer in self.model.layers:
            carry_to_attention(layer)
        self.train()

    def train(self, mode: bool = True) -> "HFCausalLM":
        """Only arbor's own modules (LoRA adapters) follow `mode`: transformers' run their inference forward in
        training too, so the trainer scores a sample as the engine sampled it: no dropout (Seed-OSS ships
        attention and residual dropout 0.1), no router jitter or sampled routes (Phi-3.5-MoE's sparsemixer)."""
        super().train(mode)
        for module in self.modules():
            module.training = mode and (module is self or isinstance(module, LoRALinearMixin))
        return self

    @property
    def hf(self) -> nn.Module:
        """The transformers model whose modules these are (conversion tables, `_init_weights`)."""
        return self._hf[0]

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        kv_cache: KVCache | TokenCache | None = None,
        cache_slots: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        head_fn: HeadFn | None = None,
    ) -> torch.Tensor:
        """As Qwen3ForCausalLM.forward: `attn_mask` `[B, 1, T, T]` (True = attend) overrides causal attention;
        with `kv_cache` the mask comes from the cache; `head_fn` replaces the head."""
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        if isinstance(kv_cache, TokenCache):
            x = kv_cache.forward(self.decoder_hidden, input_ids, position_ids, cache_slots)
        elif self.args.recurrent:
            x = self._by_sample(input_ids, position_ids, attn_mask)
        else:
            x = self.decoder_hidden(
                input_ids, position_ids, ArborAttention(attn_mask, position_ids, kv_cache, cache_slots)
            )
        if self.head_scale != 1.0:  # the head's logit scale, on its input (`head_transform`)
            x = x * self.head_scale
        if head_fn is not None:  # the soft-capping is the trainer's to apply (arbor.trainer.forward.logit_softcap)
            return head_fn(x, linear_weight(self.lm_head))
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = self.lm_head(x)
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def decoder_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx: ArborAttention) -> torch.Tensor:
        """The decoder's final hidden states `[B, T, H]`, after its final norm."""
        if self._attends_through_arbor:
            return self.model(
                input_ids=input_ids, position_ids=position_ids, use_cache=False, arbor=ctx
            ).last_hidden_state
        try:
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, arbor=ctx)
        except (AttributeError, TypeError, RuntimeError) as e:
            if getattr(self.hf, "_supports_attention_backend", True):
                raise
            raise UnsupportedArchitecture(  # MPT reads transformers' causal mask, which arbor's registry leaves out
                f"model.name: {self.args.architecture} does not take transformers' attention-function registry "
                f"(its forward failed without the mask it builds itself: {type(e).__name__}: {e}); this "
                "architecture cannot train on the transformers path"
            ) from e
        self._check_attention_calls(ctx.calls)
        return out.last_hidden_state

    def check_attention(self) -> None:
        """A two-token forward (no gradient), so that a model whose layers attend by their own code is refused in
        one line when it is built (`_check_attention_calls`), before the engine's first request or the trainer's
        first step; vision-language models attend through the registry by construction (arbor.models.hf_vision)."""
        if self.args.vision or self._attends_through_arbor:
            return
        p = next(self.parameters())
        try:
            with torch.no_grad():
                self(torch.tensor([[0, 1]], device=p.device))
        except (UnsupportedArchitecture, torch.OutOfMemoryError):
            raise
        except Exception as e:  # transformers' modules broke under arbor's attention, or on their own
            own = self._own_forward_error()
            if own is not None:
                raise UnsupportedArchitecture(
                    f"model.name: {self.args.architecture}: transformers' own forward of this checkpoint fails on "
                    f"two tokens ({own}); check its config.json"
                ) from e
            raise UnsupportedArchitecture(
                f"model.name: {self.args.architecture} failed a two-token forward with arbor's attention "
                f"({_one_line(e)}) where transformers' own forward runs; this architecture cannot train on the "
                "transformers path"
            ) from e

    def _own_forward_error(self) -> str | None:
        """What transformers' own forward of the model (its eager attention, its own masks) raises on two tokens, in
        one line; None when it runs: tells a checkpoint transformers cannot run either from arbor's refusal."""
        configs = {
            id(c): c
            for m in self.hf.modules()
            if isinstance(c := getattr(m, "config", None), transformers.PretrainedConfig)
        }
        saved = {k: c._attn_implementation for k, c in configs.items()}
        if isinstance(self, FSDPModule):  # sharded: the root's parameters (embedding, head) are gathered by hand
            self.unshard()  # (the layers gather their own as transformers' forward calls them)
        try:
            for c in configs.values():
                c._attn_implementation = "eager"
            with torch.no_grad():
                self.hf(input_ids=torch.tensor([[0, 1]], device=next(self.parameters()).device), use_cache=False)
            return None
        except Exception as e:
            return _one_line(e)
        finally:
            for k, c in configs.items():
                c._attn_implementation = saved[k]

    _attends_through_arbor = False
    """Set once a forward's attention layers all ran through arbor's attention function."""

    def _check_attention_calls(self, calls: int) -> None:
        """A model whose layers attend by their own code (ALiBi models such as BLOOM, state-space models such as
        Mamba, or attention under another name) would train packed rows with attention across samples and ignore
        the prefix-tree mask: refused on its first forward, in one line."""
        expected = sum(t in ATTENTION_LAYER_TYPES for t in self.args.layer_types)
        if calls != expected:
            raise UnsupportedArchitecture(
                f"model.name: {self.args.architecture} made {calls} calls to transformers' attention-function "
                f"registry for its {expected} attention layers (one each), so arbor's packed-row and prefix-tree "
                "masks would not hold; this architecture cannot train on the transformers path"
            )
        self._attends_through_arbor = True

    def _by_sample(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None):
        """A recurrent model's packed row: its samples (the chains of the mask) right-padded into one batch, so
        that no state crosses a sample boundary. One decoder call per row whatever its samples (FSDP2's
        per-layer collectives then match across ranks); causal layers never read the padding after a sample."""
        if mask is None:
            return self.decoder_hidden(input_ids, position_ids, ArborAttention(None, position_ids, None, None))
        if input_ids.shape[0] != 1:
            raise ValueError("a recurrent model's packed forward takes one row at a time")
        m = mask[0, 0]
        T = m.shape[0]
        idx = torch.arange(T, device=m.device)
        start = m.int().argmax(-1)
        if not bool((m.sum(-1) == idx - start + 1).all()):
            raise ValueError(
                f"{self.args.architecture} has recurrent layers, which cannot take a prefix-tree merged row: "
                "set orchestrator.batching.prefix_merge = false"
            )
        sample = torch.cumsum(start == idx, 0) - 1  # each token's sample, in row order
        offset = idx - start  # its place in the sample
        n, width = int(sample[-1]) + 1, int(offset.max()) + 1
        ids = input_ids.new_zeros(n, width).index_put((sample, offset), input_ids[0])
        pos = torch.arange(width, device=m.device)[None].expand(n, width)
        hidden = self.decoder_hidden(ids, pos, ArborAttention(None, pos, None, None))
        return hidden[sample, offset][None]

    def init_weights(self, seed: int) -> None:
        """transformers' own initialisation, drawn from `seed` (same weights in every process that calls it)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.hf.apply(self.hf._init_weights)

    def make_kv_cache(self, num_slots: int, max_len: int) -> SlotCache | TokenCache:
        """A slot KV cache per attention layer (allocated on a layer's first write, at its own key and value
        widths); a recurrent model keeps each slot's tokens and recomputes (`TokenCache`)."""
        p = next(self.parameters())
        if self.args.recurrent:
            return TokenCache(num_slots, max_len, p.device)
        return SlotCache(self.args.num_hidden_layers, num_slots, max_len, p.dtype, p.device)


@functools.lru_cache(maxsize=4)
def _meta_model(config_json: str, architecture: str) -> nn.Module:
    args = HFArgs(config=json.loads(config_json), architecture=architecture)
    with torch.device("meta"):
        return hf_class(args)(hf_config(args))


def _meta(args: HFArgs) -> nn.Module:
    return _meta_model(json.dumps(args.config, sort_keys=True), args.architecture)


def checkpoint_state(state: dict[str, torch.Tensor], args: HFArgs) -> dict[str, torch.Tensor]:
    """Module names and layouts -> the checkpoint's, by transformers' own conversion tables reversed (identity
    for most models; per-expert tensors for fused MoE experts). Any subset of the model's tensors maps alone."""
    return revert_weight_conversion(_meta(args), dict(state))


def module_state(state: dict[str, torch.Tensor], args: HFArgs) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors -> the module's names and layouts, by transformers' conversion tables (as
    `from_pretrained` applies them); tensors no module holds are kept, for the caller's name check to name."""
    model = _meta(args)
    conversions = get_model_conversion_mapping(model, add_legacy=False)
    if not conversions:
        return dict(state)
    own = model.state_dict()
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {k: c for c in converters for k in c.source_patterns}
    mappings: dict[str, WeightRenaming | WeightConverter] = {}
    for key, tensor in sorted(state.items(), key=lambda kv: dot_natural_key(kv[0])):
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, own)
        if target not in own and key in own:
            target, pattern = key, None
        if pattern is not None:
            mapping = mappings.setdefault(target, deepcopy(by_pattern[pattern]))
        else:
            mapping = mappings.setdefault(target, WeightRenaming(key, target))
            pattern = key
        mapping.add_tensor(target, key, pattern, tensor)
    out = {}
    for name, mapping in mappings.items():
        for target, value in mapping.convert(name, model=model, config=model.config).items():
            out[target] = value[0] if isinstance(value, list) else value
    return out
