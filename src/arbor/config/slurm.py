"""`[slurm]`: submit the `rl` run as a SLURM batch job instead of running it here."""

from __future__ import annotations

from pydantic import Field, model_validator

from arbor.config.base import Config, FixedPort, Ranks


class SlurmConfig(Config):
    """With this table, `rl` writes `<output_dir>/rl.sbatch` and submits it with `sbatch` (`--dry-run`: only writes)."""

    job_name: str = "arbor"
    """Job name (`#SBATCH --job-name`)."""
    partition: str | None = None
    """Partition; default: the cluster's default partition."""
    account: str | None = None
    """Account to charge; default: the user's default account."""
    time: str = "04:00:00"
    """Wall-clock limit, in any format sbatch accepts (e.g. "1-00:00:00", "30:00")."""
    inference_nodes: Ranks = Field(0, ge=0)
    """Nodes that only run inference servers (multi-node layout). 0 = single node: every process on one node."""
    trainer_nodes: Ranks = Field(1, ge=1)
    """Nodes of the trainer (torchrun rendezvous across them); the orchestrator runs beside trainer rank 0.
    More than one requires inference_nodes >= 1."""
    gpus_per_node: Ranks = Field(0, ge=0)
    """GPUs requested per node (`--gpus-per-node`); 0 = a CPU job."""
    cpus_per_node: Ranks | None = Field(None, ge=1)
    """CPU cores per node (`--cpus-per-task`, one task per node); default: the cluster's default."""
    mem: str | None = None
    """Memory per node (`--mem`, e.g. "200G"; "0" = all of it); default: the cluster's default."""
    container_image: str | None = None
    """Run every process inside this container image (Pyxis/enroot `srun --container-image`)."""
    container_mounts: str | None = None
    """Pyxis `--container-mounts` (e.g. "/data:/data"); the project and output_dir must be visible inside."""
    shared_fs: bool = True
    """output_dir is on a filesystem every node sees. False (single node only): the run writes to node-local
    `$TMPDIR` and the run directory is copied to output_dir when the job ends."""
    inference_port: FixedPort = 8000
    """Port of each inference server in the multi-node layout."""
    rdzv_port: FixedPort = 29500
    """Port of the trainer's torchrun rendezvous on the first trainer node (multi-node layout)."""
    extra_sbatch: list[str] = []
    """Further `#SBATCH` options, verbatim (e.g. ["--qos=high", "--exclusive"])."""
    setup: list[str] = []
    """Shell lines run on the node before arbor starts (module loads, environment variables)."""

    @model_validator(mode="after")
    def _layout(self) -> "SlurmConfig":
        if self.trainer_nodes > 1 and self.inference_nodes == 0:
            raise ValueError("trainer_nodes > 1 needs inference_nodes >= 1 (the multi-node layout)")
        if self.inference_nodes and not self.shared_fs:
            raise ValueError(
                "shared_fs = false works on one node only: multi-node runs exchange rollouts and weights through "
                "output_dir"
            )
        return self

    @property
    def nodes(self) -> int:
        return self.inference_nodes + self.trainer_nodes if self.inference_nodes else 1
