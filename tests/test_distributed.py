"""Device discipline for collectives: NCCL reduces only CUDA tensors, gloo only CPU tensors. The one module that
calls collectives picks the device from the group's backend, and no other module calls them."""

import ast
from pathlib import Path

import pytest
import torch

from diff_transformer import distributed

REPO = Path(__file__).resolve().parent.parent
COLLECTIVES = {
    "all_reduce", "broadcast", "all_gather", "all_gather_object", "broadcast_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "all_gather_into_tensor", "gather", "gather_object", "scatter", "scatter_object_list",
    "barrier", "monitored_barrier", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
    "batch_isend_irecv",
}


def collective_calls(path: Path):
    """(line, name) of every call to a torch.distributed collective: torch.distributed.X(...), dist.X(...), or X(...)
    imported from torch.distributed."""
    tree = ast.parse(path.read_text())
    aliases, imported = {"torch.distributed"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "torch.distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            imported |= {a.asname or a.name for a in node.names if a.name in COLLECTIVES}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in COLLECTIVES and ast.unparse(func.value) in aliases:
            yield node.lineno, ast.unparse(func)
        elif isinstance(func, ast.Name) and func.id in imported:
            yield node.lineno, func.id


def test_no_module_but_distributed_calls_a_collective():
    files = [REPO / "train.py"] + [p for top in ("diff_transformer", "data", "launch", "kernels")
                                   for p in sorted((REPO / top).rglob("*.py"))]
    found = [f"{p.relative_to(REPO)}:{line} {name}" for p in files if p.name != "distributed.py"
             for line, name in collective_calls(p)]
    assert found == [], "route these through diff_transformer.distributed"


def test_the_scan_sees_every_spelling(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch.distributed import all_reduce as ar\n"
        "def f(t):\n    torch.distributed.all_reduce(t)\n    dist.broadcast(t, 0)\n    ar(t)\n"
        "    torch.distributed.get_rank()\n"
    )
    assert [name for _, name in collective_calls(source)] == ["torch.distributed.all_reduce", "dist.broadcast", "ar"]


@pytest.mark.parametrize("backend, device", [("nccl", "cuda"), ("NCCL", "cuda"), ("gloo", "cpu")])
def test_backend_decides_the_device(backend, device):
    assert distributed.device_type_for_backend(backend) == device


def test_an_nccl_group_gets_cuda_tensors_without_allocating(monkeypatch):
    """What NCCL would be handed, decided from the group's backend alone (no GPU needed, nothing allocated)."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert distributed.collective_device("a group") == torch.device("cuda", 3)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    with pytest.raises(RuntimeError, match="a cpu tensor cannot be reduced over a nccl group, which needs cuda"):
        distributed.all_reduce_tensor(torch.zeros(2), group="a group")
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    assert distributed.collective_device("a group") == torch.device("cpu")


def test_small_collectives_in_a_gloo_world_of_one(megatron_single_process):
    assert distributed.all_reduce_values([1.5, 2]) == [1.5, 2.0]
    assert distributed.any_rank(True) and not distributed.any_rank(False)
    assert distributed.broadcast_values([7.0], src=0) == [7.0]
    assert distributed.broadcast_object({"a": 1}) == {"a": 1}
