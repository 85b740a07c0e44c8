"""Suite-wide test configuration: the ``cuda`` marker.

Every test that needs a CUDA GPU carries ``@pytest.mark.cuda`` (one marker, so ``make gpu-check``
selects them all with ``-m cuda`` and ``tests/project/test_gpu_check.py`` can check that no test decides
it by itself); on a machine without one they are skipped here, with the reason.
"""

from __future__ import annotations

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one; make gpu-check runs them)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
