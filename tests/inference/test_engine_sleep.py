"""The local engine's sleep mode (a colocated run's train phase, arbor.inference.engine.sleep): level 2 frees the
weights and the KV cache, requests wait, and a wake followed by a weight update serves exactly as before; level 1
keeps the weights (a CPU engine has no other host to move them to); a sleep while sequences run is refused."""

from __future__ import annotations

import time

import pytest
from test_inference import slow_down

from arbor.config.model import ModelConfig
from arbor.inference.engine.core import Engine
from arbor.inference.engine.params import EngineBusy, SamplingParams, WeightUpdateError
from arbor.models import build_model, build_tokenizer
from arbor.models.hf import save_checkpoint_dir

PARAMS = SamplingParams(max_tokens=12, temperature=1.0, seed=3)


@pytest.fixture
def served(tmp_path):
    """An engine over the test model, its tokenizer, and the model's weights published as a directory."""
    model = build_model(ModelConfig(name="qwen3-test"))
    model.init_weights(0, std=0.3)
    save_checkpoint_dir(model.state_dict(), model.args, tmp_path / "v1")
    tok = build_tokenizer(ModelConfig(name="qwen3-test"))
    engine = Engine(model.eval(), tok, seq_len=48, max_batch_size=4, seed=0).start()
    yield engine, tok.encode("sleep well"), tmp_path / "v1"
    engine.stop()


def test_level_2_frees_weights_and_cache_and_a_wake_with_an_update_serves_the_same_tokens(served):
    engine, prompt, v1 = served
    before = engine.submit(prompt, PARAMS).result(timeout=60).completions[0].token_ids
    held = engine.held_bytes()
    assert engine.sleep(2).result(timeout=30) == held > 0
    assert engine.held_bytes() == 0 and engine.sleeping == 2
    assert all(p.numel() == 0 for p in engine.model.parameters())
    waiting = engine.submit(prompt, PARAMS)  # queued: no weights to run it with
    with pytest.raises(WeightUpdateError, match="asleep"):
        engine.update_weights(v1, 1).result(timeout=30)
    assert engine.wake_up().result(timeout=30) == held
    assert not waiting.done()  # woken from level 2: held until a weight update fills the weights
    assert engine.update_weights(v1, 1).result(timeout=60) == 1
    assert waiting.result(timeout=60).completions[0].token_ids == before


def test_level_1_keeps_a_cpu_engines_weights_and_frees_its_cache(served):
    engine, prompt, _ = served
    before = engine.submit(prompt, PARAMS).result(timeout=60).completions[0].token_ids
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    held = engine.held_bytes()
    assert engine.sleep(1).result(timeout=30) == held
    assert engine.held_bytes() == weights < held
    assert engine.sleep(1).result(timeout=30) == 0  # asleep already
    engine.wake_up().result(timeout=30)
    assert engine.submit(prompt, PARAMS).result(timeout=60).completions[0].token_ids == before


def test_a_sleep_while_sequences_run_is_refused(served):
    engine, prompt, _ = served
    slow_down(engine.model, 0.01)
    running = engine.submit(prompt, SamplingParams(max_tokens=30, temperature=1.0, seed=1))
    deadline = time.monotonic() + 60
    while engine.stats().running == 0:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    with pytest.raises(EngineBusy, match="sequence"):
        engine.sleep(2).result(timeout=30)
    assert running.result(timeout=60).completions[0].token_ids  # it ran on, undisturbed
    assert engine.sleeping == 0 and engine.held_bytes() > 0
