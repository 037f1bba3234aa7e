"""End-to-end `rl` on the multi-turn tool_use environment (CPU, tiny model, real processes and HTTP API)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import qwen_bpe_tokenizer

from arbor.models.hf import save_checkpoint_dir
from arbor.models.presets import PRESETS
from arbor.models.qwen3 import Qwen3ForCausalLM
from arbor.monitor.metrics import read_jsonl
from arbor.run_dir import rollout_rank_file as rank_file
from arbor.transport.files import read_step

pytestmark = pytest.mark.slow


def test_tool_use_runs_end_to_end_with_context_truncation(tmp_path):
    """The example recipe, shrunk: episodes of up to 3 turns (the untrained model is nudged when it neither calls
    a tool nor answers), the context trimmed to the last turn, so branches reach the trainer with masked
    environment tokens."""
    _run_and_check(tmp_path / "run", "qwen3-test")


def test_tool_use_runs_end_to_end_with_the_151k_bpe_vocabulary(tmp_path, qwen_bpe):
    """The same run from a local checkpoint: Qwen's 151k BPE tokenizer with its tool template and a Qwen3 of
    151,680 embedding rows (tiny hidden size); no token the engine sampled is a padding row. One group of four
    episodes a step (the trainer's logprobs over 151k columns cost ~3 ms a token here, and the steps' prompts carry
    the tool template's ~600 tokens)."""
    args = dataclasses.replace(PRESETS["qwen3-test"], vocab_size=qwen_bpe_tokenizer.MODEL_VOCAB)
    model = Qwen3ForCausalLM(args)
    model.init_weights(0)  # as the presets are initialised
    save_checkpoint_dir(model.state_dict(), args, tmp_path / "ckpt", qwen_bpe)
    batch = _run_and_check(tmp_path / "run", str(tmp_path / "ckpt"), "--orchestrator.batch-size", "4")
    for mb in batch.micro_batches:
        assert bool((mb.input_ids[mb.loss_mask] < qwen_bpe.vocab_size).all())


def _run_and_check(out, model: str, *extra: str):
    argv = [
        sys.executable,
        "-m",
        "arbor.launch.rl",
        "@",
        "examples/tool_use/rl.toml",
        "--output-dir",
        str(out),
        "--model.name",
        model,
        "--seq-len",
        "512",
        "--max-steps",
        "2",
        "--sft.steps",
        "0",
        "--orchestrator.batch-size",
        "8",
        "--orchestrator.sampling.max-tokens",
        "16",
        "--orchestrator.environment.max-turns",
        "3",
        "--orchestrator.environment.context.keep-turns",
        "1",
        *extra,
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    last = rows[-1]
    assert last["episode/turns_mean"] > 1 and last["episode/branches_mean"] > 1 and last["episode/context_edits"] > 0
    assert last["env/failed"] == 0 and "reward/correct" in last and "reward/tool_penalty" in last
    batch = read_step(rank_file(out, 1, 0))
    for mb in batch.micro_batches:
        assert bool((mb.loss_mask == (mb.policy_versions >= 0)).all())  # trained exactly on the sampled tokens
        assert bool((mb.loss_weights[~mb.loss_mask] == 0).all())
    loss_tokens = sum(int(mb.loss_mask.sum()) for mb in batch.micro_batches)
    assert batch.loss_tokens_total == loss_tokens and loss_tokens <= 16 * 3 * 8  # at most max_tokens per turn
    # inserted environment tokens (tool results, nudges, template glue) sit between turns, with no loss
    inserted = [mb.loss_mask[1:] & ~mb.loss_mask[:-1] for mb in batch.micro_batches]
    assert sum(int(x.sum()) for x in inserted) > sum(len(mb.seq_lens) for mb in batch.micro_batches)
    return batch
