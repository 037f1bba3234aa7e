"""Shared test setup: GPU tests are skipped with a reason where no CUDA device is present."""

from __future__ import annotations

import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken CUDA install means "no GPU" for test selection
        return False


def pytest_collection_modifyitems(config, items):
    if any(item.get_closest_marker("gpu") for item in items) and not _has_cuda():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; none is present on this machine")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)
