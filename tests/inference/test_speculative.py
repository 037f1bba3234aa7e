"""Speculative decoding in the local engine (arbor.inference.engine.speculative): greedy requests produce exactly plain
decoding's tokens; sampled ones follow the target's processed distribution (temperature, top-p) by a chi-squared
test over 20k samples of a small-vocabulary model whose head has two padding rows past its tokenizer, with the
target's logprobs (over the tokenizer's ids); the acceptance rule itself."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from arbor.config.model import ModelConfig
from arbor.inference.engine.core import Engine
from arbor.inference.engine.params import SamplingParams
from arbor.inference.engine.speculative import (
    SpeculativeDecoder,
    accept_greedy,
    accept_sampled,
    inverse_cdf,
    processed_probs,
)
from arbor.inference.server import BackgroundServer
from arbor.models import build_model, build_tokenizer
from arbor.models.args import ModelArgs
from arbor.models.hf import save_checkpoint_dir
from arbor.models.qwen3 import Qwen3ForCausalLM
from arbor.orchestrator.client import InferenceClient
from arbor.orchestrator.figures import StepFigures

VOCAB = 6


class TinyTokenizer:
    """Ids 0..VOCAB-1, no eos among them (the engine stops on max_tokens)."""

    vocab_size = VOCAB
    eos_token_id = VOCAB + 10
    stop_token_ids = (eos_token_id,)

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


def small_vocab_model(seed: int = 0) -> Qwen3ForCausalLM:
    """VOCAB + 2 head rows: the last two are padding (past `TinyTokenizer`), with mass the engine must leave out."""
    args = ModelArgs(
        vocab_size=VOCAB + 2,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        rope_theta=10_000.0,
        mtp_depth=1,
    )
    model = Qwen3ForCausalLM(args)
    model.init_weights(seed, std=0.5)  # peaked enough that drafts are often, not always, accepted
    with torch.no_grad():  # a draft unlike the target: rejections and residual draws happen
        gen = torch.Generator().manual_seed(seed + 1)
        for p in model.mtp.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    # float64: the comparison with a full forward is then free of float32 rounding in the forward itself (the
    # engine's logprobs are float32 either way)
    return model.double().eval()


def chi_squared_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of Pearson's test, cells with expected counts below 5 pooled into one."""
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


def exact_joint(model, prompt: list[int], steps: int, temperature: float, top_p: float, nucleus: bool = False):
    """Every continuation of `steps` tokens: its probability under plain sampling and its per-token logprobs
    (temperature-scaled over the tokenizer's ids; with `nucleus`, of the top-p nucleus renormalised, as the
    server's engine reports them)."""
    seqs = list(itertools.product(range(VOCAB), repeat=steps))
    ids = torch.tensor([prompt + list(s) for s in seqs])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[..., :VOCAB].float() / temperature, -1)
    probs, logprobs = [], []
    P = len(prompt)
    for i, s in enumerate(seqs):
        prob, lps = 1.0, []
        for j, tok in enumerate(s):
            row = logp[i, P - 1 + j]
            processed = processed_probs(row, top_p)[tok]
            prob *= float(processed)
            lps.append(float(processed.log()) if nucleus else float(row[tok]))
        probs.append(prob)
        logprobs.append(lps)
    return seqs, torch.tensor(probs, dtype=torch.float64), logprobs


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_p,nucleus", [(1.0, 1.0, False), (0.8, 0.7, False), (0.8, 0.7, True)])
def test_sampled_tokens_follow_the_target_distribution(temperature, top_p, nucleus):
    """`nucleus`: the engine reports the nucleus' renormalised logprobs (`nucleus_logprobs`, as `build_engine`
    sets it), for drafted tokens as for plain ones."""
    torch.set_num_threads(1)
    model = small_vocab_model()
    prompt, steps, per_request, requests = [1, 4, 2], 3, 50, 400  # 20,000 samples
    seqs, probs, logprobs = exact_joint(model, prompt, steps, temperature, top_p, nucleus)
    index = {s: i for i, s in enumerate(seqs)}
    counts = torch.zeros(len(seqs), dtype=torch.float64)
    worst = 0.0
    with Engine(
        model, TinyTokenizer(), seq_len=16, max_batch_size=per_request, draft_tokens=2, nucleus_logprobs=nucleus
    ) as engine:
        params = [
            SamplingParams(max_tokens=steps, temperature=temperature, top_p=top_p, n=per_request, seed=r * per_request)
            for r in range(requests)
        ]
        futures = [engine.submit(prompt, p) for p in params]
        for f in futures:
            for c in f.result(600).completions:
                i = index[tuple(c.token_ids)]
                counts[i] += 1
                worst = max(worst, max(abs(a - b) for a, b in zip(c.logprobs, logprobs[i])))
        stats = engine.stats()
    assert counts.sum() == per_request * requests
    assert chi_squared_p(counts, probs * counts.sum()) > 0.01
    assert worst < 1e-6  # the returned logprobs are the target model's
    assert 0 < stats.accepted_draft_tokens < stats.draft_tokens  # drafts were both kept and rejected


def test_greedy_speculative_decoding_reproduces_plain_decoding():
    torch.set_num_threads(1)
    cfg = ModelConfig(name="qwen3-test-mtp")
    model, tokenizer = build_model(cfg), build_tokenizer(cfg)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in model.mtp.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    prompts = [[72, 101, 108], [1, 2, 3, 4, 5, 6, 7], [40] * 12]
    outs = {}
    for k in (0, 4):
        with Engine(model, tokenizer, seq_len=64, max_batch_size=8, draft_tokens=k) as engine:
            futures = [
                engine.submit(p, SamplingParams(max_tokens=40 - 3 * i, temperature=0.0, n=2, top_logprobs=2))
                for i, p in enumerate(prompts)
            ]
            outs[k] = [f.result(120) for f in futures]
            stats = engine.stats()
    assert 0 < stats.accepted_draft_tokens < stats.draft_tokens
    assert stats.decode_tokens > stats.decode_steps  # more than one token per sequence per step
    for plain, spec in zip(outs[0], outs[4]):
        for a, b in zip(plain.completions, spec.completions):
            assert a.token_ids == b.token_ids
            assert a.policy_versions == b.policy_versions
            assert a.finish_reason == b.finish_reason
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
            assert [t[0][0] for t in a.top_logprobs] == [t[0][0] for t in b.top_logprobs]


def test_speculative_decoding_survives_a_weight_update(tmp_path):
    torch.set_num_threads(1)
    cfg = ModelConfig(name="qwen3-test-mtp")
    model, tokenizer = build_model(cfg), build_tokenizer(cfg)
    new = build_model(ModelConfig(name="qwen3-test-mtp", init_seed=4))
    save_checkpoint_dir(new.state_dict(), new.args, tmp_path)
    with Engine(model, tokenizer, seq_len=128, max_batch_size=4, draft_tokens=3) as engine:
        engine.pause().result(10)
        future = engine.submit([5, 6, 7], SamplingParams(max_tokens=60, temperature=0.0))
        engine.resume().result(10)
        engine.update_weights(tmp_path, 1).result(60)
        out = future.result(60).completions[0]
    ids = torch.tensor([[5, 6, 7] + out.token_ids])
    versions = out.policy_versions
    assert versions[-1] == 1
    for v, weights in ((0, build_model(cfg)), (1, new)):
        with torch.no_grad():
            logp = torch.log_softmax(weights(ids)[0, :, : tokenizer.vocab_size].float(), -1)
        for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            if versions[j] == v:
                assert abs(float(logp[2 + j, tok]) - lp) < 1e-5


def test_drafts_read_the_mtp_cache_an_uncached_pass_writes(tmp_path, monkeypatch):
    """Every step's first draft distribution equals the MTP module's over the whole sequence without a cache: the
    prompt's entries are written in the prefill and copied to each sample's slot (n = 2), a weight update
    rewrites them. (Exactness cannot see a wrong MTP cache: it costs acceptance, never the distribution.)"""
    torch.set_num_threads(1)
    cfg = ModelConfig(name="qwen3-test-mtp")
    model, tokenizer = build_model(cfg), build_tokenizer(cfg)
    new = build_model(ModelConfig(name="qwen3-test-mtp", init_seed=4))
    save_checkpoint_dir(new.state_dict(), new.args, tmp_path)
    gaps: list[float] = []
    draft = SpeculativeDecoder._draft

    def checked(self, seqs, budgets, sampled, u):
        first: list[torch.Tensor] = []
        head = self.model.mtp_logits
        monkeypatch.setattr(self.model, "mtp_logits", lambda d, out: first.append(head(d, out)) or first[-1])
        try:
            result = draft(self, seqs, budgets, sampled, u)
        finally:
            monkeypatch.setattr(self.model, "mtp_logits", head)
        for b, s in enumerate(seqs):  # the reference: a fresh cache, the sequence from position 0
            ids = s.req.prompt + s.tokens
            kv, slot = self.model.make_kv_cache(1, 128), torch.tensor([0])
            pos = torch.arange(len(ids) - 1)[None]
            hidden = self.model.hidden_states(torch.tensor([ids[:-1]]), pos, kv, slot)
            out = self.model.mtp_hidden(0, hidden, torch.tensor([ids[1:]]), pos, kv_cache=kv, cache_slots=slot)
            gaps.append(float((head(0, out[:, -1])[0] - first[0][b]).abs().max()))
        return result

    monkeypatch.setattr(SpeculativeDecoder, "_draft", checked)
    with Engine(model, tokenizer, seq_len=128, max_batch_size=8, draft_tokens=3) as engine:
        engine.pause().result(10)
        futures = [
            engine.submit(p, SamplingParams(max_tokens=40, temperature=1.0, n=2, seed=i))
            for i, p in enumerate([[5, 6, 7], [72, 101, 108, 108, 111, 32, 33]])
        ]
        engine.resume().result(10)
        engine.update_weights(tmp_path, 1).result(60)
        outs = [f.result(60) for f in futures]
    assert any(c.policy_versions[0] == 0 and c.policy_versions[-1] == 1 for o in outs for c in o.completions)
    assert len(gaps) > 20 and max(gaps) < 1e-4


def test_acceptance_rule_matches_the_target_distribution():
    """The rule alone, 20k draws: the first emitted token follows p[0] whatever the draft distribution."""
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, VOCAB, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(2, VOCAB, generator=gen) * 2, -1)
    n = 20_000  # rows of one batched call, each with its own uniforms
    u = torch.rand(n, 5, generator=gen, dtype=torch.float64)
    drafts = torch.stack([inverse_cdf(q[j].expand(n, -1), u[:, j]) for j in range(2)], 1)
    kept, last = accept_sampled(p.expand(n, -1, -1), q.expand(n, -1, -1), drafts, torch.full((n,), 2), u)
    first = torch.where(kept > 0, drafts[:, 0], last)
    observed = torch.bincount(first, minlength=VOCAB).double()
    assert chi_squared_p(observed, p[0].double() * n) > 0.01
    # the second emitted token, among rows that kept the first draft, follows p[1]
    second = torch.where(kept > 1, drafts[:, 1], last)[kept > 0]
    assert chi_squared_p(torch.bincount(second, minlength=VOCAB).double(), p[1].double() * len(second)) > 0.01


def test_greedy_rule_and_processed_probabilities():
    assert accept_greedy([3, 4, 5], [3, 4]) == [3, 4, 5]
    assert accept_greedy([3, 9, 5], [3, 4]) == [3, 9]
    assert accept_greedy([1, 2], [0]) == [1]
    logp = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert processed_probs(logp, 0.7).tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])
    assert processed_probs(logp, 1.0).tolist() == pytest.approx([0.5, 0.3, 0.15, 0.05])


def test_metrics_page_and_per_step_figures_report_acceptance_and_decode_speed():
    torch.set_num_threads(1)
    cfg = ModelConfig(name="qwen3-test-mtp")
    model, tokenizer = build_model(cfg), build_tokenizer(cfg)
    figures = StepFigures.__new__(StepFigures)  # only its decode counters are exercised here
    figures._last_engine = {}

    async def step_figures(url: str) -> dict[str, float]:
        async with InferenceClient([url], timeout=30, max_retries=0) as client:
            return figures.decoding(await client.engine_counters())

    with (
        Engine(model, tokenizer, seq_len=64, max_batch_size=4, draft_tokens=3) as engine,
        BackgroundServer(engine, tokenizer, model_name="qwen3-test-mtp") as srv,
    ):
        engine.submit([1, 2, 3], SamplingParams(max_tokens=30, temperature=1.0, n=2, seed=0)).result(60)
        first, a = asyncio.run(step_figures(srv.url)), engine.stats()
        engine.submit([4, 5], SamplingParams(max_tokens=20, temperature=0.0)).result(60)
        second, b = asyncio.run(step_figures(srv.url)), engine.stats()
    assert first["spec/acceptance_rate"] == pytest.approx(a.accepted_draft_tokens / a.draft_tokens)
    assert first["spec/mean_accepted_length"] == pytest.approx(a.decode_tokens / a.decode_seq_steps)
    assert first["spec/mean_accepted_length"] > 1 and first["inference/decode_tokens_per_s"] > 0
    # each step's figures are its own: the second request's counters alone
    assert b.decode_tokens - a.decode_tokens == 19
    assert second["spec/acceptance_rate"] == pytest.approx(
        (b.accepted_draft_tokens - a.accepted_draft_tokens) / (b.draft_tokens - a.draft_tokens)
    )
    assert second["spec/mean_accepted_length"] == pytest.approx(19 / (b.decode_seq_steps - a.decode_seq_steps))
