"""The `trainer` entry point: parses the config, then runs the trainer loop (arbor.trainer.loop).

Run alone as `trainer @ cfg.toml` (a world of one rank) or under torchrun for FSDP2 over several ranks:
`torchrun --standalone --nproc-per-node 2 -m arbor.trainer.main @ cfg.toml`. Kept apart from the loop so that a
bad config fails in milliseconds, before torch loads.
"""

from __future__ import annotations

import os
import sys

from arbor.checkpoint_manifest import stop_cleanly
from arbor.config.loader import load_config, main_guard
from arbor.config.trainer import TrainerConfig
from arbor.monitor.heartbeat import install


@main_guard
def main(argv: list[str] | None = None) -> int:
    cfg = load_config(TrainerConfig, argv, prog="trainer")
    # Heartbeat and stack dumps from here on: loading torch and its distributed modules takes seconds, and a
    # start-up that hangs must show in the watchdog's diagnosis too. torchrun sets RANK before the group forms.
    install(cfg.output_dir, f"trainer_rank{os.environ.get('RANK', '0')}", "loading torch")
    from arbor.trainer.loop import run  # torch loads here, once the config is known to be valid

    # a damaged checkpoint or a full disk: one line from rank 0, no traceback
    return stop_cleanly(lambda: run(cfg), speak=os.environ.get("RANK", "0") == "0")


if __name__ == "__main__":
    sys.exit(main())
