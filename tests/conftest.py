"""Shared pytest setup: tiers by marker, so GPU tests skip on CPU machines."""

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
# the fused kernel's outputs NaN-poisoned before its kernels write them, on a GPU as in the interpreter: an element a
# kernel fails to write fails the test (kernels/diff_attn/launch.py, _POISON)
os.environ.setdefault("DIFF_ATTN_POISON", "1")
if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on CPU; set before any kernel module imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The files whose shared runs take longest (seconds on the 2-core CPU machine, two xdist workers), started first so
# that the workers finish together rather than one waiting on a long file begun last. Others keep their order after.
LONGEST_FILES = {
    "test_deepspeed.py": 200, "test_gpu_run.py": 120, "test_memory_switches.py": 145, "test_parallel_kinds.py": 120,
    "test_context_parallel.py": 105, "test_resume.py": 95, "test_parallel.py": 80, "test_hf.py": 80,
    "test_evaluate.py": 55, "test_slurm.py": 55, "test_checkpoint_faults.py": 90, "test_compile.py": 60,
    "test_sweep.py": 60, "test_crash_safety.py": 60, "test_cuda_graphs.py": 70,
}


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -LONGEST_FILES.get(item.path.name, 0))  # stable: a file's tests keep their order
    if torch.cuda.is_available():
        # In-process megatron-core tests run on the CPU world of megatron_single_process, whose patches cannot be
        # applied next to CUDA; on a GPU machine they belong to the CPU tier, run with the GPU hidden:
        # `CUDA_VISIBLE_DEVICES= python -m pytest -m "not gpu"`. Tests that start train.py hide it themselves.
        skip_cpu_world = pytest.mark.skip(
            reason="CPU-tier megatron test: run it with CUDA_VISIBLE_DEVICES= (the GPU hidden)"
        )
        for item in items:
            if item.get_closest_marker("gpu") is None and "megatron_single_process" in getattr(item, "fixturenames", ()):
                item.add_marker(skip_cpu_world)
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        # the marker, not item.keywords: those hold every parent's name too (a checkout in a directory named gpu)
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def megatron_single_process():
    """A gloo world of one with megatron-core's TP=PP=1 groups, for in-process model tests."""
    from diff_transformer.compat import apply_cpu_patches

    apply_cpu_patches()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not torch.distributed.is_initialized():
        # a world of one needs no port: its rendezvous store lives in this process
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    yield
