"""The vLLM backend: the proxy in front of a vLLM server, how arbor launches it, the model directory it serves,
and the hooks vLLM loads by name (worker extension, logits processor, fp32 router plugin)."""
