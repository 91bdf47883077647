"""What context parallelism must get right, checked over a real gloo ring in one torchrun launch of two processes
(``tests/test_context_parallel.py`` starts it and asserts on the JSON it writes):

- ``ring``: ring attention (DIFF V1's two maps, V2's one map over shared K/V, the baseline's one) in fp64 over the
  real ring, both block implementations, against full causal attention: outputs and the gradients of q, k and v;
- ``model``: the debug model at CP=2 against the same model at CP=1, fp32: every token's loss and every parameter's
  gradient (summed over the CP group, as DDP does);
- ``training``: ten trainer steps at CP=2 (DP=1) and at CP=1 (DP=2, the same global batches): losses, gradient
  norms, validation losses and λ.

    python -m torch.distributed.run --nproc_per_node=2 tests/context_parallel_worker.py OUT_JSON RUN_DIR
"""

import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from diff_transformer import distributed  # noqa: E402
from diff_transformer.models.ring_attention import (  # noqa: E402
    IMPLEMENTATIONS,
    ProcessGroupRing,
    context_parallel_chunks,
    load_balanced_indices,
    ring_attention,
)
from tests.ring_reference import KINDS, SCALE, full_attention, ring_inputs  # noqa: E402

KIND_NAMES = ("diff", "diff_v2", "vanilla")
TRAINING_OVERRIDES = ["experiment=smoke", "trainer.max_steps=10", "trainer.eval_interval=5", "optim.warmup_steps=2",
                      "checkpoint.interval=0", "checkpoint.save_at_end=false"]


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def ring_checks(rank: int, size: int):
    """Largest absolute error of each output and gradient against full attention, per kind and implementation."""
    ring = ProcessGroupRing(torch.distributed.group.WORLD)
    errors = {}
    for kind in KINDS:
        for impl in IMPLEMENTATIONS:
            q, k, v, grads_out, maps = ring_inputs(kind, size, torch.float64)
            reference = full_attention(q, k, v, grads_out, maps)
            local = [context_parallel_chunks(t, size, rank, dim=2).clone().requires_grad_() for t in (q, k, v)]
            outs = ring_attention([local[0][:, qs] for qs, _ in maps], local[1], local[2], [kh for _, kh in maps],
                                  SCALE, ring, impl)
            torch.autograd.backward(outs, [context_parallel_chunks(g, size, rank, dim=2) for g in grads_out])
            index = load_balanced_indices(q.shape[2], size, rank)
            got = {f"out{m}": o.detach() for m, o in enumerate(outs)}
            got.update(dq=local[0].grad, dk=local[1].grad, dv=local[2].grad)
            errors[f"{kind}-{impl}"] = {name: max_error(t, reference[name][:, :, index]) for name, t in got.items()}
    return errors


def compose(*overrides):
    from hydra import compose as hydra_compose, initialize_config_dir

    from diff_transformer.config import register_configs, to_object

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return to_object(hydra_compose("config", overrides=list(overrides)))


def set_layout(cp: int) -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    distributed.init_distributed("gloo", tp=1, pp=1, seed=0, cp=cp)


def model_loss_and_grads(kind: str, cp: int, tokens: torch.Tensor):
    """(per-token losses of this rank's positions, gradients of the sequence's mean loss) of the debug model."""
    from megatron.core import parallel_state

    from diff_transformer.models.gpt import build_model_chunk
    from diff_transformer.training.steps import context_parallel_batch, loss_func

    set_layout(cp)
    cfg = compose("experiment=smoke", f"model.attention={kind}", f"parallel.cp={cp}")
    model = build_model_chunk(cfg, 4096)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones_like(tokens[:, 1:]),
             "position_ids": torch.arange(tokens.shape[1] - 1).expand(tokens.shape[0], -1)}
    local, cp_group = context_parallel_batch(batch)
    losses = model(local["tokens"], local["position_ids"], None, labels=local["labels"])
    loss, _ = loss_func(local["loss_mask"], losses, cp_group=cp_group)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        if cp > 1:
            distributed.all_reduce_tensor(grad, group=parallel_state.get_context_parallel_group())
        grads[name] = grad
    return losses.detach(), grads


def model_checks(rank: int, size: int):
    """Per kind: the largest error of the per-token losses, and the largest relative error of any gradient."""
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 4000, (2, 65), generator=generator)
    index = load_balanced_indices(64, size, rank)
    out = {}
    for kind in KIND_NAMES:
        split_losses, split_grads = model_loss_and_grads(kind, size, tokens)
        whole_losses, whole_grads = model_loss_and_grads(kind, 1, tokens)
        out[kind] = {
            "loss": max_error(split_losses, whole_losses[:, index]),
            "grad": max(relative_error(split_grads[n], whole_grads[n]) for n in whole_grads),
            "parameters": len(whole_grads),
        }
    return out


def training_checks(run_dir: Path):
    from diff_transformer.training.trainer import Trainer

    histories = {}
    for kind in KIND_NAMES:
        for cp in (2, 1):
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            cfg = compose(*TRAINING_OVERRIDES, f"model.attention={kind}", f"parallel.cp={cp}")
            trainer = Trainer(cfg, str(run_dir / f"{kind}-cp{cp}"))
            trainer.setup()
            keys = ("loss", "grad_norm", "val_loss", "lambda")
            histories[f"{kind}-cp{cp}"] = [{k: r.get(k) for k in keys} for r in trainer.fit()]
    return histories


def main() -> None:
    out_json, run_dir = Path(sys.argv[1]), Path(sys.argv[2])
    distributed.init_distributed("gloo", tp=1, pp=1, seed=0, cp=1)
    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    results = {"ring": ring_checks(rank, size), "model": model_checks(rank, size), "training": training_checks(run_dir)}
    gathered = distributed.all_gather_objects(results)
    if rank == 0:
        out_json.write_text(json.dumps(gathered))
    distributed.destroy_distributed()


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()
