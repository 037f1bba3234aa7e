"""The `Tokenizer` Protocol (arbor.models.tokenizer) is what every `tokenizer: Tokenizer` parameter asks for: both
built-in tokenizers implement all of it, with the Protocol's own method signatures."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from arbor.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

METHODS = [n for n, v in vars(Tokenizer).items() if callable(v) and not n.startswith("_")]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    path: Path = tmp_path_factory.mktemp("tok")
    ByteTokenizer().save(path)  # written as a Hugging Face tokenizer too
    (path / "arbor_tokenizer.json").unlink()  # so this loads as one
    return HFTokenizer(path)


@pytest.mark.parametrize("kind", ["byte", "hf"])
def test_the_builtin_tokenizers_satisfy_the_protocol(kind: str, request: pytest.FixtureRequest) -> None:
    tok = ByteTokenizer() if kind == "byte" else request.getfixturevalue("hf_tokenizer")
    assert isinstance(tok, Tokenizer)
    assert set(METHODS) >= {"encode", "decode", "apply_chat_template", "render_chat", "encode_rendered", "save"}
    for name in METHODS:
        want = list(inspect.signature(getattr(Tokenizer, name)).parameters)[1:]
        assert list(inspect.signature(getattr(tok, name)).parameters) == want, name
    for attr, kind_ in Tokenizer.__annotations__.items():
        assert isinstance(
            getattr(tok, attr),
            {"str": str, "int": int, "bool": bool, "list[int]": list, "tuple[int, ...]": tuple}[kind_],
        ), attr
    assert tok.stop_token_ids[0] == tok.eos_token_id and all(0 <= i < tok.vocab_size for i in tok.stop_token_ids)
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    assert ids and ids != tok.apply_chat_template(messages, add_generation_prompt=True)
    assert tok.decode(tok.encode("héllo")) == "héllo"
