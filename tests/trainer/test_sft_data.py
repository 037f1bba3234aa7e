"""SFT data: multi-turn chats masked to their assistant turns, JSONL and parquet files."""

from __future__ import annotations

import json

import pytest

from arbor.config.model import ModelConfig
from arbor.models import build_tokenizer
from arbor.trainer.sft_data import _file_examples, chat_example
from arbor.trainer.sft_train import pack

TOK = build_tokenizer(ModelConfig(name="qwen3-test"))
CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": "ok!"},
]


def test_multi_turn_chat_is_masked_to_assistant_turns():
    ids, mask = chat_example(CHAT, TOK)
    assert ids == TOK.apply_chat_template(CHAT, add_generation_prompt=False)
    trained = [i for i, m in zip(ids, mask) if m]
    # Exactly the two assistant contents, each with its end-of-turn token; no system/user text, no markup.
    assert trained == TOK.encode("yo") + [TOK.eos_token_id] + TOK.encode("ok!") + [TOK.eos_token_id]
    ((row_ids, row_mask, lens),) = pack([(ids, mask)], 4096)
    assert row_mask.tolist() == mask and lens == [len(ids)]
    with pytest.raises(ValueError, match="assistant"):
        chat_example(CHAT[:2], TOK)


def test_jsonl_and_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "abc", "completion": "cba"}, {"messages": CHAT}]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pq.write_table(pa.Table.from_pylist([{"prompt": "abc", "completion": "cba"}]), tmp_path / "d.parquet")
    from_jsonl = _file_examples(jsonl, TOK)
    from_parquet = _file_examples(tmp_path / "d.parquet", TOK)
    assert from_parquet == from_jsonl[:1]
    ids, mask = from_jsonl[0]
    assert [i for i, m in zip(ids, mask) if m] == TOK.encode("cba") + [TOK.eos_token_id]
    assert sum(from_jsonl[1][1]) == len("yo") + len("ok!") + 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: expected keys"):
        _file_examples(bad, TOK)
