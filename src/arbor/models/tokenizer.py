"""Tokenizers behind one small protocol: the built-in byte tokenizer (no download) and Hugging Face tokenizers.

Chat templates return token ids, never re-tokenised text, so multi-turn prompts extend exactly; tools are exposed
through the template (the byte tokenizer appends a compact block to the system message). The byte tokenizer saves
itself as a Hugging Face tokenizer too, so vLLM serves arbor's presets with the same ids (docs/models.md,
"Tokenizers").
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """What arbor's code asks of a tokenizer (every `tokenizer: Tokenizer` parameter); `ByteTokenizer` and
    `HFTokenizer` implement it (tests/models/test_tokenizer_protocol.py)."""

    name: str
    """"byte" for the byte tokenizer, else where it was loaded from."""
    vocab_size: int
    eos_token_id: int
    """The token that ends a completion: a chat template's end of an assistant turn (ChatML's <|im_end|>, Llama
    3's <|eot_id|>, Gemma's <end_of_turn>), else the tokenizer's end of text. SFT targets end with it."""
    stop_token_ids: tuple[int, ...]
    """Every token a completion stops at, `eos_token_id` first: also the tokenizer's own end of text and the
    checkpoint's generation eos ids (generation_config.json), as vLLM stops at them."""
    pad_token_id: int
    has_chat_template: bool
    """Whether `apply_chat_template` can render chat messages (a base model's tokenizer often cannot)."""
    prompt_prefix: list[int]
    """Ids the tokenizer itself puts before a text (a base model's BOS: Llama, Mistral, Gemma; none for Qwen or the
    byte tokenizer): a raw prompt starts with them, as the model saw every text in pre-training (a chat template
    writes its own)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]: ...

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str: ...

    def encode_rendered(self, text: str) -> list[int]: ...

    def save(self, path: str | Path) -> None:
        """Writes the tokenizer into the directory `path` (a Hugging Face tokenizer's files, which servers load)."""
        ...


TOOL_INSTRUCTION = 'Call a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call>'

CHATML_TEMPLATE = (  # one line, no incidental whitespace: every newline below is one the byte template writes
    # the tools block: one `_tool_line` per tool, then TOOL_INSTRUCTION
    "{% set ns = namespace(block='', args=[], content='') %}"
    "{% if tools %}{% set ns.block = '# Tools\\n' %}{% for t in tools %}"
    "{% set fn = t['function'] if t['function'] is defined else t %}"
    "{% set params = fn['parameters'] if fn['parameters'] else {} %}"
    "{% set required = params['required'] if params['required'] else [] %}"
    "{% set props = params['properties'] if params['properties'] else {} %}"
    "{% set ns.args = [] %}{% for name in props %}"
    "{% set ns.args = ns.args + [name ~ ('' if name in required else '?') ~ ': ' ~ (props[name]['type'] "
    "if props[name]['type'] is defined else 'any')] %}{% endfor %}"
    "{% set ns.block = ns.block ~ fn['name'] ~ '(' ~ ns.args | join(', ') ~ ')' ~ (' - ' ~ fn['description'] "
    "if fn['description'] else '') ~ '\\n' %}{% endfor %}"
    "{% set ns.block = ns.block ~ '" + TOOL_INSTRUCTION + "' %}"
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\n{{ ns.block }}<|im_end|>\n{% endif %}"
    "{% endif %}"
    # tool results as a user turn, structured tool calls (mapping arguments) written out after the content; the
    # text builds up in the namespace since a `set` inside a loop does not outlive it
    "{% for m in messages %}"
    "{% set ns.content = m['content'] if m['content'] else '' %}"
    "{% if m['role'] == 'tool' %}{% set ns.content = '<tool_response>\\n' ~ ns.content ~ '\\n</tool_response>' %}"
    "{% endif %}"
    "{% for call in (m['tool_calls'] if m['tool_calls'] else []) %}"
    "{% set f = call['function'] if call['function'] is defined else call %}"
    "{% set args = f['arguments'] if f['arguments'] is defined else {} %}"
    "{% set ns.content = ns.content ~ '<tool_call>' ~ {'name': f['name'], 'arguments': args} | tojson "
    "~ '</tool_call>' %}"
    "{% endfor %}"
    "{% if loop.first and ns.block and m['role'] == 'system' %}{% set ns.content = ns.content ~ '\\n\\n' ~ ns.block %}"
    "{% endif %}"
    "<|im_start|>{{ 'user' if m['role'] == 'tool' else m['role'] }}\n{{ ns.content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The byte tokenizer's template (`ByteTokenizer.render_chat`: ChatML, tools in the system message, tool calls and
results as text) as Jinja, for its Hugging Face export: what vLLM renders for a byte-tokenizer model."""


def _tool_line(tool: dict) -> str:
    fn = tool.get("function", tool)
    params = fn.get("parameters") or {}
    required = set(params.get("required") or [])
    args = ", ".join(
        f"{name}{'' if name in required else '?'}: {spec.get('type', 'any')}"
        for name, spec in (params.get("properties") or {}).items()
    )
    desc = fn.get("description") or ""
    return f"{fn['name']}({args})" + (f" - {desc}" if desc else "")


def _byte_messages(messages: list[dict], tools: list[dict] | None) -> list[tuple[str, str]]:
    """(role, content) pairs of the byte template: tools folded into the system message, tool results and
    structured tool calls written out as text."""
    out: list[tuple[str, str]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call)
            args = fn.get("arguments", {})
            args = json.loads(args) if isinstance(args, str) else args
            call_json = json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)  # as Jinja's tojson
            content += f"<tool_call>{call_json}</tool_call>"
        out.append((role, content))
    if tools:
        block = "# Tools\n" + "".join(_tool_line(t) + "\n" for t in tools) + TOOL_INSTRUCTION
        if out and out[0][0] == "system":
            out[0] = ("system", out[0][1] + "\n\n" + block)
        else:
            out.insert(0, ("system", block))
    return out


def _byte_symbols() -> list[str]:
    """One printable character per byte, as Hugging Face's byte-level models spell bytes: printable Latin-1
    bytes stand for themselves, the others are moved to code points from 256 upwards in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def byte_tokenizer_files(specials: Sequence[str], eos: str, pad: str) -> dict[str, dict]:
    """`tokenizer.json` and `tokenizer_config.json` of the byte tokenizer: byte b is token b, special i is 256+i."""
    vocab = {sym: b for b, sym in enumerate(_byte_symbols())}
    added = [
        {
            "id": 256 + i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, tok in enumerate(specials)
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "pad_token": pad,
        "bos_token": None,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
        "chat_template": CHATML_TEMPLATE,
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
    }
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config}


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus ChatML special tokens; the chat template is Qwen's ChatML without a system default."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    name = "byte"
    has_chat_template = True

    def __init__(self) -> None:
        self.special_ids = {tok: 256 + i for i, tok in enumerate(self.SPECIALS)}
        self.id_to_special = {i: tok for tok, i in self.special_ids.items()}
        self.vocab_size = 256 + len(self.SPECIALS)
        self.pad_token_id = self.special_ids["<|endoftext|>"]
        self.eos_token_id = self.special_ids["<|im_end|>"]
        self.stop_token_ids = (self.eos_token_id,)
        self.im_start = self.special_ids["<|im_start|>"]
        self.prompt_prefix: list[int] = []

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

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        # Contents are encoded as bytes (a literal "<|im_end|>" in a message stays text, never a control token).
        ids: list[int] = []
        for role, content in _byte_messages(messages, tools):
            ids += [self.im_start, *self.encode(f"{role}\n{content}"), self.eos_token_id, *self.encode("\n")]
        if add_generation_prompt:
            ids += [self.im_start, *self.encode("assistant\n")]
        return ids

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        text = "".join(
            f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in _byte_messages(messages, tools)
        )
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def encode_rendered(self, text: str) -> list[int]:
        """Template text to ids, with the ChatML special tokens recognised."""
        ids: list[int] = []
        pos = 0
        while pos < len(text):
            hits = [(text.find(tok, pos), tok) for tok in self.SPECIALS if tok in text[pos:]]
            if not hits:
                ids += self.encode(text[pos:])
                break
            at, tok = min(hits)
            ids += self.encode(text[pos:at]) + [self.special_ids[tok]]
            pos = at + len(tok)
        return ids

    def save(self, path: str | Path) -> None:
        """Writes a marker so that a saved model directory reloads with this tokenizer, and its Hugging Face
        export (for vLLM and other Hugging Face consumers of the directory)."""
        files = {
            "arbor_tokenizer.json": {"type": "byte"},
            **byte_tokenizer_files(self.SPECIALS, eos=self.SPECIALS[2], pad=self.SPECIALS[0]),
        }
        for name, content in files.items():
            # Only what changed, each file replaced whole: a directory a running server reads is refreshed
            # safely (a cached vLLM copy of a preset gets a newer export's template).
            target, text = Path(path) / name, json.dumps(content, ensure_ascii=False)
            if not target.exists() or target.read_text() != text:
                tmp = target.with_name(f".{name}.{os.getpid()}.tmp")
                tmp.write_text(text)
                os.replace(tmp, target)


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (tokenizer.json / tokenizer_config.json)."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer  # seconds to import: only Hugging Face tokenizers pay for it

        self.path = str(path)
        self.name = self.path
        self.tok = AutoTokenizer.from_pretrained(self.path)
        self.vocab_size = len(self.tok)
        self.has_chat_template = bool(self.tok.chat_template)
        # A chat model's completion ends where its template ends an assistant turn; a base model's at its eos.
        turn_end = _turn_end(self.tok) if self.has_chat_template else None
        generation = _generation_eos(Path(self.path))
        ends = [turn_end, self.tok.eos_token_id, *generation]
        self.stop_token_ids = tuple(dict.fromkeys(i for i in ends if i is not None and 0 <= i < self.vocab_size))
        if not self.stop_token_ids:
            raise ValueError(
                f"tokenizer at {self.path} has no eos token (no eos_token in tokenizer_config.json, no eos_token_id "
                "in generation_config.json or config.json): a completion could not end"
            )
        self.eos_token_id = self.stop_token_ids[0]
        self.pad_token_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_token_id
        self.prompt_prefix = _leading_specials(self.tok)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # No clean-up of spaces: decoded text must match the template's text exactly (multi-turn prefixes).
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt, tools))

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        return self.tok.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode_rendered(self, text: str) -> list[int]:
        """Template text to ids; HF tokenizers split out their added (special) tokens themselves."""
        return self.encode(text)

    def save(self, path: str | Path) -> None:
        self.tok.save_pretrained(str(path))


def _leading_specials(tok) -> list[int]:
    """The ids `tok` adds before a text when asked for its special tokens (its post-processor's BOS)."""
    bare = tok.encode("a", add_special_tokens=False)
    full = tok.encode("a", add_special_tokens=True)
    at = next((i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare), 0)
    return list(full[:at])


TURN_PROBE = "arbor: the reply ends here"


def _turn_end(tok) -> int | None:
    """The special token `tok`'s chat template closes an assistant turn with (the first non-blank token after a
    rendered reply's text: <|im_end|>, <|eot_id|>, <end_of_turn>, </s>...); None where the template renders no such
    turn or closes it with plain text."""
    try:
        text = tok.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": TURN_PROBE}], tokenize=False
        )
    except Exception:  # a template with its own rules (roles, order): no turn end to learn from it
        return None
    if not isinstance(text, str) or TURN_PROBE not in text:
        return None
    after = tok.encode(text[text.rindex(TURN_PROBE) + len(TURN_PROBE) :], add_special_tokens=False)
    first = next((i for i in after if tok.decode([i]).strip()), None)
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    return first if first in special else None


def _generation_eos(path: Path) -> list[int]:
    """The eos ids the checkpoint at `path` generates until: generation_config.json's `eos_token_id` (an id or a
    list: Llama 3 and Gemma chat models end with more than one), else config.json's; [] for neither."""
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return [e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)]
    return []


def tokenizer_has_template(tokenizer: Tokenizer) -> bool:
    """Whether `tokenizer` can render chat messages (a base model's Hugging Face tokenizer often cannot); a
    tokenizer that does not say is taken to have one."""
    return bool(getattr(tokenizer, "has_chat_template", True))


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
    if is_vision_dir(p):
        # torch, PIL and transformers' processors: only a vision-language checkpoint's tokenizer pays for them
        from arbor.models.vision import VisionTokenizer

        return VisionTokenizer(p)
    return HFTokenizer(p)


def is_vision_dir(path: Path) -> bool:
    """Whether `path` holds a vision-language checkpoint with its processor (a `vision_config` and an image
    processor's config), whose prompts may carry images (arbor.models.vision)."""
    config = path / "config.json"
    has_processor = (path / "processor_config.json").exists() or (path / "preprocessor_config.json").exists()
    return has_processor and config.exists() and "vision_config" in json.loads(config.read_text())
