"""On-policy distillation with the teacher's top-k (`orchestrator.teacher.top_k`): the top-k reverse-KL estimator
against brute force over a small vocabulary (value and gradient, in expectation over the sample, within 1e-6),
the student's top-k logprobs from the chunked head against a full forward (packed and prefix-merged rows, with
gradients), the teacher client shipping a local server's top-k through the batch, its clear errors, and a train
step's `distill/reverse_kl` against a hand computation from a full forward."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch
from test_distill import STATE, TOK, fake_teacher, local_server, make_model, raw_logprobs, rollout, vllm_reply

from arbor.config.orchestrator import TeacherConfig
from arbor.config.trainer import LossConfig
from arbor.orchestrator.batcher import build_step_batches
from arbor.orchestrator.teacher import Teacher, TeacherError
from arbor.trainer.loss import LossContext, build_loss
from arbor.trainer.step import micro_batch_logprobs, train_step
from arbor.transport.batch import StepBatch

F64 = torch.float64
DISTILL = LossConfig(name="distill")


def topk_ctx(student_lp: torch.Tensor, teacher_lp: torch.Tensor, x: int, k: int) -> tuple[torch.Tensor, LossContext]:
    """One loss token sampled as `x`: the sampled logprob and the context the trainer builds (the teacher's top-k
    of its full distribution `teacher_lp [V]`, the student's `student_lp [V]` read at those ids)."""
    ids = teacher_lp.topk(k).indices
    ctx = LossContext.single(1)
    ctx.teacher_logprobs = teacher_lp[x].reshape(1)
    ctx.teacher_topk_logprobs = teacher_lp[ids][None]
    ctx.student_topk_logprobs = student_lp[ids][None]
    ctx.sampled_in_topk = (ids == x).any().reshape(1)
    return student_lp[x].reshape(1), ctx


@pytest.mark.parametrize("k", [1, 3, 10])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_topk_estimator_is_the_reverse_kl_in_expectation(seed, k):
    """Brute force over V = 11: sum_x p(x) * (value, gradient) of the estimator at sample x equals the exact reverse
    KL(p || teacher) and its gradient (1e-6); k = V is the exact KL at every sample."""
    gen = torch.Generator().manual_seed(seed)
    V = 11
    logits = torch.randn(V, generator=gen, dtype=F64).mul(2).requires_grad_()
    teacher_lp = torch.randn(V, generator=gen, dtype=F64).mul(2).log_softmax(-1)
    loss = build_loss(DISTILL)
    value, grad = torch.zeros((), dtype=F64), torch.zeros(V, dtype=F64)
    p = logits.detach().softmax(-1)
    for x in range(V):
        lp, ctx = topk_ctx(logits.log_softmax(-1), teacher_lp, x, k)
        out = loss(
            lp, torch.zeros(1, dtype=F64), torch.zeros(1, dtype=F64), torch.ones(1, dtype=torch.bool), DISTILL, ctx
        )
        (g,) = torch.autograd.grad(out.loss_sum, logits)
        value, grad = value + p[x] * out.loss_sum.detach(), grad + p[x] * g
        assert float(out.metrics["distill/reverse_kl_sum"]) == pytest.approx(float(out.loss_sum.detach()), abs=1e-12)
    student_lp = logits.log_softmax(-1)
    kl = (student_lp.exp() * (student_lp - teacher_lp)).sum()
    (want,) = torch.autograd.grad(kl, logits)
    assert float(value) == pytest.approx(float(kl.detach()), abs=1e-6)
    torch.testing.assert_close(grad, want, atol=1e-6, rtol=0)


def test_the_topk_loss_equals_a_hand_computation():
    """Two loss tokens and a masked one, k = 2, unit weights: the value is sum_K p (s - t) plus k1 of a sample
    outside K; the figures report the student's and the teacher's mass on K."""
    s = torch.tensor([[-0.5, -1.5], [-0.2, -2.0], [-9.0, -9.0]], dtype=F64)  # student at the teacher's top-2
    t = torch.tensor([[-0.3, -1.6], [-0.4, -1.2], [-1.0, -1.0]], dtype=F64)
    lp = torch.tensor([-0.5, -3.0, -9.0], dtype=F64)  # token 0 sampled in K (its first id), token 1 outside
    ctx = LossContext.single(3)
    ctx.teacher_logprobs = torch.tensor([-0.3, -2.5, 0.0], dtype=F64)
    ctx.teacher_topk_logprobs, ctx.student_topk_logprobs = t, s
    ctx.sampled_in_topk = torch.tensor([True, False, False])
    mask = torch.tensor([True, True, False])
    out = build_loss(DISTILL)(lp, torch.zeros(3, dtype=F64), torch.zeros(3, dtype=F64), mask, DISTILL, ctx)
    e = np.exp
    hand = (e(-0.5) * (-0.5 + 0.3) + e(-1.5) * (-1.5 + 1.6)) + (
        e(-0.2) * (-0.2 + 0.4) + e(-2.0) * (-2.0 + 1.2) + (-3.0 + 2.5)
    )
    assert float(out.loss_sum) == pytest.approx(hand, abs=1e-12)
    assert float(out.metrics["distill/student_topk_mass_sum"]) == pytest.approx(e(-0.5) + e(-1.5) + e(-0.2) + e(-2.0))
    assert float(out.metrics["distill/teacher_topk_mass_sum"]) == pytest.approx(e(-0.3) + e(-1.6) + e(-0.4) + e(-1.2))
    k3 = (np.expm1(0.2) - 0.2) + (np.expm1(0.5) - 0.5)  # the sampled tokens' k1: -0.2 and -0.5
    assert float(out.metrics["distill/reverse_kl_k3_sum"]) == pytest.approx(k3)


# ---- the teacher's top-k through the client and the batch ----


def scored_rollouts(url: str, k: int) -> list:
    prompts = [TOK.encode("ab"), TOK.encode("hello"), TOK.encode("hel")]
    completions = [TOK.encode("xyz!"), TOK.encode("q"), TOK.encode("lo w")]
    rollouts = [rollout(p, c, group=i) for i, (p, c) in enumerate(zip(prompts, completions))]
    rollouts[2].completion_mask = [1, 1, 0, 1]

    async def score() -> None:
        async with Teacher(TeacherConfig(url=url, model="teacher", top_k=k)) as teacher:
            await teacher.wait_ready()
            await teacher.score(rollouts)

    asyncio.run(score())
    return rollouts


@pytest.mark.parametrize("prefix_merge", [False, True])
def test_the_teacher_ships_its_topk_in_the_batch_from_a_local_server(prefix_merge, tmp_path):
    """k = 3 from arbor's local engine: each completion token's top-3 ids and logprobs are the teacher model's
    (1e-5, best first), and they ride per sample token through the batch (0 on prompt and inserted tokens),
    through its tensor round trip, in plain and prefix-merged rows."""
    k = 3
    with local_server(make_model(3)) as url:
        rollouts = scored_rollouts(url, k)
    ref = make_model(3)
    want_ids, want_lps = [], []
    for r in rollouts:
        ids = r.prompt_ids + r.completion_ids
        top = raw_logprobs(ref, ids)[len(r.prompt_ids) - 1 : len(ids) - 1].topk(k)
        assert r.teacher_topk_ids.shape == (len(r.completion_ids), k) and r.teacher_topk_ids.dtype == np.int32
        np.testing.assert_array_equal(r.teacher_topk_ids, top.indices.numpy())
        np.testing.assert_allclose(r.teacher_topk_logprobs, top.values.numpy(), atol=1e-5)
        trained = np.asarray(r.completion_mask or [1] * len(r.completion_ids), bool)[:, None]
        pad = np.zeros((len(r.prompt_ids), k))
        want_ids.append(np.concatenate([pad, np.where(trained, top.indices.numpy(), 0)]))
        want_lps.append(np.concatenate([pad, np.where(trained, top.values.numpy(), 0)]))
    (batch,) = build_step_batches(rollouts, 0, 1, 64, 1.0, 0, prefix_merge=prefix_merge)
    batch = StepBatch.from_tensors(*batch.to_tensors()).torch()
    (mb,) = batch.micro_batches
    assert mb.merged == prefix_merge and mb.teacher_topk_ids.dtype == torch.int32
    # the row holds the samples in its own order: match each by its tokens
    tokens = mb.input_ids[mb.token_nodes.long()] if mb.merged else mb.input_ids
    starts = np.cumsum([0, *mb.seq_lens.tolist()])
    for a, b in zip(starts[:-1], starts[1:]):
        i = next(i for i, r in enumerate(rollouts) if tokens[a:b].tolist() == r.prompt_ids + r.completion_ids)
        np.testing.assert_array_equal(mb.teacher_topk_ids[a:b].numpy(), want_ids[i])
        np.testing.assert_allclose(mb.teacher_topk_logprobs[a:b].numpy(), want_lps[i], atol=1e-5)


def topk_reply(ids: list[int], k: int, drop_at: int | None = None) -> dict:
    """A vLLM reply with the actual token at rank 1 plus k - 1 others (one fewer at position `drop_at`)."""
    reply = vllm_reply(ids, [-0.1] * (len(ids) - 1))
    for i, entry in enumerate(reply["choices"][0]["prompt_logprobs"][1:], 1):
        for r in range(2, k + 1 - (i == drop_at)):
            entry[str(100 + r)] = {"logprob": -r, "rank": r, "decoded_token": "y"}
    return reply


def test_a_reply_without_the_topk_names_the_sample_and_a_refused_k_names_the_field():
    r = rollout([5, 6], [7, 8])
    r.task_id = "t-17"

    async def score(url: str, k: int) -> None:
        async with Teacher(TeacherConfig(url=url, top_k=k, max_retries=0)) as teacher:
            await teacher.score([r])

    with fake_teacher([(200, topk_reply([5, 6, 7, 8], 3))]) as (url, seen):
        asyncio.run(score(url, 3))
    assert seen[0]["prompt_logprobs"] == 3 and r.teacher_topk_ids.tolist() == [[7, 102, 103], [8, 102, 103]]
    with (
        fake_teacher([(200, topk_reply([5, 6, 7, 8], 3, drop_at=3))]) as (url, _),
        pytest.raises(
            TeacherError,
            match=r"^sample of task 't-17' \(group 0\): .*hold 2 of the top_k = 3 ranked "
            r"tokens at position 3$",
        ),
    ):
        asyncio.run(score(url, 3))
    with local_server(make_model()) as url, pytest.raises(TeacherError) as e:
        asyncio.run(score(url, 21))
    assert "\n" not in str(e.value) and "prompt_logprobs must be an integer in [0, 20], got 21" in str(e.value)
    assert str(e.value).endswith("(orchestrator.teacher.top_k = 21)")


def test_a_teacher_topk_id_outside_the_students_vocabulary_names_the_sample():
    """A teacher with another tokenizer ranks ids the student's head has no row for: one line naming the sample,
    not an index error in the trainer."""
    r = rollout([5, 6], [7, 8])
    r.task_id = "t-3"

    async def score(url: str) -> None:
        async with Teacher(TeacherConfig(url=url, top_k=3, max_retries=0), vocab=100) as teacher:
            await teacher.score([r])

    with (
        fake_teacher([(200, topk_reply([5, 6, 7, 8], 3))]) as (url, _),
        pytest.raises(
            TeacherError,
            match=r"^sample of task 't-3' \(group 0\): the teacher's top-k token '102' at "
            r"position 2 is not one of the student's 100 token ids: teacher and "
            r"student must share a tokenizer$",
        ),
    ):
        asyncio.run(score(url))


# ---- the trainer's side ----


def topk_step(k: int, prefix_merge: bool) -> StepBatch:
    """A step of three samples with the teacher's top-k (made up, from another model) on every completion token."""
    teacher = make_model(5)
    rollouts = []
    for i, (p, c) in enumerate([("ab", "xyz!"), ("ab", "xyq"), ("hello", "q w")]):
        r = rollout(TOK.encode(p), TOK.encode(c), group=i)
        ids = r.prompt_ids + r.completion_ids
        lp = raw_logprobs(teacher, ids)[len(r.prompt_ids) - 1 : len(ids) - 1]
        top = lp.topk(k)
        r.teacher_logprobs = lp.gather(1, torch.tensor(r.completion_ids)[:, None])[:, 0].tolist()
        r.teacher_topk_ids, r.teacher_topk_logprobs = top.indices.numpy().astype(np.int32), top.values.numpy()
        rollouts.append(r)
    (batch,) = build_step_batches(rollouts, 0, 1, 64, 1.0, 0, prefix_merge=prefix_merge)
    return batch.torch()


@pytest.mark.parametrize("prefix_merge", [False, True])
def test_the_students_topk_logprobs_match_a_full_forward_with_gradients(prefix_merge):
    """The chunked head read at the teacher's top-k ids (chunk of 3 rows) equals log_softmax of a full forward's
    logits (the tokenizer's 259 of the head's 264 rows) at those ids (1e-6; float64 model), and so do the
    gradients of a weighted sum of them (1e-5: the
    chunked path's softmax is fp32)."""
    batch = topk_step(4, prefix_merge)
    (mb,) = batch.micro_batches
    model = make_model(1).double()
    ids = mb.teacher_topk_ids.long()
    state = dataclasses.replace(STATE, logprob_chunk=3)
    _, _, extra = micro_batch_logprobs(model, mb, 1.0, torch.device("cpu"), False, extra_ids=ids, state=state)
    # the loss tokens' rows (a packed row's sample start is read from the sample before it, and masked)
    w = torch.randn(extra.shape, generator=torch.Generator().manual_seed(0), dtype=F64) * mb.loss_mask[:, None]
    extra = extra * mb.loss_mask[:, None]
    (extra * w).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    tokens = mb.input_ids[mb.token_nodes.long()] if mb.merged else mb.input_ids
    want, start = [], 0
    for n in mb.seq_lens.tolist():  # each sample alone, full logits
        logp = torch.log_softmax(model(tokens[start : start + n][None])[0, :, : TOK.vocab_size], -1)
        pad = torch.zeros(1, ids.shape[1], dtype=F64)
        want.append(torch.cat([pad, logp[:-1].gather(1, ids[start + 1 : start + n])]))
        start += n
    want = torch.cat(want) * mb.loss_mask[:, None]
    torch.testing.assert_close(extra.double(), want, atol=1e-6, rtol=0)
    (want * w).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, atol=1e-5, rtol=0)  # the chunked softmax is fp32 by design


def test_a_train_step_reports_the_topk_reverse_kl_of_a_hand_computation():
    """`distill/reverse_kl` of a train step with k = 3 equals the estimator computed by hand from a full forward
    of the model before the step, per loss token, averaged over loss tokens."""
    batch = topk_step(3, False)
    (mb,) = batch.micro_batches
    model = make_model(1)
    hand, start = [], 0
    with torch.no_grad():
        for n in mb.seq_lens.tolist():
            sl = slice(start, start + n)
            logp = raw_logprobs(model, mb.input_ids[sl].tolist())
            for t in range(start + 1, start + n):
                if not mb.loss_mask[t]:
                    continue
                row, ids, x = logp[t - start - 1], mb.teacher_topk_ids[t].long(), int(mb.input_ids[t])
                exact = (row[ids].exp() * (row[ids] - mb.teacher_topk_logprobs[t])).sum()
                tail = 0.0 if x in ids.tolist() else float(row[x] - mb.teacher_logprobs[t])
                hand.append(float(exact) + tail)
            start += n
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    figures = train_step(model, opt, batch, build_loss(DISTILL), DISTILL, 1.0, torch.device("cpu"), state=STATE)
    assert figures["distill/reverse_kl"] == pytest.approx(sum(hand) / len(hand), abs=1e-6)
    assert 0 < figures["distill/student_topk_mass"] <= 1 and 0 < figures["distill/teacher_topk_mass"] <= 1


def test_a_nucleus_batch_with_the_topk_is_refused():
    batch = dataclasses.replace(topk_step(2, False), top_p=0.9)
    model = make_model(1)
    with pytest.raises(
        ValueError,
        match=r"carries the teacher's top-k with top_p = 0\.9: set "
        r"orchestrator\.sampling\.top_p = 1",
    ):
        train_step(
            model,
            torch.optim.SGD(model.parameters(), lr=0.0),
            batch,
            build_loss(DISTILL),
            DISTILL,
            1.0,
            torch.device("cpu"),
            state=STATE,
        )
