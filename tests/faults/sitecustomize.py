"""Fault injection for end-to-end runs: with this folder on PYTHONPATH and `CORRUPT_BROADCAST=V:TIMES[,V:TIMES...]`
in the environment, the process that publishes weights (trainer rank 0) damages version V's shards
(`damage.invert_middle`) after their checksums are in the manifest and before `STABLE` makes them visible, the
first TIMES times it publishes V: a disk that damaged the copy as it was written. Python imports `sitecustomize`
at start-up in every process; without the variable this does nothing, and arbor.weights.transport is patched
only when some process imports it (the hook below), so the other processes start as usual. Used by
tests/e2e/test_ckpt_trust_e2e.py.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

from damage import invert_middle  # beside this file, on PYTHONPATH with it

SPEC = os.environ.get("CORRUPT_BROADCAST")
TARGET = "arbor.weights.transport"


def _patch(module) -> None:
    left = {int(v): int(n) for v, n in (item.split(":") for item in SPEC.split(","))}  # version -> times left
    make_visible = module._make_visible

    def damaging(output_dir, step):
        if left.get(step, 0) > 0:
            left[step] -= 1
            for shard in sorted(module.broadcast_staging_dir(output_dir, step).glob("*.safetensors")):
                invert_middle(shard)
            print(f"[fault] damaged the shards of weights version {step}", file=sys.stderr, flush=True)
        return make_visible(output_dir, step)

    module._make_visible = damaging


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds arbor.weights.transport through the other finders and patches it once it has executed."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # once, and not in its own way
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if SPEC:
    sys.meta_path.insert(0, _PatchOnImport())
