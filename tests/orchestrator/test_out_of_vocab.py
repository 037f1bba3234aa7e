"""A sampled id outside the tokenizer's ids is refused where it enters, at the orchestrator's client: one line
naming the server and the sample, the group dropped and counted (`client/out_of_vocab`, `generate/failed_groups`),
instead of an index error in the trainer's vocabulary-flat logprobs (a head wider than its tokenizer, e.g.
Qwen3's 151,936 rows for 151,669 ids, served by vLLM under speculative decoding, which keeps the padding-row mask
off)."""

from __future__ import annotations

import asyncio

import pytest
from test_router import FakeBackend

from arbor.orchestrator.client import InferenceClient, InferenceError, OutOfVocabulary


async def _generate(vocab_size: int | None, request_id: str | None = "group-3"):
    backend = FakeBackend("b0")  # answers every completion with token id 7
    url = await backend.start()
    try:
        async with InferenceClient([url], 5.0, 0, vocab_size=vocab_size) as client:
            try:
                out = await client.generate([1, 2], 1, 4, 1.0, 1.0, request_id=request_id)
            except InferenceError as e:
                return client, e
            return client, out
    finally:
        await backend.stop()


def test_an_out_of_vocabulary_id_fails_the_group_in_one_line_naming_server_and_sample():
    client, err = asyncio.run(_generate(vocab_size=7))
    assert isinstance(err, OutOfVocabulary) and isinstance(err, InferenceError)  # a failed group, skipped
    message = str(err)
    assert "\n" not in message
    assert "127.0.0.1" in message and "token id 7" in message and "7 ids" in message
    assert "sample 0 of request group-3" in message
    assert client.out_of_vocab == 1


@pytest.mark.parametrize("vocab_size", [8, None])
def test_ids_inside_the_vocabulary_or_an_unchecked_client_pass(vocab_size):
    client, out = asyncio.run(_generate(vocab_size))
    assert [c.token_ids for c in out] == [[7]] and client.out_of_vocab == 0
