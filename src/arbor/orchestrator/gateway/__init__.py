"""The gateway: an OpenAI-compatible server that records black-box agents' model calls as training samples."""
