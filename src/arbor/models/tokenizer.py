"""Tokenizers behind one small protocol: the built-in byte tokenizer (no download) and Hugging Face tokenizers.

Chat templates return token ids, never re-tokenised text, so that multi-turn prompts can be extended exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, Sequence


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int
    pad_token_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus ChatML special tokens; the chat template is Qwen's ChatML without a system default."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    name = "byte"

    def __init__(self) -> None:
        self.special_ids = {tok: 256 + i for i, tok in enumerate(self.SPECIALS)}
        self.id_to_special = {i: tok for tok, i in self.special_ids.items()}
        self.vocab_size = 256 + len(self.SPECIALS)
        self.pad_token_id = self.special_ids["<|endoftext|>"]
        self.eos_token_id = self.special_ids["<|im_end|>"]
        self.im_start = self.special_ids["<|im_start|>"]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if not skip_special_tokens:
                out.append(self.id_to_special.get(i, ""))
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        ids: list[int] = []
        for m in messages:
            ids += [self.im_start, *self.encode(f"{m['role']}\n{m['content']}"), self.eos_token_id, *self.encode("\n")]
        if add_generation_prompt:
            ids += [self.im_start, *self.encode("assistant\n")]
        return ids

    def save(self, path: str | Path) -> None:
        """Writes a marker so that a saved model directory reloads with this tokenizer."""
        (Path(path) / "arbor_tokenizer.json").write_text(json.dumps({"type": "byte"}))


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (tokenizer.json / tokenizer_config.json)."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        self.path = str(path)
        self.name = self.path
        self.tok = AutoTokenizer.from_pretrained(self.path)
        self.vocab_size = len(self.tok)
        eos = self.tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in self.tok.get_vocab() else None
        self.eos_token_id = eos if eos is not None else self.tok.eos_token_id
        if self.eos_token_id is None:
            raise ValueError(f"tokenizer at {self.path} has no eos token")
        self.pad_token_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return self.encode(text)

    def save(self, path: str | Path) -> None:
        self.tok.save_pretrained(str(path))


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """`None` or "byte" gives the built-in byte tokenizer; a directory gives the tokenizer saved there."""
    if path is None or str(path) == "byte":
        return ByteTokenizer()
    p = Path(path)
    marker = p / "arbor_tokenizer.json"
    if marker.exists() and json.loads(marker.read_text()).get("type") == "byte":
        return ByteTokenizer()
    if not p.is_dir():
        raise FileNotFoundError(f"tokenizer directory {p} does not exist")
    return HFTokenizer(p)
