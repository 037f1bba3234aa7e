"""A completion ends where the model's chat template ends an assistant turn, which is not always the tokenizer's
eos: Gemma's chat models close a turn with <end_of_turn> (their eos is <eos>), Phi-3's with <|end|>, Llama 3's
with <|eot_id|>. The tokenizer finds that token by rendering a reply (`Tokenizer.eos_token_id`); SFT targets end
with it; the engine stops at it and at every other stop id (`stop_token_ids`: the tokenizer's eos, the
checkpoint's generation_config.json), and at a request's own `stop_token_ids`, which the orchestrator's client sends
so that vLLM stops at the same tokens (tests/vllm/test_vllm_backend.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tiny_chat_tokenizer import build_turn_tokenizer

from arbor.config.model import ModelConfig
from arbor.inference.engine.core import Engine
from arbor.inference.engine.params import SamplingParams
from arbor.inference.server import BackgroundServer
from arbor.models import build_model
from arbor.models.tokenizer import ByteTokenizer, HFTokenizer
from arbor.orchestrator.client import InferenceClient
from arbor.trainer.sft_data import chat_example

PHI_TEMPLATE = (  # Phi-3's layout: <|user|> ... <|end|>, the tokenizer's eos <|endoftext|>
    "{%- for message in messages %}{{ '<|' + message.role + '|>\\n' + message.content + '<|end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{%- endif %}"
)
PLAIN_TEMPLATE = (  # a template that closes a turn with text alone: the completion ends at the tokenizer's eos
    "{%- for message in messages %}{{ message.role + ': ' + message.content + '\\n\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ 'assistant: ' }}{%- endif %}"
)
CHAT = [
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "the quick"},
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": "brown fox"},
]


def _id(tok: HFTokenizer, token: str) -> int:
    return tok.tok.convert_tokens_to_ids(token)


def test_a_gemma_like_template_ends_a_completion_at_its_turn_end_not_at_its_eos(tmp_path):
    tok = HFTokenizer(build_turn_tokenizer(tmp_path))
    turn_end, eos = _id(tok, "<end_of_turn>"), _id(tok, "<eos>")
    assert tok.tok.eos_token_id == eos  # what transformers calls the eos
    assert tok.eos_token_id == turn_end and tok.stop_token_ids == (turn_end, eos)
    # SFT targets end as the template (transformers' rendering of it) ends each assistant turn.
    ids, mask = chat_example(CHAT, tok)
    rendered = tok.tok.encode(tok.tok.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)
    assert ids == rendered
    assert [i for i, m in zip(ids, mask) if m] == [
        *tok.encode("the quick"),
        turn_end,
        *tok.encode("brown fox"),
        turn_end,
    ]


def test_a_phi_like_template_and_a_checkpoints_generation_eos_ids(tmp_path):
    path = build_turn_tokenizer(tmp_path, PHI_TEMPLATE.replace("<|end|>", "<end_of_turn>"))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4, 0]}))
    tok = HFTokenizer(path)
    assert tok.stop_token_ids == (4, 1, 0)  # the turn end first, the tokenizer's eos, then the generation config's
    (path / "generation_config.json").unlink()
    (path / "config.json").write_text(json.dumps({"eos_token_id": 3}))  # without it, the model's config says
    assert HFTokenizer(path).stop_token_ids == (4, 1, 3)


def test_a_template_closing_turns_with_text_and_a_base_tokenizer_end_at_the_eos(tmp_path):
    plain = HFTokenizer(build_turn_tokenizer(tmp_path / "plain", PLAIN_TEMPLATE))
    base = HFTokenizer(build_turn_tokenizer(tmp_path / "base", None))
    assert plain.stop_token_ids == base.stop_token_ids == (1,) and not base.has_chat_template


def test_a_tokenizer_without_any_eos_is_refused_naming_where_it_looked(tmp_path):
    path = build_turn_tokenizer(tmp_path / "noeos", None, eos=None)
    with pytest.raises(ValueError, match="has no eos token .*generation_config.json") as e:
        HFTokenizer(path)
    assert "\n" not in str(e.value)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    assert HFTokenizer(path).stop_token_ids == (1,)  # the checkpoint's generation config names it


class _StopsAlso(ByteTokenizer):
    """The byte tokenizer with one more stop id, as a tokenizer with a generation config's extra eos has."""

    def __init__(self, extra: int) -> None:
        super().__init__()
        self.stop_token_ids = (self.eos_token_id, extra)


@contextlib.contextmanager
def _engine(tokenizer: ByteTokenizer) -> Iterator[Engine]:
    model = build_model(ModelConfig(name="qwen3-test"))
    model.init_weights(0, std=0.3)  # varied greedy tokens (the preset's std repeats one byte)
    engine = Engine(model.eval(), tokenizer, seq_len=64, max_batch_size=4, seed=0).start()
    try:
        yield engine
    finally:
        engine.stop()


def _greedy(engine: Engine, prompt: list[int], **kw) -> tuple[list[int], str]:
    (c,) = engine.submit(prompt, SamplingParams(max_tokens=16, temperature=0, **kw)).result(timeout=60).completions
    return c.token_ids, c.finish_reason


def _first_new(ids: list[int], at_least: int = 2) -> int:
    """An index >= at_least of a token not seen before it in `ids`."""
    return next(k for k in range(at_least, len(ids)) if ids[k] not in ids[:k])


def test_the_engine_stops_at_every_stop_id_of_the_tokenizer_and_of_the_request():
    torch.manual_seed(0)
    prompt = ByteTokenizer().encode("hello world")
    with _engine(ByteTokenizer()) as engine:
        ids, reason = _greedy(engine, prompt)
        assert reason == "length" and len(set(ids)) > 4
        k = _first_new(ids)
        assert _greedy(engine, prompt, stop_token_ids=(ids[k],)) == (ids[: k + 1], "stop")  # kept, as vLLM does
    with _engine(_StopsAlso(ids[k])) as engine:
        assert _greedy(engine, prompt) == (ids[: k + 1], "stop")


def test_the_client_sends_the_tokenizers_stop_ids_and_the_server_stops_there():
    tok = ByteTokenizer()
    prompt = tok.encode("reverse this")

    async def generate(server_url: str, stop: tuple[int, ...]):
        async with InferenceClient([server_url], timeout=60, max_retries=0, stop_token_ids=stop) as client:
            (c,) = await client.generate(prompt, 1, 16, 0.0, 1.0, 0)
            return c.token_ids, c.finish_reason

    with _engine(tok) as engine, BackgroundServer(engine, tok, model_name="qwen3-test") as srv:
        ids, reason = asyncio.run(generate(srv.url, ()))
        k = _first_new(ids)
        assert reason == "length"
        assert asyncio.run(generate(srv.url, (tok.eos_token_id, ids[k]))) == (ids[: k + 1], "stop")


def test_a_real_layout_checkpoint_dir_reads_its_generation_config(tmp_path):
    """A transformers-written checkpoint (config.json and generation_config.json as save_pretrained writes them)
    with the Gemma-like tokenizer: the stop ids are the template's turn end, the eos, and what the model's
    generation config adds."""
    import transformers

    path = build_turn_tokenizer(tmp_path)
    config = transformers.LlamaConfig(
        vocab_size=400,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        eos_token_id=[1, 4],
        bos_token_id=2,
        pad_token_id=0,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    transformers.GenerationConfig(eos_token_id=[1, 4, 3], bos_token_id=2).save_pretrained(path)
    assert HFTokenizer(Path(path)).stop_token_ids == (4, 1, 3)
