"""arbor: asynchronous RL post-training for LLMs and agents."""
