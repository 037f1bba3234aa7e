"""Inference: the local CPU engine (`arbor.inference.engine`) and the vLLM backend (`arbor.inference.vllm`) behind
one OpenAI/vLLM-compatible HTTP server (`arbor.inference.server`), and the router in front of N of them.

Importing this package loads nothing: config validation loads the backends (arbor.registry.BACKENDS) without
torch or aiohttp.
"""
