"""Shared test setup: run from a temp dir so no test writes into the checkout's results/."""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    import torch  # a dependency of the project: a broken torch fails the suite, it does not skip

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run the test with the working directory in a fresh temp dir (results/ lands there)."""
    monkeypatch.chdir(tmp_path)
    os.makedirs("results", exist_ok=True)
    return tmp_path
