"""GPU tests: skipped without CUDA; `gpu_indices` sizes a test to the GPUs present (1 to 8)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture
def gpu_indices() -> list[int]:
    return list(range(min(torch.cuda.device_count(), 8)))
