"""Model tests: Hugging Face parity, packed attention, KV-cache decoding, tokenizers."""

from __future__ import annotations

import json

import pytest
import torch

from arbor.config.model import ModelConfig
from arbor.models import build_model, build_tokenizer
from arbor.models.attention import packed_causal_mask, position_ids_for
from arbor.models.hf import save_checkpoint_dir
from arbor.models.tokenizer import ByteTokenizer, load_tokenizer


def _train_local_tokenizer(path):
    """A BPE tokenizer trained on a few strings, saved with a ChatML chat template (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["reverse the text please", "hello world", "the quick brown fox jumps over the lazy dog"] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(str(path))
    return fast


@pytest.mark.parametrize("tie", [True, False])
def test_hf_checkpoint_logits_match_transformers(tmp_path, tie):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fast = _train_local_tokenizer(tmp_path)
    torch.manual_seed(0)
    hf_cfg = Qwen3Config(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        rope_theta=10000.0,
    )
    hf = Qwen3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # random norms so that the q/k/layer norms are exercised, not all ones
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)

    model = build_model(ModelConfig(name=str(tmp_path))).eval()
    tok = build_tokenizer(ModelConfig(name=str(tmp_path)))
    ids = tok.apply_chat_template([{"role": "user", "content": "reverse the text please"}])
    assert ids == fast.encode(
        fast.apply_chat_template(
            [{"role": "user", "content": "reverse the text please"}], tokenize=False, add_generation_prompt=True
        ),
        add_special_tokens=False,
    )
    x = torch.tensor([ids, list(reversed(ids))])
    with torch.no_grad():
        ours = model(x)
        theirs = hf(x).logits
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_save_and_reload_roundtrip(tmp_path):
    cfg = ModelConfig(name="qwen3-test")
    model = build_model(cfg)
    save_checkpoint_dir(model.state_dict(), model.args, tmp_path, ByteTokenizer())
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    again = build_model(ModelConfig(name=str(tmp_path)))
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    assert isinstance(build_tokenizer(ModelConfig(name=str(tmp_path))), ByteTokenizer)


def test_presets_initialise_identically_in_every_process():
    a = build_model(ModelConfig(name="qwen3-test", init_seed=3))
    b = build_model(ModelConfig(name="qwen3-test", init_seed=3))
    c = build_model(ModelConfig(name="qwen3-test", init_seed=4))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.model.layers[0].mlp.up_proj.weight, c.model.layers[0].mlp.up_proj.weight)


def test_packed_forward_equals_separate_forwards():
    model = build_model(ModelConfig(name="qwen3-test")).eval()
    seqs = [torch.randint(0, 256, (n,)) for n in (5, 9, 3)]
    row = torch.cat(seqs)[None]
    lens = [len(s) for s in seqs]
    with torch.no_grad():
        packed = model(row, position_ids_for(lens), packed_causal_mask(lens))[0]
        alone = torch.cat([model(s[None])[0] for s in seqs])
    assert (packed - alone).abs().max().item() < 1e-5


def test_kv_cache_decoding_equals_full_forward():
    model = build_model(ModelConfig(name="qwen3-test")).eval()
    ids = torch.randint(0, 256, (1, 12))
    cache = model.make_kv_cache(num_slots=3, max_len=32)
    slot = torch.tensor([2])
    with torch.no_grad():
        full = model(ids)[0]
        pre = model(ids[:, :8], torch.arange(8)[None], kv_cache=cache, cache_slots=slot)[0]
        steps = [
            model(ids[:, t : t + 1], torch.tensor([[t]]), kv_cache=cache, cache_slots=slot)[0, 0] for t in range(8, 12)
        ]
    assert (pre - full[:8]).abs().max() < 1e-5
    assert (torch.stack(steps) - full[8:]).abs().max() < 1e-5


def test_byte_tokenizer_chat_template_and_roundtrip():
    tok = ByteTokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "héllo"}])
    assert ids[0] == tok.im_start and ids[-len("assistant\n") - 1] == tok.im_start
    assert tok.decode(tok.encode("héllo wörld")) == "héllo wörld"
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|im_start|>user\nhéllo<|im_end|>")
    assert max(ids) < tok.vocab_size <= 264
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)


def test_byte_tokenizers_hugging_face_export_renders_chats_as_it_does(tmp_path) -> None:
    """The exported Jinja template (what vLLM renders for a byte-tokenizer model) gives the byte tokenizer's own
    text: plain turns, tools (with and without a system message), tool calls with mapping arguments, tool results,
    non-ASCII text, with and without the generation prompt."""
    from transformers import AutoTokenizer  # noqa: PLC0415 (seconds to import: this test only)

    tok = ByteTokenizer()
    tok.save(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Adds two numbers.",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {}}, "required": ["a"]},
            },
        },
        {"type": "function", "function": {"name": "now"}},
    ]
    turns = [
        {"role": "user", "content": "añade 1"},
        {
            "role": "assistant",
            "content": "ok ",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": "é"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
        {"role": "assistant", "content": "2"},
    ]
    system = [{"role": "system", "content": "be brief"}]
    for messages, with_tools in [(turns[:1], None), (turns, tools), (system + turns, tools), (system + turns, None)]:
        for gen in (True, False):
            want = tok.render_chat(messages, add_generation_prompt=gen, tools=with_tools)
            assert hf.apply_chat_template(messages, add_generation_prompt=gen, tools=with_tools, tokenize=False) == want
