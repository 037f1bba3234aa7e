"""DeepSeek sparse attention vs dense attention: time at 1k, 2k and 4k tokens and how it grows.

One run times, per sequence length, the attention of one layer with the same head configuration (MLA: `heads`
query heads, latent `kv_lora_rank`, nope/rope/value head dims; causal, one sequence):

- dense: MLA with per-head keys and values expanded from the latent, `scaled_dot_product_attention` (causal);
- dsa-sparse: the top-k sparse attention alone (`arbor.models.dsa.sparse_mla`, `index_topk` keys per query,
  gathered; the selection precomputed), the part of DSA whose cost is O(T x k);
- dsa: the whole of DSA as the model runs it: lightning indexer scores (O(T^2), few small heads, no gradient),
  top-k selection, then the sparse attention;
- dsa+indexer-loss (forward+backward only): `dsa` plus the indexer's KL loss to the attention over the selected
  keys (`trainer.indexer.train`, arbor.models.dsa_indexer_loss), with the indexer's gradients: its cost.

Each is timed forward and forward+backward (gradients of the attention inputs), best of `--repeats`, in CPU
time of one torch thread by default: on a shared machine wall time measures the neighbours, CPU time the work
(`--threads N` for more threads; CPU time then sums them). Growth
= t(4k) / t(1k): 4 is linear, 16 quadratic. The figure (`value`) is DSA's forward+backward growth, indexer
included; target <= 8, the geometric middle between linear and quadratic, i.e. "near-linear" means closer to
linear than to quadratic. The dense growth and the dense/DSA time ratio at 4k are reported beside it.

    uv run python benchmarks/dsa.py [--topk 256] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from smoke import parse_args

from arbor.models.dsa import causal_mask, dense_mla, indexer_topk, mla_scale, sparse_mla
from arbor.models.dsa_indexer_loss import ChunkLoss

LENGTHS = (1024, 2048, 4096)
"""Sequence lengths timed by default; growth is t(last) / t(first)."""


def make_inputs(T: int, a: argparse.Namespace, gen: torch.Generator) -> dict[str, torch.Tensor]:
    def r(*shape, std: float = 1.0):
        return (torch.randn(*shape, generator=gen) * std).requires_grad_(True)

    H = a.heads
    return {
        "q_nope": r(1, T, H, a.nope),
        "q_pe": r(1, T, H, a.rope),
        "c_kv": r(1, T, a.kv_lora_rank),
        "k_pe": r(1, T, a.rope),
        "kv_b": r(H * (a.nope + a.v), a.kv_lora_rank, std=0.05),
        "iq": torch.randn(1, T, a.index_heads, a.index_dim, generator=gen),
        "iw": torch.randn(1, T, a.index_heads, generator=gen),
        "ik": torch.randn(1, T, a.index_dim, generator=gen),
    }


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up (allocator, kernels)
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return min(times)


def run_case(kind: str, x: dict[str, torch.Tensor], a: argparse.Namespace, backward: bool) -> float:
    T = x["q_nope"].shape[1]
    scale = mla_scale(a.nope + a.rope)
    mask = causal_mask(T, torch.device("cpu"))
    mla_in = (x["q_nope"], x["q_pe"], x["c_kv"], x["k_pe"], x["kv_b"])
    fixed = indexer_topk(x["iq"], x["iw"], x["ik"], mask, a.topk)

    index_in = [x[k].detach().requires_grad_(kind == "dsa+indexer-loss") for k in ("iq", "iw", "ik")]

    def step():
        loss = None
        if kind == "dense":
            out = dense_mla(*mla_in, None, a.v, scale)
        else:
            idx, valid = fixed if kind == "dsa-sparse" else indexer_topk(x["iq"], x["iw"], x["ik"], mask, a.topk)
            loss = ChunkLoss(*index_in, idx, valid) if kind == "dsa+indexer-loss" else None
            out = sparse_mla(*mla_in, idx, valid, a.v, scale, loss)
        if backward:
            total = out.float().square().mean() + (loss.kl_sum if loss is not None else 0.0)
            torch.autograd.grad(total, [t for t in [*mla_in, *index_in] if t.requires_grad])

    if not backward:
        with torch.no_grad():
            return best_time(step, a.repeats)
    return best_time(step, a.repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="sequence lengths, shortest first")
    p.add_argument("--topk", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-lora-rank", type=int, default=128)
    p.add_argument("--nope", type=int, default=64)
    p.add_argument("--rope", type=int, default=32)
    p.add_argument("--v", type=int, default=64)
    p.add_argument("--index-heads", type=int, default=4)
    p.add_argument("--index-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    tiny = {"kv_lora_rank": 32, "nope": 16, "rope": 8, "v": 16, "index_heads": 2, "index_dim": 16}
    a = parse_args(p, lengths=[64, 128, 256], topk=16, heads=2, repeats=1, **tiny)
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    times: dict[str, dict[int, float]] = {}
    first, last = a.lengths[0], a.lengths[-1]
    for T in a.lengths:
        x = make_inputs(T, a, gen)
        for kind in ("dense", "dsa-sparse", "dsa", "dsa+indexer-loss"):
            for backward in (False, True) if kind != "dsa+indexer-loss" else (True,):
                key = f"{kind} {'fwd+bwd' if backward else 'fwd'}"
                times.setdefault(key, {})[T] = run_case(kind, x, a, backward)
                print(f"T={T:5d}  {key:18s} {times[key][T] * 1e3:9.1f} ms CPU", flush=True)
    growth = {k: v[last] / v[first] for k, v in times.items()}
    print(f"\ngrowth t({last})/t({first}): linear = {last / first:g}, quadratic = {(last / first) ** 2:g}")
    for k, g in growth.items():
        print(f"  {k:18s} {g:6.2f}")
    value = growth["dsa fwd+bwd"]
    print(
        json.dumps(
            {
                "benchmark": "dsa",
                "value": round(value, 3),
                "target": 8.0,
                "ok": value <= 8.0,
                "metric": "DSA (indexer + top-k + sparse MLA) forward+backward time growth t(4k)/t(1k); 4 = "
                "linear, 16 = quadratic",
                "growth": {k: round(g, 3) for k, g in growth.items()},
                "dense_growth_over_dsa_growth_fwd_bwd": round(growth["dense fwd+bwd"] / value, 3),
                "dense_over_dsa_at_4k_fwd_bwd": round(times["dense fwd+bwd"][last] / times["dsa fwd+bwd"][last], 3),
                "indexer_loss_over_dsa_fwd_bwd": {
                    str(T): round(times["dsa+indexer-loss fwd+bwd"][T] / times["dsa fwd+bwd"][T], 3) for T in a.lengths
                },
                "ms": {k: {str(T): round(t * 1e3, 2) for T, t in v.items()} for k, v in times.items()},
                "lengths": a.lengths,
                "topk": a.topk,
                "heads": a.heads,
                "kv_lora_rank": a.kv_lora_rank,
                "qk_nope_head_dim": a.nope,
                "qk_rope_head_dim": a.rope,
                "v_head_dim": a.v,
                "index_n_heads": a.index_heads,
                "index_head_dim": a.index_dim,
                "threads": torch.get_num_threads(),
                "clock": "process CPU time",
            }
        )
    )


if __name__ == "__main__":
    main()
