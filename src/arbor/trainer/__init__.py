"""The trainer process: the entry point (`main`) and the RL loop (`loop`), policy losses (`loss`), FSDP2
parallelism (`parallel`), the per-step compute shared by the loop and the benchmark (`step`), DCP checkpoints
(`checkpoint`) and the SFT warm-up (`sft`).

Nothing is imported here: the `trainer` entry point parses its config before torch loads.
"""
