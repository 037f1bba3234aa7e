"""A distillation teacher served by vLLM through arbor's proxy (`inference --backend vllm`, what `rl` launches for
`[teacher] backend = "vllm"`): the orchestrator's teacher client scores samples with `prompt_logprobs`, passed
through non-streamed, and gets the same sampled-token logprobs and top-k as arbor's local engine on the same
checkpoint (the `qwen3-tiny` preset in float32, served by name; nothing is downloaded), up to one documented
difference: vLLM's prompt logprobs are the raw model's over every row of the head (its logits processors, arbor's
padding mask included, do not apply to them), the local engine's over the tokenizer's ids, so at each position
they differ by log(1 - P_pad), the padding rows' mass (about 0.02 nats on this fresh preset, ~0 for a trained
teacher)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from vllm_server import SharedServer, get_json, post_json

from arbor.config.model import ModelConfig
from arbor.config.orchestrator import TeacherConfig
from arbor.inference.engine.core import Engine
from arbor.inference.server import BackgroundServer
from arbor.models import build_model, build_tokenizer
from arbor.orchestrator.rollout import Rollout
from arbor.orchestrator.teacher import Teacher, TeacherError
from arbor.weights.transport import FilesystemTransport

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL = "qwen3-tiny"
SEQ_LEN = 128
TOL = 1e-4
"""Logprob agreement of vLLM's CPU build and the local engine in float32 (observed: 5e-7, an fp32 ulp; the
margin is for vLLM's kernels summing in another order on other CPUs)."""
TOK = build_tokenizer(ModelConfig(name=MODEL))
SAMPLES = [("reverse: abcdef", "fedcba"), ("hello vllm", " and hello teacher"), ("x", "yz")]


@pytest.fixture(scope="module")
def server(shared_vllm: SharedServer, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The session's shared server of this preset (conftest), serving the preset's own weights: an earlier module
    may have trained it (test_vllm_backend does), so they are loaded back as the next version."""
    assert shared_vllm.model == MODEL
    url = shared_vllm.url()
    version = get_json(url, "/health")["policy_version"]
    if version:
        model = build_model(ModelConfig(name=MODEL))
        path = FilesystemTransport().publish(
            tmp_path_factory.mktemp("preset"), version + 1, model.state_dict(), model.args
        )
        assert post_json(url, "/update_weights", {"path": str(path), "version": version + 1}) == {
            "policy_version": version + 1
        }
    return url


@contextlib.contextmanager
def local_teacher() -> Iterator[str]:
    model = build_model(ModelConfig(name=MODEL)).eval()
    with (
        Engine(model, TOK, seq_len=SEQ_LEN, max_batch_size=4, seed=0) as engine,
        BackgroundServer(engine, TOK, model_name=MODEL) as srv,
    ):
        yield srv.url


def real_mass_log(rollout: Rollout) -> np.ndarray:
    """log(1 - P_pad) at each position predicting a completion token: a full forward's log-mass on real ids."""
    ids = rollout.prompt_ids + rollout.completion_ids
    with torch.no_grad():
        logp = torch.log_softmax(build_model(ModelConfig(name=MODEL))(torch.tensor([ids]))[0].double(), -1)
    return logp[len(rollout.prompt_ids) - 1 : len(ids) - 1, : TOK.vocab_size].logsumexp(-1).numpy()


def scored(url: str, k: int) -> list[Rollout]:
    rollouts = [
        Rollout(
            i,
            TOK.encode(p),
            TOK.encode(c),
            [0.0] * len(TOK.encode(c)),
            [0] * len(TOK.encode(c)),
            "",
            "length",
            group_id=i,
        )
        for i, (p, c) in enumerate(SAMPLES)
    ]

    async def go() -> None:
        async with Teacher(TeacherConfig(url=url, model=MODEL, top_k=k, max_retries=0)) as teacher:
            await teacher.wait_ready()
            await teacher.score(rollouts)

    asyncio.run(go())
    return rollouts


@pytest.mark.parametrize("k", [0, 5])
def test_a_vllm_teacher_scores_like_the_local_engine(server: str, k: int) -> None:
    """Per completion token: the sampled token's logprob, and with k = 5 the top-5 logprobs of the real ids, within
    TOL of the local engine's once vLLM's full-head normalisation is accounted for (the module docstring: plus
    log(1 - P_pad) per position); the real top ids in vLLM's list are the local engine's, in order, wherever
    neighbouring logprobs are further apart than TOL (a near tie may swap); every reply's prompt_logprobs cover
    the whole sample."""
    ours = scored(server, k)
    with local_teacher() as url:
        ref = scored(url, k)
    gaps = []
    for a, b in zip(ours, ref):
        shift = real_mass_log(a)
        np.testing.assert_allclose(a.teacher_logprobs, np.add(b.teacher_logprobs, shift), atol=TOL, rtol=0)
        gaps.append(np.abs(np.subtract(a.teacher_logprobs, np.add(b.teacher_logprobs, shift))).max())
        if not k:
            assert a.teacher_topk_ids is None and b.teacher_topk_ids is None
            continue
        assert a.teacher_topk_ids.shape == b.teacher_topk_ids.shape == (len(a.completion_ids), k)
        assert (b.teacher_topk_ids < TOK.vocab_size).all()
        for t in range(len(a.completion_ids)):  # vLLM's list may hold padding ids: its real ones lead the local list
            real = a.teacher_topk_ids[t] < TOK.vocab_size
            n = int(real.sum())
            want = b.teacher_topk_logprobs[t, :n] + shift[t]
            np.testing.assert_allclose(a.teacher_topk_logprobs[t][real], want, atol=TOL, rtol=0)
            gap = np.diff(b.teacher_topk_logprobs[t], prepend=np.inf, append=-np.inf)
            distinct = ((-gap[:-1] > TOL) & (-gap[1:] > TOL))[:n]
            np.testing.assert_array_equal(a.teacher_topk_ids[t][real][distinct], b.teacher_topk_ids[t, :n][distinct])
    print(f"k = {k}: largest |vLLM - local| logprob per sample: {gaps}")


def test_the_proxy_passes_prompt_logprobs_through_and_refuses_too_many(server: str) -> None:
    """The raw reply: vLLM's prompt_logprobs (None first, then the actual token plus the top k), arbor's
    per-choice policy versions and no token logprobs unless asked; k above vLLM's --max-logprobs (20) is vLLM's
    400, which the teacher client raises as one line naming orchestrator.teacher.top_k."""
    ids = TOK.encode("hello vllm")
    out = post_json(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 3})
    (c,) = out["choices"]
    plp = c["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    assert all(str(t) in e and 3 <= len(e) <= 4 for t, e in zip(ids[1:], plp[1:]))
    version = get_json(server, "/health")["policy_version"]
    assert c["policy_versions"] == [version] * len(c["token_ids"]) == [version] and c["logprobs"] is None

    async def too_many() -> None:
        async with Teacher(TeacherConfig(url=server, top_k=21, max_retries=0)) as teacher:
            await teacher.logprobs(ids[:3], ids[3:])

    with pytest.raises(TeacherError) as e:
        asyncio.run(too_many())
    assert "\n" not in str(e.value) and "(400)" in str(e.value)
    assert str(e.value).endswith("(orchestrator.teacher.top_k = 21)")
