"""The local inference engine: continuous batching over KV-cache slots (`core`), its model side (`runner`),
token choice (`sampler`), speculative decoding, per-request LoRA adapters and the request records."""
