"""Shared pytest setup: tiers by marker, so GPU tests skip on CPU machines."""

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on CPU; set before any kernel module imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
