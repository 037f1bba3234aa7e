"""Run under torchrun (2 ranks, gloo, CPU) by tests/trainer/test_checkpoint_trust.py: the trainer's own entry
point, with a full disk injected into trainer rank 1's checkpoint writes of step `ENOSPC_AT_CHECKPOINT` (unset:
none), as a disk that fills mid-run would fail DCP's writer on one rank.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/trainer/ckpt_fault_check.py ARGS...
"""

from __future__ import annotations

import errno
import os
import sys

from torch.distributed.checkpoint.filesystem import FileSystemWriter

from arbor.run_dir import step_name
from arbor.trainer.main import main

ENOSPC_AT = os.environ.get("ENOSPC_AT_CHECKPOINT")
"""The checkpoint step whose shard writes fail on rank 1 with ENOSPC."""


def inject_enospc(step: int) -> None:
    write_data = FileSystemWriter.write_data

    def failing(self, plan, planner):
        if str(self.path).rstrip("/").endswith(f"{step_name(step)}/trainer"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = failing


if __name__ == "__main__":
    if ENOSPC_AT is not None and os.environ.get("RANK") == "1":
        inject_enospc(int(ENOSPC_AT))
    sys.exit(main(sys.argv[1:]))
