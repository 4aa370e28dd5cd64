import os
import shutil

import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def nvcc_available() -> bool:
    return shutil.which("nvcc") is not None


@pytest.fixture(scope="session")
def kernel_build_cache(tmp_path_factory):
    """One build cache for the kernel tests: the shared suite (test_kernels.py) and each task's own
    tests build the same variants once, on whichever xdist worker comes first (the cache is keyed by
    content and a finished build is renamed into place, so two workers racing on a key is safe)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker has its own basetemp under a shared one
        root = root.parent
    cache = root / "kernel_builds"
    cache.mkdir(exist_ok=True)
    return cache
