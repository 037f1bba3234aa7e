"""Which checkpoint tensors a load reads: a stand-in for `safetensors.safe_open` that records every name asked of
it (arbor.models.hf reads every tensor through `safe_open(...).get_tensor`)."""

from __future__ import annotations

from safetensors import safe_open


def recording_safe_open(read: list[str]) -> type:
    """A `safe_open` replacement appending each tensor name read to `read`."""

    class Recording:
        def __init__(self, *args, **kwargs):
            self.file = safe_open(*args, **kwargs)

        def __enter__(self):
            self.handle = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def get_tensor(self, name: str):
            read.append(name)
            return self.handle.get_tensor(name)

    return Recording
