"""Transport between processes: rollout batches (orchestrator -> trainer) and published weights (trainer ->
inference)."""
