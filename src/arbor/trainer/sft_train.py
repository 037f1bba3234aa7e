"""SFT training (the `sft` entry point, arbor.trainer.sft, parses the config and prepares the data): packs
examples into block-diagonal rows, minimises cross-entropy on their target tokens, and writes the fine-tuned model
to `<output_dir>/sft/` (`arbor.run_dir.sft_model_dir`) atomically. With `[model.lora]` (and `adapter`) only an
adapter trains (arbor.models.lora); `sft/` then holds the base with the adapter merged into it (what `rl`
continues from, a plain Hugging Face checkpoint) and the adapter itself in PEFT's layout under `sft/adapter/`.
A model with MTP draft modules also fits them to the fine-tuned policy as it trains (`sft.draft`, the RL steps'
top-K KL at temperature 1), so speculative decoding starts RL with drafts that match its starting policy.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from arbor.config.sft import SFTConfig
from arbor.config.trainer import DraftConfig
from arbor.models import build_model, build_tokenizer
from arbor.models.attention import position_ids_for, subtree_end_for
from arbor.models.fp8 import apply_fp8
from arbor.models.hf import save_checkpoint_dir
from arbor.models.lora import apply_lora, check_mergeable, load_adapter_into, lora_parameters, merged_state
from arbor.models.lora_peft import adapter_config, load_adapter, save_adapter
from arbor.models.tokenizer import Tokenizer
from arbor.monitor.heartbeat import beat
from arbor.run_dir import process_metrics_path, sft_model_dir
from arbor.trainer.draft import DraftOut, clip_grad_norm_split, draft_modules, make_draft_fn
from arbor.trainer.parallel_state import UNPREPARED, ParallelState
from arbor.trainer.sft_data import Example, batches, load_examples
from arbor.trainer.step import packed_logprobs


def pack(batch: list[Example], row_len: int) -> list[tuple[torch.Tensor, torch.Tensor, list[int]]]:
    """Packs examples in order into rows of at most `row_len` tokens: (input_ids, loss_mask, seq_lens) per row.
    Token t of a target is in the loss (predicted from everything before it); other tokens are not."""
    rows: list[tuple[list[int], list[bool], list[int]]] = []
    for example_ids, example_mask, *_ in batch:
        n = len(example_ids)
        if not rows or len(rows[-1][0]) + n > row_len:
            rows.append(([], [], []))
        ids, mask, lens = rows[-1]
        ids += example_ids
        mask += example_mask
        lens.append(n)
    return [(torch.tensor(ids), torch.tensor(mask), lens) for ids, mask, lens in rows]


def pack_images(batch: list[Example], row_len: int) -> list[dict[str, torch.Tensor] | None]:
    """The image inputs of each row `pack` makes of `batch` (its examples' images in row order; None for a row
    without images)."""
    rows: list[list[dict]] = []
    used = row_len  # so that the first example opens a row, as in `pack`
    for example in batch:
        n = len(example[0])
        if not rows or used + n > row_len:
            rows.append([])
            used = 0
        used += n
        if len(example) > 2:
            rows[-1].append(example[2])
    return [
        {k: torch.cat([torch.as_tensor(i[k]) for i in images]) for k in ("pixel_values", "image_grid_thw")}
        if images
        else None
        for images in rows
    ]


def run_sft(cfg: SFTConfig) -> dict[str, Any]:
    """Fine-tunes for `cfg.steps` steps, writes `<output_dir>/sft/`, returns the final figures."""
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    tokenizer = build_tokenizer(cfg.model)
    examples = load_examples(cfg, tokenizer)
    beat("building the model")
    model = build_model(cfg.model.model_copy(update={"dtype": "float32"}), device=str(device))
    state = ParallelState(vocab=tokenizer.vocab_size)  # the policy's ids, as `parallelize` records for RL training
    apply_fp8(model, cfg.model)  # fp32 masters, FP8 compute as in RL training
    lora = cfg.model.lora if cfg.adapter else None
    if lora is not None:  # after the FP8 swap, as the RL trainer does (arbor.trainer.parallel)
        apply_lora(model, lora, cfg.model.init_seed)
        check_mergeable(model)  # the end merges the adapter: fail before training, not after
        if lora.path is not None:
            load_adapter_into(model, load_adapter(lora.path)[1], lora.path)
    trains_drafts = cfg.draft.enabled and draft_modules(model) is not None
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    warmup = max(1, math.ceil(0.1 * cfg.steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    dtype = getattr(torch, cfg.model.dtype)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    metrics = process_metrics_path(cfg.output_dir, "sft")
    window: list[float] = []
    drafts_window: list[float] = []
    start = time.perf_counter()
    for step, batch in zip(range(cfg.steps), batches(examples, cfg.batch_size, cfg.seed)):
        beat(f"training step {step + 1}")
        rows = pack(batch, max(cfg.seq_len, cfg.row_tokens))
        images = pack_images(batch, max(cfg.seq_len, cfg.row_tokens))
        targets = sum(int(mask.sum()) for _, mask, _ in rows)
        total = torch.zeros((), device=device)
        draft_kl = torch.zeros((), device=device)
        for (ids, mask, lens), row_images in zip(rows, images):
            draft = cfg.draft if trains_drafts else None
            with autocast:
                logprobs, drafted = row_logprobs(model, ids, lens, device, draft, state, row_images)
            nll = -(logprobs * mask.to(device)).sum() / targets
            if drafted is not None:  # reaches the MTP modules only (arbor.trainer.draft)
                (nll + cfg.draft.weight * drafted.loss / len(rows)).backward()
                draft_kl += drafted.kl_sum / drafted.positions.clamp_min(1) / len(rows)
            else:
                nll.backward()
            total += nll.detach()
        clip_grad_norm_split(model, cfg.max_norm, state)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        window.append(float(total))
        drafts_window.append(float(draft_kl))
        if (step + 1) % 10 == 0 or step + 1 == cfg.steps:
            record = {
                "step": step + 1,
                "sft/loss": sum(window) / len(window),
                "sft/lr": optimizer.param_groups[0]["lr"],
                "sft/time": time.perf_counter() - start,
            }
            if trains_drafts:
                record["sft/draft_kl"] = sum(drafts_window) / len(drafts_window)
            _append(metrics, record)
            print(f"[sft] step {step + 1}/{cfg.steps}: loss {record['sft/loss']:.4f}", file=sys.stderr, flush=True)
            final_loss, window, drafts_window = record["sft/loss"], [], []
    beat("saving the model")
    out = save(cfg, model, tokenizer)
    final = {"sft/loss": final_loss, "sft/steps": cfg.steps, "sft/examples": len(examples), "sft/dir": str(out)}
    _append(metrics, final)
    return final


def row_logprobs(
    model: torch.nn.Module,
    ids: torch.Tensor,
    lens: list[int],
    device: torch.device,
    draft: DraftConfig | None,
    state: ParallelState = UNPREPARED,
    images: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, DraftOut | None]:
    """One packed row's token logprobs and, with `draft`, the MTP modules' draft loss on it (the draft function
    the model's forward calls, as in RL steps); `images`: a vision-language row's pixel inputs."""
    if draft is not None:
        end = subtree_end_for(torch.tensor(lens), ids.shape[0]).to(device)
        model.draft_fn = make_draft_fn(end, 1.0, draft.top_k, state)
    try:
        positions = position_ids_for(lens)[0]
        logprobs, _ = packed_logprobs(model, ids, positions, lens, 1.0, device, False, state=state, images=images)
        return logprobs, model.draft_out if draft is not None else None
    finally:
        if draft is not None:
            model.draft_fn = model.draft_out = None


def save(cfg: SFTConfig, model: torch.nn.Module, tokenizer: Tokenizer) -> Path:
    """Writes `<output_dir>/sft/` atomically: a temporary directory renamed over any previous result."""
    final = sft_model_dir(cfg.output_dir)
    tmp = final.parent / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    dtype = getattr(torch, cfg.model.dtype)
    lora = cfg.model.lora if cfg.adapter else None
    state = merged_state(model) if lora is not None else model.state_dict()
    save_checkpoint_dir({k: v.detach().to("cpu", dtype) for k, v in state.items()}, model.args, tmp, tokenizer)
    if lora is not None:
        adapters = {k: v.detach().to("cpu", dtype) for k, v in lora_parameters(model)}
        save_adapter(tmp / "adapter", adapter_config(lora, cfg.model.name, adapters), adapters)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def _append(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
