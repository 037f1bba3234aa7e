"""The trainer process: the RL loop (`main`), policy losses (`loss`), FSDP2 parallelism (`parallel`), the per-step
compute shared by the loop and the benchmark (`step`), DCP checkpoints (`checkpoint`) and the SFT warm-up (`sft`).

Nothing heavy is imported here, so `from arbor.trainer.checkpoint import latest_checkpoint` stays cheap.
"""
