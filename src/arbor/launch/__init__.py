"""The `rl` launcher: local process supervision (SLURM rendering arrives with the operations issue)."""
