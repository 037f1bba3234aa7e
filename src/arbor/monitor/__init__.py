"""Metrics: the run's `metrics.jsonl`, W&B, and the one-line-per-step console summary."""
