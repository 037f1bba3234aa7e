"""On-policy distillation, piece by piece: the local server's vLLM-style prompt logprobs (against a full forward),
the orchestrator's teacher client (scores, retries, clear errors), teacher logprobs through the batch (plain and
prefix-merged rows, safetensors round trip), the trainer's reverse-KL term against a per-sample oracle (value and
gradient within 1e-6, alone and added to an RL loss), a train step's `distill/reverse_kl`, and the config rules."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from aiohttp import web

from arbor.config.loader import ConfigError, load_config
from arbor.config.model import ModelConfig
from arbor.config.orchestrator import TeacherConfig
from arbor.config.rl import RLConfig
from arbor.config.trainer import LossConfig
from arbor.inference.engine.core import Engine
from arbor.inference.server import BackgroundServer
from arbor.launch.preflight import PreflightError, run_checks
from arbor.launch.rl import resolve
from arbor.models import build_model, build_tokenizer
from arbor.orchestrator.batcher import build_step_batches
from arbor.orchestrator.rollout import Rollout
from arbor.orchestrator.teacher import Teacher, TeacherError
from arbor.trainer.loss import LossContext, build_loss
from arbor.trainer.parallel_state import ParallelState
from arbor.trainer.step import train_step
from arbor.transport.batch import MicroBatch, StepBatch
from arbor.transport.http import start_site

CFG = ModelConfig(name="qwen3-test")
TOK = build_tokenizer(CFG)
F64 = torch.float64


STATE = ParallelState(vocab=TOK.vocab_size)
"""How the trainer prepares `make_model`'s model: its policy spans the tokenizer's ids."""


def make_model(seed: int = 0) -> torch.nn.Module:
    """qwen3-test (264 head rows, 259 byte-tokenizer ids); run it with `STATE`."""
    model = build_model(CFG)
    model.init_weights(seed, std=0.3)
    return model.eval()


@contextlib.contextmanager
def local_server(model: torch.nn.Module) -> Iterator[str]:
    with (
        Engine(model, TOK, seq_len=64, max_batch_size=4, seed=0) as engine,
        BackgroundServer(engine, TOK, model_name="teacher") as srv,
    ):
        yield srv.url


def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@torch.no_grad()
def raw_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """`log_softmax(logits)` of a full forward over the tokenizer's ids (the policy's): row i predicts ids[i + 1]."""
    return torch.log_softmax(model(torch.tensor([ids]))[0, :, : TOK.vocab_size].float(), dim=-1)


# ---- the local engine's prompt logprobs ----


def test_server_prompt_logprobs_are_the_raw_models_in_vllms_format():
    model = make_model()
    ids = TOK.encode("reverse me")
    ref = raw_logprobs(make_model(), ids)
    with local_server(model) as url:
        # temperature 0.7 for the sample: prompt logprobs stay the raw (temperature 1) model's, as vLLM's
        status, r = post(
            url + "/v1/completions",
            {"prompt": ids, "max_tokens": 2, "temperature": 0.7, "prompt_logprobs": 2, "seed": 1},
        )
        assert status == 200, r
        (choice,) = r["choices"]
        plp = choice["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        for i in range(1, len(ids)):
            entry = plp[i]
            row = ref[i - 1]
            got = entry[str(ids[i])]
            assert abs(got["logprob"] - float(row[ids[i]])) < 1e-5
            assert got["rank"] == int((row > row[ids[i]]).sum()) + 1
            top = row.topk(2)
            for rank, (lp, tok) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
                assert abs(entry[str(tok)]["logprob"] - lp) < 1e-5 and entry[str(tok)]["rank"] == rank
            assert set(entry) <= {str(ids[i]), *map(str, top.indices.tolist())}
            assert entry[str(ids[i])]["decoded_token"] == TOK.decode([ids[i]], skip_special_tokens=False)

        status, r = post(url + "/v1/completions", {"prompt": ids, "max_tokens": 1})
        assert status == 200 and "prompt_logprobs" not in r["choices"][0]
        for bad in (-1, 21, "2", True):
            status, r = post(url + "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": bad})
            assert status == 400 and r["error"]["param"] == "prompt_logprobs", r


# ---- the orchestrator's teacher client ----


def rollout(prompt: list[int], completion: list[int], mask: list[int] | None = None, group: int = 0) -> Rollout:
    return Rollout(
        0,
        prompt,
        completion,
        [-1.0] * len(completion),
        [0] * len(completion),
        "",
        "length",
        group_id=group,
        completion_mask=mask,
    )


def test_teacher_scores_each_completion_token_given_its_prefix():
    model = make_model(3)
    prompts = [TOK.encode("ab"), TOK.encode("hello")]
    completions = [TOK.encode("xyz!"), TOK.encode("q")]
    with local_server(model) as url:

        async def score() -> list[Rollout]:
            rollouts = [rollout(p, c) for p, c in zip(prompts, completions)] + [rollout(prompts[0], [])]
            async with Teacher(TeacherConfig(url=url, model="teacher")) as teacher:
                await teacher.wait_ready()
                await teacher.score(rollouts)
            return rollouts

        rollouts = asyncio.run(score())
    ref = make_model(3)
    for r in rollouts[:2]:
        ids = r.prompt_ids + r.completion_ids
        lp = raw_logprobs(ref, ids)
        want = [float(lp[i - 1, ids[i]]) for i in range(len(r.prompt_ids), len(ids))]
        assert r.teacher_logprobs == pytest.approx(want, abs=1e-5)
    assert rollouts[2].teacher_logprobs == []


@contextlib.contextmanager
def fake_teacher(replies: list[tuple[int, Any]]) -> Iterator[tuple[str, list[dict]]]:
    """An HTTP server answering /v1/completions with `replies` in turn; yields its URL and the bodies it got."""
    seen: list[dict] = []
    loop = asyncio.new_event_loop()

    async def completions(request: web.Request) -> web.Response:
        seen.append(await request.json())
        status, body = replies[min(len(seen), len(replies)) - 1]
        return web.json_response(body, status=status)

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions)])
    runner, url = loop.run_until_complete(start_site(app, "127.0.0.1", 0))
    # served from a thread: the client under test runs its own event loop
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield url, seen
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()


def scored(url: str, retries: int = 2, key: str | None = None) -> list[float]:
    async def go() -> list[float]:
        async with Teacher(TeacherConfig(url=url, max_retries=retries, api_key=key)) as teacher:
            return (await teacher.logprobs([5, 6], [7, 8])).logprobs

    return asyncio.run(go())


def vllm_reply(ids: list[int], lps: list[float]) -> dict[str, Any]:
    plp = [None] + [{str(t): {"logprob": lp, "rank": 1, "decoded_token": "x"}} for t, lp in zip(ids[1:], lps)]
    return {"choices": [{"index": 0, "text": "", "prompt_logprobs": plp}]}


def test_teacher_retries_server_errors_and_sends_vllms_request():
    ok = vllm_reply([5, 6, 7, 8], [-0.1, -0.2, -0.3])
    with fake_teacher([(503, {"error": {"message": "busy"}}), (200, ok)]) as (url, seen):
        assert scored(url, key="sekret") == [-0.2, -0.3]
    assert len(seen) == 2
    assert seen[-1] == {"prompt": [5, 6, 7, 8], "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}


@pytest.mark.parametrize(
    "replies, message",
    [
        (
            [(400, {"error": {"message": "token id 999 is not in the vocabulary"}})],
            r"rejected the request \(400\).*999",
        ),
        ([(500, {"error": {"message": "boom"}})] * 3, r"failed after 3 attempts"),
        ([(200, {"choices": [{"index": 0, "text": ""}]})], r"cover NoneType tokens, expected 4 \(does the server"),
        ([(200, vllm_reply([5, 6, 9, 8], [-0.1, -0.2, -0.3]))], r"lack token 7 at position 2"),
        ([(200, {"choices": []})], r"answered without choices"),
    ],
)
def test_teacher_failures_are_one_clear_error(replies, message):
    with fake_teacher(replies) as (url, _), pytest.raises(TeacherError, match=message):
        scored(url)


def test_teacher_needs_a_url():
    with pytest.raises(ValueError, match=r"orchestrator\.teacher\.url is not set"):
        Teacher(TeacherConfig())


# ---- teacher logprobs through the batch ----


@pytest.mark.parametrize("prefix_merge", [False, True])
def test_teacher_logprobs_ride_in_the_batch_per_sample_token(prefix_merge, tmp_path):
    rs = [
        rollout([1, 2, 3], [4, 5], group=0),
        rollout([1, 2, 3], [4, 6, 7], [1, 0, 1], group=0),
        rollout([9, 9], [8], group=1),
    ]
    for k, r in enumerate(rs):
        r.teacher_logprobs = [-(k + 1) - 0.1 * i for i in range(len(r.completion_ids))]
    (batch,) = build_step_batches(rs, 0, 1, 64, 1.0, 0, prefix_merge=prefix_merge)
    (mb,) = batch.torch().micro_batches
    assert mb.merged == prefix_merge
    got = StepBatch.from_tensors(*batch.to_tensors()).torch().micro_batches[0]
    assert torch.equal(got.teacher_logprobs, mb.teacher_logprobs)
    # Per original sample token, in the row's sample order: zero on prompt and inserted tokens.
    want = {
        tuple(r.prompt_ids + r.completion_ids): [0.0] * len(r.prompt_ids)
        + [t if m else 0.0 for t, m in zip(r.teacher_logprobs, r.completion_mask or [1] * len(r.completion_ids))]
        for r in rs
    }
    lens = mb.seq_lens.tolist()
    flat = mb.teacher_logprobs.tolist()
    ids = mb.input_ids[mb.token_nodes.long()].tolist() if mb.merged else mb.input_ids.tolist()
    at = 0
    for n in lens:
        assert flat[at : at + n] == pytest.approx(want[tuple(ids[at : at + n])])
        at += n
    with pytest.raises(ValueError, match=r"teacher_logprobs has shape \(2,\), expected \(3,\)"):
        MicroBatch(
            input_ids=torch.zeros(3, dtype=torch.long),
            position_ids=torch.arange(3),
            loss_mask=torch.ones(3, dtype=torch.bool),
            advantages=torch.zeros(3),
            inference_logprobs=torch.zeros(3),
            policy_versions=torch.zeros(3, dtype=torch.int32),
            seq_lens=torch.tensor([3], dtype=torch.int32),
            teacher_logprobs=torch.zeros(2),
        )


# ---- the trainer's reverse-KL term against a per-sample oracle ----


def random_row(seed: int) -> dict[str, Any]:
    """A packed row of 2-4 samples (prompt tokens, some untrained completion tokens, padding) as per-sample lists
    (the oracle's view) and flat float64 tensors (the loss's view)."""
    rng = random.Random(seed)
    samples = []
    for _ in range(rng.randint(2, 4)):
        p, c = rng.randint(1, 3), rng.randint(2, 6)
        lp = [-rng.uniform(0.05, 3.0) for _ in range(p + c)]
        samples.append(
            {
                "mask": [False] * p + [rng.random() > 0.2 for _ in range(c)],
                "lp": lp,
                "teacher": [x + rng.gauss(0, 0.7) for x in lp],
                "behav": [x + rng.gauss(0, 0.2) for x in lp],
                "adv": [rng.gauss(0, 1) for _ in lp],
                "w": [rng.uniform(0.2, 2.0) for _ in lp],
            }
        )
    pad = rng.randint(0, 3)

    def flat(key: str, fill: Any, dtype=F64) -> torch.Tensor:
        return torch.tensor([v for s in samples for v in s[key]] + [fill] * pad, dtype=dtype)

    ctx = LossContext(
        torch.tensor([len(s["lp"]) for s in samples]), flat("w", 0.0), teacher_logprobs=flat("teacher", -9.0)
    )
    return {
        "samples": samples,
        "lp": flat("lp", -1.0),
        "behav": flat("behav", -1.0),
        "adv": flat("adv", 0.0),
        "mask": flat("mask", False, torch.bool),
        "ctx": ctx,
        "pad": pad,
    }


def oracle(samples: list[dict], coef: float, cap: float | None = None) -> tuple[float, list[float]]:
    """The reverse-KL term by a loop over samples and tokens: value coef * sum w_t k1_t, gradient with respect to
    log pi_theta(t) coef * w_t * k1_t (k1 held as a weight); `cap` adds TIS weights min(pi_theta / mu, cap)."""
    value, grad = 0.0, []
    for s in samples:
        for t in range(len(s["lp"])):
            if not s["mask"][t]:
                grad.append(0.0)
                continue
            k1 = s["lp"][t] - s["teacher"][t]
            w = s["w"][t] * (1.0 if cap is None else min(torch.tensor(s["lp"][t] - s["behav"][t]).exp().item(), cap))
            value += coef * w * k1
            grad.append(coef * w * k1)
    return value, grad


def run_loss(row: dict[str, Any], cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor, dict]:
    lp = row["lp"].clone().requires_grad_(True)
    out = build_loss(cfg)(lp, row["behav"], row["adv"], row["mask"], cfg, row["ctx"])
    out.loss_sum.backward()
    return out.loss_sum.detach(), lp.grad, out.metrics


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "cfg, coef, cap",
    [
        (LossConfig(name="distill"), 1.0, None),
        (LossConfig(name="distill", distill_weight=0.3), 0.3, None),
        (LossConfig(name="distill", mismatch_correction="tis", mismatch_cap=1.5), 1.0, 1.5),
    ],
)
def test_pure_distillation_matches_the_per_sample_oracle(seed, cfg, coef, cap):
    row = random_row(seed)
    value, grad, metrics = run_loss(row, cfg)
    want_value, want_grad = oracle(row["samples"], coef, cap)
    assert abs(value.item() - want_value) < 1e-6
    torch.testing.assert_close(grad, torch.tensor(want_grad + [0.0] * row["pad"], dtype=F64), atol=1e-6, rtol=0)
    k1 = [s["lp"][t] - s["teacher"][t] for s in row["samples"] for t in range(len(s["lp"])) if s["mask"][t]]
    assert abs(metrics["distill/reverse_kl_sum"].item() - sum(k1)) < 1e-6
    k3 = sum(torch.tensor(-k).expm1().item() + k for k in k1)
    assert abs(metrics["distill/reverse_kl_k3_sum"].item() - k3) < 1e-6 and k3 >= 0


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo"])
def test_the_term_adds_to_any_rl_loss_with_its_weight(seed, name):
    row = random_row(seed)
    base_value, base_grad, _ = run_loss(row, LossConfig(name=name))
    value, grad, metrics = run_loss(row, LossConfig(name=name, distill_weight=0.5))
    want_value, want_grad = oracle(row["samples"], 0.5)
    assert abs((value - base_value).item() - want_value) < 1e-6
    torch.testing.assert_close(
        grad - base_grad, torch.tensor(want_grad + [0.0] * row["pad"], dtype=F64), atol=1e-6, rtol=0
    )
    assert "distill/reverse_kl_sum" in metrics


def test_the_term_without_teacher_logprobs_fails_unless_the_row_trains_nothing():
    row = random_row(0)
    row["ctx"].teacher_logprobs = None
    with pytest.raises(ValueError, match=r"needs the teacher's logprobs in the batch: set \[orchestrator\.teacher\]"):
        run_loss(row, LossConfig(name="distill"))
    row["mask"] = torch.zeros_like(row["mask"])
    value, grad, _ = run_loss(row, LossConfig(name="ppo_clip", distill_weight=1.0))
    assert value.item() == 0.0 and not grad.any()


def sample_logprobs(model: torch.nn.Module, samples: list[list[int]]) -> torch.Tensor:
    """Packed per-token logprobs of each sample's tokens (0 at each sample's first token)."""
    out = []
    for x in samples:
        lp = raw_logprobs(model, x)[:-1].gather(1, torch.tensor(x[1:])[:, None])[:, 0]
        out.append(torch.cat([torch.zeros(1), lp]))
    return torch.cat(out)


def test_a_train_step_reports_the_reverse_kl_and_moves_towards_the_teacher():
    student, teacher = make_model(1), make_model(2)
    ids = [TOK.encode("abcdefg" * 2), TOK.encode("hgfedcba")]
    lens = [len(x) for x in ids]
    n = sum(lens)
    t_lp = sample_logprobs(teacher, ids)
    mask = torch.cat([torch.tensor([False] * 3 + [True] * (k - 3)) for k in lens])
    mb = MicroBatch(
        input_ids=torch.tensor([t for x in ids for t in x]),
        position_ids=torch.cat([torch.arange(k) for k in lens]),
        loss_mask=mask,
        advantages=torch.zeros(n),
        inference_logprobs=torch.zeros(n),
        policy_versions=torch.zeros(n, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        teacher_logprobs=t_lp,
    )
    k1 = lambda: (sample_logprobs(student, ids) - t_lp)[mask]  # noqa: E731

    cfg = LossConfig(name="distill")
    opt = torch.optim.SGD(student.parameters(), lr=0.05)
    before = k1()
    student.train()
    figures = train_step(
        student,
        opt,
        StepBatch(0, [mb], int(mask.sum()), 2, 1.0),
        build_loss(cfg),
        cfg,
        1e9,
        torch.device("cpu"),
        state=STATE,
    )
    assert abs(figures["distill/reverse_kl"] - before.mean().item()) < 1e-4
    assert "distill/reverse_kl_k3" in figures and "loss/distill/reverse_kl_mean" not in figures
    assert abs(figures["loss"] - before.mean().item()) < 1e-4  # pure distillation: the loss's value is k1's mean
    # On fixed tokens the term's gradient, k1 * grad log pi, is that of sum(k1^2) / 2: each token's gap shrinks.
    assert k1().square().sum() < before.square().sum()


# ---- config ----

TINY = ["@", "examples/tiny/rl.toml"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--trainer.loss.name", "distill"], r"trainer\.loss\.distill_weight > 0 .* needs a teacher"),
        (["--trainer.loss.distill-weight", "0.5"], r"needs a teacher: set orchestrator\.teacher\.url"),
        (["--orchestrator.teacher.url", "http://t:1"], r"a teacher is set but trainer\.loss\.distill_weight is 0"),
        (
            ["--orchestrator.teacher.model", "m", "--trainer.loss.name", "distill"],
            r"orchestrator\.teacher\.url is not set",
        ),
        (
            [
                "--trainer.loss.name",
                "distill",
                "--trainer.loss.distill-weight",
                "0",
                "--orchestrator.teacher.url",
                "http://t",
            ],
            r"trainer\.loss: .*distill_weight = 0 with name = 'distill' trains nothing",
        ),
        (["--trainer.loss.distill-weight", "-1"], r"trainer\.loss\.distill_weight"),
        (
            [
                "--orchestrator.teacher.url",
                "http://t:1",
                "--trainer.loss.name",
                "distill",
                "--teacher.model.name",
                "qwen3-tiny",
            ],
            r"orchestrator\.teacher\.url = 'http://t:1' and a \[teacher\] section",
        ),
        (["--inference.frozen", "true"], r"inference\.frozen = true: the policy's servers take the trainer's weights"),
        (
            ["--teacher.model.name", "qwen3-tiny", "--teacher.seq-len", "48", "--trainer.loss.name", "distill"],
            r"teacher\.seq_len \(48\) must exceed seq_len \(48\)",
        ),
        (
            [
                "--teacher.model.name",
                "qwen3-tiny",
                "--trainer.loss.name",
                "distill",
                "--orchestrator.teacher.top-k",
                "21",
            ],
            r"orchestrator\.teacher\.top_k \(21\) exceeds the 20 logprobs per token the teacher \(local backend\)",
        ),
        (
            [
                "--teacher.model.name",
                "qwen3-tiny",
                "--teacher.backend",
                "vllm",
                "--trainer.loss.name",
                "distill",
                "--orchestrator.teacher.top-k",
                "6",
                "--teacher.vllm.extra-args.max_logprobs",
                "5",
            ],
            r"orchestrator\.teacher\.top_k \(6\) exceeds the 5 logprobs per token the teacher \(vllm backend\)",
        ),
        (
            [
                "--orchestrator.teacher.url",
                "http://t",
                "--trainer.loss.name",
                "distill",
                "--orchestrator.teacher.top-k",
                "4",
                "--orchestrator.sampling.top-p",
                "0.9",
            ],
            r"teacher\.top_k = 4 needs sampling\.top_p = 1",
        ),
        (
            [
                "--orchestrator.teacher.url",
                "http://t",
                "--trainer.loss.name",
                "distill",
                "--orchestrator.teacher.top-k",
                "-1",
            ],
            r"orchestrator\.teacher\.top_k",
        ),
        (
            [
                "--orchestrator.teacher.url",
                "http://t",
                "--trainer.loss.name",
                "distill",
                "--orchestrator.teacher.timeout",
                "0",
            ],
            r"orchestrator\.teacher\.timeout",
        ),
    ],
)
def test_bad_distillation_configs_fail_in_one_line_naming_the_key(argv, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(RLConfig, [*TINY, *argv], env={})
    assert "\n" not in str(e.value)


def test_an_external_teacher_is_passed_through_and_its_key_stays_secret():
    cfg = load_config(
        RLConfig,
        [
            *TINY,
            "--trainer.loss.distill-weight",
            "0.1",
            "--orchestrator.teacher.url",
            "http://gpu7:8000",
            "--orchestrator.teacher.model",
            "Qwen/Qwen3-8B",
        ],
        env={"ARBOR_ORCHESTRATOR__TEACHER__API_KEY": "sekret"},
    )
    assert cfg.teacher is None and cfg.orchestrator.teacher.url == "http://gpu7:8000"
    assert cfg.orchestrator.teacher.api_key.get_secret_value() == "sekret"
    assert "api_key" not in cfg.orchestrator.teacher.to_toml_dict()


def test_rl_launches_a_vllm_teacher_and_allows_its_max_logprobs():
    cfg = load_config(
        RLConfig,
        [
            *TINY,
            "--trainer.loss.name",
            "distill",
            "--teacher.model.name",
            "qwen3-tiny",
            "--teacher.backend",
            "vllm",
            "--orchestrator.teacher.top-k",
            "20",
        ],
        env={},
    )
    assert cfg.teacher.backend == "vllm" and cfg.orchestrator.teacher.top_k == 20
    cfg = load_config(
        RLConfig,
        [
            *TINY,
            "--trainer.loss.name",
            "distill",
            "--teacher.model.name",
            "qwen3-tiny",
            "--teacher.backend",
            "vllm",
            "--orchestrator.teacher.top-k",
            "64",
            "--teacher.vllm.extra-args.max_logprobs",
            "-1",
        ],
        env={},
    )
    assert cfg.orchestrator.teacher.top_k == 64


def test_rl_launches_a_teacher_section_on_a_free_port():
    cfg = load_config(RLConfig, [*TINY, "--trainer.loss.name", "distill", "--teacher.model.name", "qwen3-tiny"], env={})
    assert cfg.teacher.seq_len == cfg.seq_len + 1 and cfg.teacher.model.name == "qwen3-tiny"
    assert cfg.model.name == "qwen3-test" and cfg.orchestrator.teacher.url is None
    cfg = resolve(cfg)
    assert cfg.orchestrator.teacher.url == f"http://127.0.0.1:{cfg.teacher.port}"
    assert cfg.teacher.port != cfg.inference.port and cfg.orchestrator.teacher.model == "qwen3-tiny"


def test_preflight_checks_the_teacher_model_files(tmp_path):
    cfg = load_config(
        RLConfig,
        [
            *TINY,
            "--trainer.loss.name",
            "distill",
            "--teacher.model.name",
            str(tmp_path / "nope"),
            "--output-dir",
            str(tmp_path / "run"),
        ],
        env={},
    )
    with pytest.raises(PreflightError, match=r"^teacher\.model\.name .*nope"):
        run_checks(cfg)
