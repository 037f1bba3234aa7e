"""Weight transfer from the trainer to the inference fleet in one place: the transport interface and its
filesystem/NCCL implementations, the NCCL group, buckets, verified shard files and the trainer's streamed publish."""
