"""The policy is a distribution over the tokenizer's ids only, everywhere: with a head larger than its tokenizer
(the presets: 264 rows, 259 byte-tokenizer ids) the trainer's logprobs and entropy are a log-softmax over the
first 259 logits (padding rows get no gradient), the local engine reports the same numbers (sampled tokens, top
alternatives, greedy, prompt logprobs, speculative decoding), and distillation measures and follows the reverse
KL over the real ids, never moving the padding rows."""

from __future__ import annotations

import pytest
import torch
from test_distill import STATE, TOK, make_model
from test_distill_topk import topk_step

from arbor.config.model import ModelConfig
from arbor.config.trainer import LossConfig
from arbor.inference.engine.core import Engine
from arbor.inference.engine.params import SamplingParams
from arbor.models import build_model
from arbor.trainer.loss import build_loss
from arbor.trainer.parallel_state import ParallelState
from arbor.trainer.step import micro_batch_logprobs, packed_logprobs, train_step

CPU = torch.device("cpu")
F64 = torch.float64
V = TOK.vocab_size  # 259 of qwen3-test's 264 head rows


def real_logp(model: torch.nn.Module, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Brute force: `log_softmax` of a full forward's first V logits (row i predicts ids[i + 1])."""
    logits = model(torch.tensor([ids]))[0, :, :V].to(F64)
    return torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), -1)


@pytest.mark.slow
@pytest.mark.parametrize("prefix_merge", [False, True])
def test_trainer_logprobs_and_entropy_are_a_softmax_over_the_tokenizers_ids(prefix_merge):
    """Packed and prefix-merged rows (chunks of 3 rows), float64 model: logprobs and entropy equal the brute force
    over the first 259 logits (1e-6, absolute or relative: the chunked softmax is fp32) and their gradients equal
    autograd through it;
    the padding rows of the head get exactly 0."""
    (mb,) = topk_step(2, prefix_merge).micro_batches
    model = make_model(1).double()
    state = ParallelState(logprob_chunk=3, vocab=V)
    assert STATE.vocab == V < model.lm_head.weight.shape[0]
    lp, ent = micro_batch_logprobs(model, mb, 0.9, CPU, state=state)
    w = torch.randn(lp.shape, generator=torch.Generator().manual_seed(0), dtype=F64) * mb.loss_mask
    (lp * w).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    tokens = mb.input_ids[mb.token_nodes.long()] if mb.merged else mb.input_ids
    want_lp, want_ent, start = [], [], 0
    for n in mb.seq_lens.tolist():  # each sample alone, full logits cut to the real ids
        x = tokens[start : start + n]
        logp = real_logp(model, x.tolist(), 0.9)[:-1]
        want_lp.append(torch.cat([torch.zeros(1, dtype=F64), logp.gather(1, x[1:, None])[:, 0]]))
        want_ent.append(torch.cat([torch.zeros(1, dtype=F64), -(logp.exp() * logp).sum(-1)]))
        start += n
    want_lp, want_ent = torch.cat(want_lp) * mb.loss_mask, torch.cat(want_ent) * mb.loss_mask
    torch.testing.assert_close((lp * mb.loss_mask).double(), want_lp.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close((ent * mb.loss_mask).double(), want_ent.detach(), atol=1e-6, rtol=0)
    (want_lp * w).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, atol=1e-5, rtol=0)
    (head,) = [n for n, p in model.named_parameters() if p is model.lm_head.weight]  # tied: the embedding's name
    assert got[head][:V].abs().sum() > 0 and not got[head][V:].any()


def test_a_head_with_no_padding_rows_is_scored_bit_for_bit_as_before():
    """`vocab` covering every row (or 0, a model the trainer did not prepare) is the whole head, unchanged."""
    model = make_model(1)
    ids = torch.tensor(TOK.encode("same as before"))
    pos = torch.arange(len(ids))
    before = packed_logprobs(model, ids, pos, [len(ids)], 0.7, CPU, state=ParallelState(vocab=0))
    every_row = ParallelState(vocab=model.lm_head.weight.shape[0])
    after = packed_logprobs(model, ids, pos, [len(ids)], 0.7, CPU, state=every_row)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def _engine_vs_trainer(model, params: SamplingParams, prompt: list[int], **engine_kw) -> tuple[float, list]:
    """Largest |engine logprob - trainer logprob| over the completions of `prompt`, and the completions."""
    with Engine(model, TOK, seq_len=96, max_batch_size=4, seed=0, **engine_kw) as engine:
        out = engine.submit(prompt, params).result(timeout=300)
    worst = 0.0
    for c in out.completions:
        ids = torch.tensor(prompt + c.token_ids)
        with torch.no_grad():
            lp, _ = packed_logprobs(
                model,
                ids,
                torch.arange(len(ids)),
                [len(ids)],
                params.temperature,
                CPU,
                False,
                top_p=params.top_p,
                state=STATE,
            )
        worst = max(worst, float((lp[len(prompt) :] - torch.tensor(c.logprobs)).abs().max()))
        assert all(t < V for t in c.token_ids)
    return worst, [out, *out.completions]


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_p", [(0.8, 1.0), (0.0, 1.0), (1.0, 0.7)])
def test_engine_reports_the_trainers_logprobs_over_the_real_ids(temperature, top_p):
    """Sampled, greedy and nucleus tokens, their top alternatives and the prompt logprobs: the engine's numbers
    are the trainer's (3e-5 for the sampled tokens, whose engine side is a cached decode and trainer side a packed
    forward summing in other orders over 151k logits: 2e-6 to 1.2e-5 over seeds), none of them a padding id."""
    model = make_model(2)
    prompt = TOK.encode("score these tokens")
    params = SamplingParams(
        max_tokens=24, temperature=temperature, top_p=top_p, n=2, seed=3, top_logprobs=5, prompt_logprobs=4
    )
    worst, (out, *completions) = _engine_vs_trainer(model, params, prompt, nucleus_logprobs=True)
    assert worst < 3e-5
    with torch.no_grad():
        prompt_lp = real_logp(model, prompt)
        for c in completions:
            if top_p < 1:
                continue  # the listed alternatives are the nucleus' (tests/inference/test_top_p.py)
            ref = real_logp(model, prompt + c.token_ids, temperature)[len(prompt) - 1 : -1].topk(5)
            for top, vals, ids in zip(c.top_logprobs, ref.values, ref.indices):
                assert [i for i, _ in top] == ids.tolist()
                torch.testing.assert_close(torch.tensor([v for _, v in top], dtype=F64), vals, atol=1e-5, rtol=0)
    for t, entry in enumerate(out.prompt_logprobs[1:]):
        assert all(i < V for i in entry)
        assert abs(entry[prompt[t + 1]][0] - float(prompt_lp[t, prompt[t + 1]])) < 1e-5


def test_speculative_decoding_records_the_trainers_logprobs():
    """Drafted and verified tokens (qwen3-test-mtp, 3 drafts a step) carry the trainer's logprobs."""
    torch.set_num_threads(1)
    model = build_model(ModelConfig(name="qwen3-test-mtp"))
    model.eval()
    params = SamplingParams(max_tokens=40, temperature=1.0, n=2, seed=5)
    worst, _ = _engine_vs_trainer(model, params, TOK.encode("draft me"), draft_tokens=3)
    assert worst < 1e-5


def test_distillation_reports_the_full_reverse_kl_and_leaves_the_padding_rows_alone():
    """With the teacher's top-k spanning every real id (k = 259) the step's `distill/reverse_kl` is the exact
    reverse KL over the real ids, which equals a brute force before each step; five steps lower it, and the
    head's padding rows are never touched (zero gradient, plain SGD)."""
    batch = topk_step(V, False)
    (mb,) = batch.micro_batches
    student = make_model(1)
    pad_rows = student.lm_head.weight[V:].detach().clone()
    opt = torch.optim.SGD(student.parameters(), lr=0.5)
    loss_cfg = LossConfig(name="distill")
    kls = []
    for _ in range(5):
        with torch.no_grad():
            brute, start = [], 0
            for n in mb.seq_lens.tolist():
                logp = real_logp(student, mb.input_ids[start : start + n].tolist())
                for t in range(start + 1, start + n):
                    if mb.loss_mask[t]:  # the teacher's 259 logprobs, in its own (top-k) order
                        ids, t_lp = mb.teacher_topk_ids[t].long(), mb.teacher_topk_logprobs[t].double()
                        row = logp[t - start - 1, ids]
                        brute.append(float((row.exp() * (row - t_lp)).sum()))
                start += n
        figures = train_step(student, opt, batch, build_loss(loss_cfg), loss_cfg, 1e9, CPU, state=STATE)
        assert figures["distill/reverse_kl"] == pytest.approx(sum(brute) / len(brute), abs=1e-5)
        assert figures["distill/student_topk_mass"] == pytest.approx(1.0, abs=1e-5)  # no mass off the real ids
        kls.append(figures["distill/reverse_kl"])
    assert kls[-1] < kls[0]
    assert torch.equal(student.lm_head.weight[V:], pad_rows)
