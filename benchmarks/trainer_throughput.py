"""Trainer throughput: arbor's RL step against a plain PyTorch loop, same model, same data, one run.

The arbor arm is `arbor.trainer.step.train_step`, exactly what the RL loop calls (packed-mask forward, shifted
logprobs with entropy, the ppo_clip loss, metrics, backward, grad-norm clipping, AdamW, the step's figures).
The plain arm is the least a hand-written loop does with the same model and the same packed rows (precomputed
mask, log_softmax + gather, ratio * advantage, backward, AdamW). Arms alternate after a warm-up so that load on
the machine hits both alike; tokens/s are non-padding tokens over the median step time. Last line: `{"benchmark":
"trainer_throughput", "value": arbor/plain, ...}`.

    uv run python benchmarks/trainer_throughput.py [--model qwen3-small] [--repeats 4] [--row-tokens 1024]

On one H100 (2026-11-27, torch 2.11, defaults, `--device cuda`): arbor 16.1k tok/s, plain 23.9k -> 0.67 (target
0.9, missed). qwen3-small's 1,968 tokens a step take ~0.1 s, so fixed per-micro-batch costs dominate there:
arbor's step builds a FlexAttention block mask per row and runs compiled flex attention (the plain arm: SDPA with
a precomputed dense mask) and the vocabulary-chunked logprobs with entropy, which logprobs_memory.py measured
1.5x slower than full logits on that GPU. Not profiled there yet; a larger model is the fairer GPU setting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from smoke import parse_args

from arbor.config.model import ModelConfig
from arbor.config.trainer import LossConfig, TrainerConfig
from arbor.models import build_model, build_tokenizer
from arbor.models.attention import packed_causal_mask, position_ids_for
from arbor.trainer.loss import ppo_clip
from arbor.trainer.parallel import ParallelDims, forward_context
from arbor.trainer.step import train_step
from arbor.transport.batch import MicroBatch, StepBatch


def synthetic_batch(
    vocab: int, micro_batches: int, row_tokens: int, seed: int = 0, sample_tokens: tuple[int, int] = (96, 320)
) -> StepBatch:
    """Rows packed with samples of `sample_tokens` (lowest, highest) tokens (a 32-token prompt each), the last one
    padded to the row. Ids are drawn below `vocab`, the tokenizer's vocabulary size, the ids a policy spans: a
    padded head has more rows than that, and the trainer's chunked logprobs cover only the real ones
    (`arbor.trainer.logprobs.policy_vocab`)."""
    gen = torch.Generator().manual_seed(seed)
    low, high = sample_tokens
    mbs = []
    for _ in range(micro_batches):
        lens: list[int] = []
        while sum(lens) < row_tokens - low:
            lens.append(min(int(torch.randint(low, high + 1, (1,), generator=gen)), row_tokens - sum(lens)))
        mask = torch.zeros(row_tokens, dtype=torch.bool)
        adv = torch.zeros(row_tokens)
        off = 0
        for n in lens:
            mask[off + 32 : off + n] = True
            adv[off : off + n] = torch.randn((), generator=gen)
            off += n
        mbs.append(
            MicroBatch(
                input_ids=torch.randint(0, vocab, (row_tokens,), generator=gen),
                position_ids=position_ids_for(lens, row_tokens)[0],
                loss_mask=mask,
                advantages=adv,
                inference_logprobs=-5.0 + 0.1 * torch.randn(row_tokens, generator=gen),
                policy_versions=torch.zeros(row_tokens, dtype=torch.int32),
                seq_lens=torch.tensor(lens, dtype=torch.int32),
            )
        )
    total = sum(int(m.loss_mask.sum()) for m in mbs)
    return StepBatch(step=0, micro_batches=mbs, loss_tokens_total=total, num_samples_total=0, temperature=1.0)


def plain_step_fn(model: torch.nn.Module, batch: StepBatch, device: torch.device):
    """A hand-written step over the same rows; its inputs are prepared once, outside the timed region."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    rows = []
    for mb in batch.micro_batches:
        rows.append(
            tuple(
                t.to(device)
                for t in (
                    mb.input_ids,
                    mb.position_ids,
                    packed_causal_mask(mb.seq_lens, mb.num_tokens),
                    mb.loss_mask,
                    mb.advantages,
                    mb.inference_logprobs,
                )
            )
        )
    total = batch.loss_tokens_total

    def step() -> None:
        for ids, pos, mask, loss_mask, adv, inf_lp in rows:
            logits = model(ids[None], pos[None], mask)[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)
            ratio = torch.exp(lp - inf_lp[1:])
            loss = -(ratio * adv[1:] * loss_mask[1:]).sum() / total
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def arbor_step_fn(model: torch.nn.Module, batch: StepBatch, device: torch.device, cfg: TrainerConfig):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    dims = ParallelDims.from_world(1)
    loss_cfg = LossConfig()

    def step() -> None:
        train_step(
            model,
            optimizer,
            batch,
            ppo_clip,
            loss_cfg,
            cfg.optim.max_norm,
            device,
            dims.dp_size,
            forward_context(dims, cfg, device.type),
        )

    return step


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-small")
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--row-tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads; 0 = torch's default")
    a = parse_args(p, model="qwen3-test", micro_batches=1, row_tokens=256, repeats=1, warmup=0)
    if a.threads:  # one thread: on a shared CPU box, several threads make timings swing with others' load
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    model_cfg = ModelConfig(name=a.model)
    cfg = TrainerConfig(model=model_cfg)
    batch = synthetic_batch(build_tokenizer(model_cfg).vocab_size, a.micro_batches, a.row_tokens)
    tokens = sum(int(mb.seq_lens.sum()) for mb in batch.micro_batches)
    arms = {
        "arbor": arbor_step_fn(build_model(model_cfg, device=str(device)), batch, device, cfg),
        "plain": plain_step_fn(build_model(model_cfg, device=str(device)), batch, device),
    }
    for _ in range(a.warmup):
        for fn in arms.values():
            timed(fn, device)
    times: dict[str, list[float]] = {k: [] for k in arms}
    for i in range(a.repeats):
        order = list(arms) if i % 2 == 0 else list(reversed(arms))  # alternate who goes first
        for name in order:
            times[name].append(timed(arms[name], device))
        print(f"repeat {i}: " + ", ".join(f"{k} {tokens / times[k][-1]:.0f} tok/s" for k in arms), flush=True)
    # Medians of the interleaved step times: robust to a repeat that another process slowed down.
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    value = tps["arbor"] / tps["plain"]
    print(
        json.dumps(
            {
                "benchmark": "trainer_throughput",
                "value": round(value, 4),
                "target": 0.9,
                "ok": value >= 0.9,
                "arbor_tokens_per_s": round(tps["arbor"], 1),
                "plain_tokens_per_s": round(tps["plain"], 1),
                "arbor_mean_tokens_per_s": round(tokens * len(times["arbor"]) / sum(times["arbor"]), 1),
                "plain_mean_tokens_per_s": round(tokens * len(times["plain"]) / sum(times["plain"]), 1),
                "model": a.model,
                "device": str(device),
                "tokens_per_step": tokens,
                "micro_batches": a.micro_batches,
                "repeats": a.repeats,
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
