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


def build(path: Path, strip_think: bool = False) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
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
