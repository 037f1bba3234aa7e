"""vLLM worker extension (`--worker-extension-cls arbor.inference.vllm_worker:WeightUpdateExtension`).

vLLM mixes this class into each GPU worker; the proxy in `arbor.inference.vllm_adapter` calls its methods on
every worker through vLLM's `collective_rpc`. `self.model_runner.model.load_weights` takes (HF name, tensor)
pairs and handles vLLM's fused/sharded layouts (qkv, gate_up, tensor parallel slices), so the trainer's Hugging
Face names work unchanged; block-FP8 checkpoints go through the runner's layerwise `reload_weights`, which
redoes vLLM's post-load processing of quantised layers. Each load is bounded by the transport's timeout (`WeightTransferTimeout`), so a
missing sender fails the RPC instead of hanging the engine.

This module imports no vLLM symbol at import time (vLLM imports it, inside a worker).
"""

from __future__ import annotations

from typing import Any

import torch

from arbor.transport.weights import (
    init_nccl_group, nccl_receive, read_nccl_spec, read_verified, wait_stable,
)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class WeightUpdateExtension:
    """Methods vLLM adds to its Worker; `self.model_runner` and `self.device` are the worker's."""

    _arbor_comm: Any = None

    def arbor_load_dir(self, path: str, verify: bool = True, timeout: float = 600.0) -> int:
        """Loads a published step directory (checksummed shards); returns the tensors loaded."""
        state = read_verified(wait_stable(path, timeout), verify)
        if any(t.dtype == torch.float8_e4m3fn for t in state.values()):
            # A block-FP8 checkpoint (model.fp8 = "block"): vLLM post-processes quantised layers after loading
            # (scale layouts for DeepGEMM/CUTLASS), so a plain `load_weights` into them would be undone or go
            # stale; its layerwise reload takes checkpoint-format tensors and redoes that processing.
            self.model_runner.reload_weights(weights_iterator=list(state.items()), is_checkpoint_format=True)  # type: ignore[attr-defined]
        else:
            self.model_runner.model.load_weights(weights=list(state.items()))  # type: ignore[attr-defined]
        _sync()
        return len(state)

    def arbor_load_nccl(self, path: str, host: str, port: int, rank_offset: int, world_size: int,
                        timeout: float = 600.0) -> int:
        """Receives the tensors listed in `path/transport.json` from trainer rank 0 over NCCL."""
        from vllm.distributed.parallel_state import get_world_group

        spec = read_nccl_spec(wait_stable(path, timeout))
        if self._arbor_comm is None:  # joins the trainer's group on the first update
            # Ranks: trainer 0, then this server's workers from rank_offset, data-parallel rank major.
            pc = self.vllm_config.parallel_config  # type: ignore[attr-defined]
            rank = rank_offset + pc.data_parallel_rank * pc.world_size + get_world_group().rank_in_group
            self._arbor_comm = init_nccl_group(host, port, rank, world_size, self.device, timeout)  # type: ignore[attr-defined]
        received = nccl_receive(self._arbor_comm, spec, self.device, timeout)  # type: ignore[attr-defined]
        self.model_runner.model.load_weights(weights=received)  # type: ignore[attr-defined]
        _sync()
        return len(spec)

    def arbor_weight_checksum(self) -> float:
        """Sum of every parameter (float64): lets a test see that an update reached every worker."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        return float(sum(p.detach().double().sum().item() for p in model.parameters()))
