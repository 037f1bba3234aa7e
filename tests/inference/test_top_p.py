"""Nucleus sampling (top_p < 1): the local engine reports the truncated distribution's logprobs (as vLLM's
`processed_logprobs`), the trainer scores the same truncated distribution (chunked path and full-logits reference,
values and gradients, a target outside the trainer's nucleus included), the step batch carries top_p, and `rl`
warns where a mismatch remains."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from arbor.config.loader import load_config
from arbor.config.model import ModelConfig
from arbor.config.rl import RLConfig
from arbor.inference.engine.core import Engine
from arbor.inference.engine.params import SamplingParams
from arbor.inference.engine.requests import Request, Seq
from arbor.inference.engine.sampler import (
    CDF_BLOCK,
    FLOOR_LOGPROB,
    NUCLEUS_CANDIDATES,
    Sampler,
    choose,
    inverse_cdf,
    nucleus_keep,
    scaled_logprobs,
)
from arbor.models import build_model, build_tokenizer
from arbor.trainer.logprobs import chunked_token_logprobs, nucleus_mask
from arbor.trainer.parallel_state import ParallelState
from arbor.trainer.step import packed_logprobs, shifted_logprobs
from arbor.transport.batch import StepBatch

CFG = ModelConfig(name="qwen3-test")
TOK = build_tokenizer(CFG)
F64 = torch.float64


def oracle_logprob(logits_row: list[float], target: int, temperature: float, top_p: float) -> float:
    """Per-row reference in plain Python: softmax at T, nucleus by descending mass (a token is kept while the
    mass before it is below top_p), support = nucleus plus the target, log of the target's renormalised mass."""
    z = [x / temperature for x in logits_row]
    top = max(z)
    p = [math.exp(x - top) for x in z]
    total = sum(p)
    p = [x / total for x in p]
    support, before = set(), 0.0
    for i in sorted(range(len(p)), key=lambda i: -p[i]):
        if before < top_p:
            support.add(i)
        before += p[i]
    support.add(target)
    return math.log(p[target] / sum(p[i] for i in support))


def _head(seed: int, n: int = 6, h: int = 5, v: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, h, generator=gen), 2.0 * torch.randn(v, h, generator=gen)


@pytest.mark.parametrize("top_p", [0.3, 0.7, 0.95])
def test_chunked_truncated_logprobs_match_the_oracle_and_the_full_logits_reference(top_p: float) -> None:
    """Several pairs per row (a merged row's node read by several samples), targets inside and outside the
    trainer's nucleus, chunks smaller than the rows: values equal the per-row oracle, gradients of the hidden
    states and the head equal autograd through the masked full-logits reference."""
    hidden, weight = _head(0)
    T = 0.8
    logits = (hidden @ weight.T).double()
    keep = nucleus_mask(torch.log_softmax(logits / T, -1), top_p)
    outside = [(r, int((~keep[r]).nonzero()[0])) for r in range(6) if (~keep[r]).any()]
    assert outside, "the case must hold a target outside some row's nucleus"
    pairs = [(r, int(logits[r].argmax())) for r in range(6)] + [(r, (r * 3 + 1) % 11) for r in range(6)] + outside
    rows = torch.tensor([r for r, _ in pairs])
    targets = torch.tensor([t for _, t in pairs])
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    got, _ = chunked_token_logprobs(h1, w1, rows, targets, T, with_entropy=False, chunk=4, top_p=top_p)
    want = [oracle_logprob(logits[r].tolist(), t, T, top_p) for r, t in pairs]
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=F64), atol=1e-5, rtol=0)
    g = torch.linspace(-1.0, 1.5, len(pairs))
    (got * g).sum().backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    z = (h2 @ w2.T) / T
    support = nucleus_mask(torch.log_softmax(z.detach(), -1), top_p).clone()
    ref = []
    for k, (r, t) in enumerate(pairs):
        s = support[r].clone()
        s[t] = True
        ref.append(torch.where(s, z[r], -torch.inf).log_softmax(-1)[t] * g[k])
    torch.stack(ref).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-5, rtol=1e-5)


def test_shifted_reference_and_greedy_ignore_nothing_they_should_not() -> None:
    """The full-logits reference equals the chunked path under a nucleus; top_p = 1 and greedy (temperature 0)
    give the untruncated logprobs exactly, as both engines do."""
    hidden, weight = _head(1, n=9)
    ids = torch.randint(0, 11, (9,), generator=torch.Generator().manual_seed(2))
    logits = hidden @ weight.T
    for top_p in (0.5, 0.9):
        ref, _ = shifted_logprobs(logits, ids, 0.7, with_entropy=False, top_p=top_p)
        rows = torch.arange(8)
        got, _ = chunked_token_logprobs(hidden[:-1], weight, rows, ids[1:], 0.7, False, 3, top_p)
        torch.testing.assert_close(ref[1:], got, atol=1e-6, rtol=0)
    full, _ = shifted_logprobs(logits, ids, 0.7, with_entropy=False)
    assert torch.equal(shifted_logprobs(logits, ids, 0.7, False, top_p=1.0)[0], full)
    greedy, _ = shifted_logprobs(logits, ids, 0.0, with_entropy=False)
    assert torch.equal(shifted_logprobs(logits, ids, 0.0, False, top_p=0.5)[0], greedy)
    assert torch.equal(
        chunked_token_logprobs(hidden, weight, torch.arange(9), ids, 0.0, False, 4, 0.5)[0],
        chunked_token_logprobs(hidden, weight, torch.arange(9), ids, 0.0, False, 4)[0],
    )


def test_sampler_reports_the_nucleus_renormalised_logprob_and_alternatives() -> None:
    """A sampler built with `nucleus_logprobs` reports log p(x) - log(nucleus mass) for drawn tokens and its
    alternatives (the floor outside the nucleus); top_p = 1 and greedy rows report the full distribution's, all
    over the tokenizer's ids (the head's 5 padding rows left out)."""
    sampler = Sampler(TOK, nucleus_logprobs=True)
    params = [
        SamplingParams(max_tokens=64, temperature=0.9, top_p=0.6, top_logprobs=8),
        SamplingParams(max_tokens=64, temperature=0.9, top_logprobs=2),
        SamplingParams(max_tokens=64, temperature=0.0, top_p=0.6),
    ]
    seqs = [Seq(Request([1, 2, 3], p, seed=5 + i), 0, i, torch.device("cpu")) for i, p in enumerate(params)]
    gen = torch.Generator().manual_seed(3)
    V = build_model(CFG).args.vocab_size
    for step in range(10):
        logits = 3.0 * torch.randn(3, V, generator=gen)
        sampler.sample(seqs, logits, version=step)
        full = scaled_logprobs(logits, torch.tensor([p.temperature for p in params]), TOK.vocab_size)
        keep = nucleus_mask(full[0], 0.6)
        log_mass = float(full[0][keep].logsumexp(0))
        tok = seqs[0].tokens[-1]
        assert bool(keep[tok])
        assert seqs[0].logprobs[-1] == pytest.approx(
            oracle_logprob(logits[0, : TOK.vocab_size].tolist(), tok, 0.9, 0.6), abs=1e-5
        )
        for i, value in seqs[0].top[-1]:
            assert value == (pytest.approx(float(full[0, i]) - log_mass, abs=1e-6) if keep[i] else FLOOR_LOGPROB)
        assert seqs[1].logprobs[-1] == float(full[1, seqs[1].tokens[-1]])
        assert seqs[2].logprobs[-1] == float(full[2, seqs[2].tokens[-1]])


@pytest.mark.slow
def test_batched_draws_follow_each_rows_processed_distribution_and_its_own_seed() -> None:
    """`choose` draws every sampled row in one pass: a row's frequencies match its distribution (top-p
    truncated and renormalised, a probability-0 token never drawn), a greedy row takes the argmax, and a
    sequence's draws depend on its seed only, not on the rows beside it."""
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0], [0.1, 0.2, 0.3, 0.4, 0.0], [0.1, 0.2, 0.3, 0.4, 0.0]]))
    params = [
        SamplingParams(temperature=1.0, top_p=0.7),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
    ]
    seqs = [Seq(Request([1], p, seed=11 * i), 0, i, torch.device("cpu")) for i, p in enumerate(params)]
    draws = [choose(seqs, logp) for _ in range(20000)]
    want = [[0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4, 0.0]]
    for row, p in enumerate(want):
        freq = torch.bincount(torch.tensor([d[row] for d in draws]), minlength=5).double() / len(draws)
        assert freq.tolist() == pytest.approx(p, abs=0.015)
        assert all(freq[i] == 0 for i in range(5) if p[i] == 0)
    assert {d[2] for d in draws} == {3}
    alone = Seq(Request([1], params[1], seed=11), 0, 1, torch.device("cpu"))
    assert [choose([alone], logp[1:2])[0] for _ in range(200)] == [d[1] for d in draws[:200]]


def test_two_level_draws_over_a_large_vocabulary_are_the_one_level_draws() -> None:
    """Over more than two blocks of ids `inverse_cdf` picks a block by the blocks' sums, then the id inside it:
    the same id a float64 cumulative sum over the whole row picks for the same uniform (but for rounding at a
    boundary), never an id of weight 0 (whole blocks of them included, and a last block shorter than the rest)."""
    gen = torch.Generator().manual_seed(7)
    V = 5 * CDF_BLOCK + 333
    weights = torch.rand(6, V, generator=gen) ** 8  # unnormalised, a few ids holding most of the mass
    weights[:, CDF_BLOCK : 2 * CDF_BLOCK] = 0.0  # a block of weight 0
    weights[weights < 1e-3] = 0.0  # and zeros everywhere else
    weights[5] = 0.0
    weights[5, V - 1] = 1.0  # all the mass on the last id, in the short last block
    zero = weights == 0
    differ = 0
    for _ in range(400):
        u = torch.rand(6, generator=gen, dtype=F64)
        two = inverse_cdf(weights, u)
        c = weights.double().cumsum(-1)
        one = torch.searchsorted(c, (u * c[:, -1])[:, None], right=True)[:, 0]
        assert not zero.gather(1, two[:, None]).any()
        differ += int((two != one).sum())
    assert differ <= 2
    assert inverse_cdf(weights, torch.full((6,), 0.999999, dtype=F64))[5] == V - 1


def test_nucleus_over_a_large_vocabulary_is_the_full_sorts() -> None:
    """`nucleus_keep` decides a row from its most likely ids when its nucleus lies among them, and sorts the row
    whole otherwise: the same mask as a stable sort of every id, for peaked rows, flat ones, rows with ties at
    the candidates' edge, top_p = 1 rows, and rows batched in more than two dimensions."""
    gen = torch.Generator().manual_seed(5)
    V = 6 * NUCLEUS_CANDIDATES
    logits = torch.randn(7, V, generator=gen) * torch.tensor([12.0, 12.0, 8.0, 0.5, 0.1, 12.0, 12.0])[:, None]
    probs = torch.softmax(logits, -1)
    order = probs[2].argsort(descending=True)
    probs[2, order[NUCLEUS_CANDIDATES - 5 : NUCLEUS_CANDIDATES + 50]] = float(
        probs[2, order[NUCLEUS_CANDIDATES]]
    )  # ties
    probs[6] = 0.0
    probs[6, :3] = torch.tensor([0.5, 0.25, 0.25])  # every other id tied at 0
    top_p = torch.tensor([0.9, 1.0, 0.999, 0.9, 0.5, 0.3, 0.6])

    def full_sort(p: torch.Tensor, q: float) -> torch.Tensor:
        if q >= 1:
            return torch.ones_like(p, dtype=torch.bool)
        sorted_p, idx = p.sort(descending=True, stable=True)
        return torch.zeros_like(p, dtype=torch.bool).scatter_(0, idx, (sorted_p.cumsum(0) - sorted_p) < q)

    want = torch.stack([full_sort(probs[r], float(top_p[r])) for r in range(7)])
    assert torch.equal(nucleus_keep(probs, top_p), want)
    assert torch.equal(
        nucleus_keep(probs.reshape(7, 1, V).expand(7, 2, V), top_p[:, None]), want[:, None].expand(7, 2, V)
    )
    assert int(want[0].sum()) < NUCLEUS_CANDIDATES < int(want[3].sum())  # both paths taken


def test_local_engine_and_trainer_agree_on_truncated_logprobs() -> None:
    """End to end on the local engine: with top_p = 0.5 the engine's reported logprobs equal the trainer's score
    of the same tokens (the packed forward, the nucleus at the same temperature), and differ from the full
    distribution's; the engine the server builds reports this kind."""
    torch.manual_seed(0)
    model = build_model(CFG)
    model.init_weights(0, std=0.3)
    model.eval()
    state = ParallelState(vocab=TOK.vocab_size)  # as the trainer prepares it: 259 of the head's 264 rows
    prompt = TOK.encode("sample me")
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.5, n=3, seed=11)
    engine = Engine(model, TOK, seq_len=64, max_batch_size=4, seed=0, nucleus_logprobs=True).start()
    try:
        out = engine.submit(prompt, params).result(timeout=120)
    finally:
        engine.stop()
    differs = 0.0
    for comp in out.completions:
        ids = torch.tensor(prompt + comp.token_ids)
        pos = torch.arange(len(ids))
        with torch.no_grad():
            trunc, _ = packed_logprobs(
                model, ids, pos, [len(ids)], 0.8, torch.device("cpu"), False, top_p=0.5, state=state
            )
            full, _ = packed_logprobs(model, ids, pos, [len(ids)], 0.8, torch.device("cpu"), False, state=state)
        n = len(comp.token_ids)
        torch.testing.assert_close(torch.tensor(comp.logprobs), trunc[-n:], atol=1e-5, rtol=0)
        differs = max(differs, float((trunc[-n:] - full[-n:]).abs().max()))
    assert differs > 1e-3, "top_p = 0.5 must truncate some distribution"


def test_step_batch_carries_top_p_and_older_files_read_as_one() -> None:
    batch = StepBatch(step=3, micro_batches=[], loss_tokens_total=1, num_samples_total=1, temperature=0.7, top_p=0.9)
    tensors, meta = batch.to_tensors()
    assert StepBatch.from_tensors(tensors, meta).top_p == 0.9
    meta["arbor"] = meta["arbor"].replace('"top_p": 0.9, ', "")
    assert StepBatch.from_tensors(tensors, meta).top_p == 1.0


def test_rl_warns_where_an_agent_may_sample_with_another_top_p() -> None:
    base = ["--orchestrator.sampling.top-p", "0.9"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(RLConfig, base, env={})
    with pytest.warns(UserWarning, match="orchestrator.gateway.override_sampling"):
        load_config(RLConfig, [*base, "--orchestrator.gateway.override-sampling", "false"], env={})
