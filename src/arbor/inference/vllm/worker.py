"""vLLM worker extension (`--worker-extension-cls arbor.inference.vllm.worker.WeightUpdateExtension`).

vLLM mixes this class into each worker (CUDA or CPU); the proxy in `arbor.inference.vllm.proxy` calls its
methods on every worker through vLLM's `collective_rpc`. Every load goes through the model runner's
`reload_weights(..., is_checkpoint_format=True)`: it takes (Hugging Face name, tensor) pairs, maps them onto
vLLM's fused/sharded layouts (qkv, gate_up, tensor-parallel slices) and redoes vLLM's post-load processing
(quantised layers' scale layouts included). A plain `model.load_weights` on a served model fails, because vLLM
drops each parameter's `weight_loader` after that processing. Each load is bounded by the transport's timeout
(`WeightTransferTimeout`), so a missing sender fails the RPC instead of hanging the engine.

Why not vLLM 0.32's own weight-transfer endpoints: none of its transfer engines reads a published directory
(arbor's filesystem transport, checksummed), and its NCCL engine expects a trainer that speaks vLLM's client
protocol with one group per server, while arbor's group spans the trainer and every replica.

This module imports no vLLM symbol at import time (vLLM imports it inside a worker; the NCCL path imports
vLLM's world group there, to place the worker in the weight group). The NCCL path keeps one `ReceiverGroup` per
worker for the whole run: the communicator formed at the first update is reused until the trainer's rendezvous
says a new generation formed (a replica restarted, or the trainer did).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from arbor.weights.comm import ReceiverGroup, receive_buckets
from arbor.weights.transport import read_nccl_layout, read_verified, wait_stable


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _repack_cpu(model: torch.nn.Module, head: torch.nn.Module) -> None:
    """Redoes what vLLM 0.32's CPU build leaves stale after an in-place reload.

    - lm_head is computed from a packed copy of its weight (`cpu_linear`). A tied lm_head receives no tensor
      of its own on a reload, so its old packed copy would stay while the shared embedding changes: repack
      it (for an untied head this repeats what the reload did).
    - Unquantised MoE experts are prepacked for the CPU grouped GEMM on the first load only: on a weight
      update vLLM copies the new, unpacked expert weights into the packed tensors and skips the prepack.
      Prepack them again (only where no intermediate padding is involved, which the prepack would redo).
    """
    head.quant_method.process_weights_after_loading(head)  # type: ignore[union-attr, operator]
    for module in model.modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        cfg = getattr(experts, "moe_config", None)
        if experts is None or cfg is None or not hasattr(experts, "_padded_intermediate_size"):
            continue
        if experts._padded_intermediate_size(cfg) == cfg.intermediate_size_per_partition:
            experts.process_weights_after_loading(module)


class WeightUpdateExtension:
    """Methods vLLM adds to its Worker; `self.model_runner` and `self.device` are the worker's. Its own names
    (`arbor_*` RPCs, `weight_receiver`, the helpers) are ones vLLM's Worker does not use."""

    weight_receiver: ReceiverGroup | None = None
    """This worker's place in the run's weight group (the NCCL path), kept across updates until the trainer's
    rendezvous names another group."""

    def _reload_checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.model_runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)  # type: ignore[attr-defined]
        model = self.model_runner.model  # type: ignore[attr-defined]
        head = getattr(model, "lm_head", None)
        if head is not None and hasattr(head, "cpu_linear"):  # vLLM's CPU build
            _repack_cpu(model, head)
        _sync()

    def arbor_load_dir(self, path: str, verify: bool = True, timeout: float = 600.0) -> int:
        """Loads a published step directory (checksummed shards, bf16/fp32 or block-FP8); returns the tensors loaded."""
        state = read_verified(wait_stable(path, timeout), verify)
        self._reload_checkpoint_weights(list(state.items()))
        return len(state)

    def arbor_load_nccl(
        self, path: str, host: str, port: int, rank_offset: int, world_size: int, timeout: float = 600.0
    ) -> int:
        """Receives the buckets listed in `path/transport.json` from trainer rank 0 over the run's weight group
        (NCCL on a CUDA worker, its gloo twin on a CPU one); joins, or rejoins after a restart, as told at the
        update's rendezvous (arbor.weights.comm)."""
        version, buckets = read_nccl_layout(wait_stable(path, timeout))
        group = self.weight_receiver
        if group is None or (group.host, group.port, group.world) != (host, port, world_size):
            # Ranks: trainer 0, then this server's workers from rank_offset, data-parallel rank major.
            device = torch.device(self.device)  # type: ignore[attr-defined]
            group = ReceiverGroup(
                host,
                port,
                rank_offset + self._server_worker_rank(),
                world_size,
                "nccl" if device.type == "cuda" else "gloo",
                timeout,
                device,
            )
            self.weight_receiver = group
        comm = group.join(version)
        self._reload_checkpoint_weights(receive_buckets(comm, buckets, group.device))
        return sum(len(b) for b in buckets)

    def _server_worker_rank(self) -> int:
        """This worker's rank among its server's workers (data-parallel rank major): see `server_worker_rank`."""
        # vLLM's parallel state exists only inside a running worker (this method runs there).
        from vllm.distributed.parallel_state import get_world_group  # worker-only state, see above

        pc = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        return server_worker_rank(pc, get_world_group().rank_in_group)

    def arbor_weight_checksum(self) -> float:
        """Sum of every parameter (float64): lets a test see that an update reached every worker."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        return float(sum(p.detach().double().sum().item() for p in model.parameters()))


def server_worker_rank(parallel_config, rank_in_world_group: int) -> int:
    """A vLLM worker's rank among its server's `data_parallel_size x world_size` workers: data-parallel replica
    major, then its rank within the replica's `world_size` (tensor x pipeline parallel) workers.

    vLLM runs a dense model's data-parallel replicas as independent engines: it resets each one's
    `data_parallel_rank` to 0 and its world group spans that replica's workers only. It runs an MoE model's as one
    world: `data_parallel_rank` is the replica and the world group spans every replica, so `rank_in_group` already
    counts the replica. `data_parallel_index` keeps the replica's index in both cases, and the world rank modulo
    `world_size` is the rank within the replica; `data_parallel_rank * world_size + rank_in_group` collided for dense
    models (every replica 0) and counted the replica twice for MoE ones."""
    pc = parallel_config
    replica = getattr(pc, "data_parallel_index", pc.data_parallel_rank)
    return replica * pc.world_size + rank_in_world_group % pc.world_size
