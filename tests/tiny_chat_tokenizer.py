"""A tiny Hugging Face tokenizer with a real (Qwen-like) jinja chat template, built locally for tests.

Byte-level BPE trained on a few sentences (decodes exactly), ChatML special tokens, and a template that renders
tools into the system turn and tool results as `<tool_response>` user turns, as Qwen3's does. With
`strip_think=True` the template drops `<think>...</think>` from past assistant turns (a history rewrite).
"""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{ '# Tools\\n<tools>' }}{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- if STRIP and message.role == 'assistant' and not loop.last and '</think>' in message.content %}"
    "{{ message.content.split('</think>')[-1].lstrip('\\n') }}"
    "{%- else %}{{ message.content }}{%- endif %}{{ '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# A newline follows every <|im_end|>, so a turn the model ended with its <|im_end|> (the eos it samples) is
# followed by template glue ("\n<|im_start|>...") that the trajectory inserts with mask 0.

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "what is 12 + 30? the answer is 42. call the calculator tool with arguments",
    "system user assistant tool response search results for paris france capital",
    '{"name": "calculator", "arguments": {"expression": "1 + 2"}}',
]


def _write_bpe(path: Path, specials: list[str]) -> None:
    """A byte-level BPE of 400 ids trained on CORPUS, `specials` first (ids 0..), saved as `path/tokenizer.json`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))


def build(path: Path, strip_think: bool = False) -> Path:
    _write_bpe(path, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    template = TEMPLATE.replace("STRIP", "true" if strip_think else "false")
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": template,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 4096,
            }
        )
    )
    return path


TURN_TEMPLATE = (  # Gemma's chat layout: turns closed by <end_of_turn>, which is not the tokenizer's eos
    "{{ bos_token }}{%- for message in messages %}"
    "{%- set role = 'model' if message.role == 'assistant' else message.role %}"
    "{{ '<start_of_turn>' + role + '\\n' + message.content + '<end_of_turn>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{%- endif %}"
)


def build_turn_tokenizer(path: Path, template: str | None = TURN_TEMPLATE, eos: str | None = "<eos>") -> Path:
    """A Gemma-like tokenizer: byte-level BPE with `<pad> <eos> <bos> <start_of_turn> <end_of_turn>` (ids 0-4),
    the tokenizer's eos `eos` (Gemma's `<eos>`: it ends a text, not a turn) and a chat template `template` that
    closes every turn with `<end_of_turn>`, as Gemma's chat models do (None: a base model's, without one)."""
    _write_bpe(path, ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "pad_token": "<pad>",
        "bos_token": "<bos>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config | ({"chat_template": template} if template else {})))
    return path
