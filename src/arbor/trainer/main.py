"""The `trainer` entry point: parses the config, then runs the trainer loop (arbor.trainer.loop).

Run alone as `trainer @ cfg.toml` (a world of one rank) or under torchrun for FSDP2 over several ranks:
`torchrun --standalone --nproc-per-node 2 -m arbor.trainer.main @ cfg.toml`. Kept apart from the loop so that a
bad config fails in milliseconds, before torch loads.
"""

from __future__ import annotations

import sys

from arbor.config.loader import load_config, main_guard
from arbor.config.trainer import TrainerConfig


@main_guard
def main(argv: list[str] | None = None) -> int:
    cfg = load_config(TrainerConfig, argv, prog="trainer")
    from arbor.trainer.loop import run  # torch loads here, once the config is known to be valid

    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
