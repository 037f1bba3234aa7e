"""Orchestrator: rollouts, rewards, advantages and batches for the trainer."""
