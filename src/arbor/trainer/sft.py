"""The `sft` process: supervised fine-tuning on prompt/completion pairs, also `rl`'s optional warm-up.

The entry point only (no torch: a bad config fails in milliseconds); the data is arbor.trainer.sft_data and the
training itself arbor.trainer.sft_train.
"""

from __future__ import annotations

import sys

from arbor.checkpoint_manifest import stop_cleanly
from arbor.config.loader import ConfigError, load_config, main_guard
from arbor.config.sft import SFTConfig
from arbor.monitor.heartbeat import install


@main_guard
def main(argv: list[str] | None = None) -> int:
    cfg = load_config(SFTConfig, argv, prog="sft")  # before torch: a bad config fails in milliseconds
    if cfg.steps == 0:
        raise ConfigError("steps is 0: nothing to train (set --steps N)")
    # A heartbeat from here on: `rl` names what the warm-up does before its first figures (loading torch takes seconds).
    install(cfg.output_dir, "sft", "loading torch")
    from arbor.trainer.sft_train import run_sft  # torch loads here, once the config is known to be valid

    def work() -> int:
        run_sft(cfg)
        return 0

    # a model the warm-up cannot build, a full disk: one line, no traceback
    return stop_cleanly(work)


if __name__ == "__main__":
    sys.exit(main())
