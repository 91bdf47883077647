"""What context parallelism must get right, checked over real gloo groups in one torchrun launch of four processes
(``tests/test_context_parallel.py`` starts it and asserts on the JSON it writes; one launch, because a process's
start, mostly importing megatron-core, costs more than all of its checks):

- ``ring``: ring attention (DIFF V1's two maps, V2's one map over shared K/V, the baseline's one) in fp64 around the
  world's ring of four, both block implementations, against full causal attention: outputs and the gradients of q,
  k and v;
- ``model``: the debug model at CP=4 against the same model at CP=1, fp32, for every kind with a ring path: every
  token's loss and every parameter's gradient (summed over the CP group, as DDP does); DIFF V1, V2 and the baseline
  also with document masking and per-document positions (documents across the chunks' edges);
- ``training``: ten trainer steps of diff, diff_v2 and vanilla at CP=2 (DP=2) and at CP=1 (DP=4, the same global
  batches); DIFF at CP=2 x TP=2 (sequence parallelism, the distributed optimizer), at CP=2 x PP=2 (selective
  recomputation), and at CP=2 resumed from the CP=1 run's checkpoint of step 5: losses, gradient norms, validation
  losses and λ. The CP=1 DIFF run's checkpoints stay in RUN_DIR/diff-cp1 for the tests that start from them.

    python -m torch.distributed.run --nproc_per_node=4 tests/context_parallel_worker.py OUT_JSON RUN_DIR
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
from tests.test_config import compose_cfg as compose  # noqa: E402

KIND_NAMES = ("diff", "diff_v2", "vanilla", "vanilla_wide", "vanilla_subln")
DOCUMENT_KINDS = ("diff", "diff_v2", "vanilla")  # also checked with document masking ("<kind>+documents")
EOD = 2  # the bundled tokenizer's end-of-document token
TRAINING_OVERRIDES = ["experiment=smoke", "trainer.max_steps=10", "trainer.eval_interval=5", "optim.warmup_steps=2",
                      "trainer.micro_batch_size=2", "checkpoint.interval=0", "checkpoint.save_at_end=false"]
SAVES = ["checkpoint.interval=5", "checkpoint.save_at_end=true"]
# name: overrides of each trainer run (the CP=1 DIFF run first: the resumed run starts from its checkpoint)
TRAINING_RUNS = {
    "diff-cp1": ["model.attention=diff", "parallel.cp=1", *SAVES],
    "diff-cp2": ["model.attention=diff", "parallel.cp=2"],
    "diff_v2-cp1": ["model.attention=diff_v2", "parallel.cp=1"],
    "diff_v2-cp2": ["model.attention=diff_v2", "parallel.cp=2"],
    "vanilla-cp1": ["model.attention=vanilla", "parallel.cp=1"],
    "vanilla-cp2": ["model.attention=vanilla", "parallel.cp=2"],
    "diff-cp2-tp2": ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                     "parallel.distributed_optimizer=true"],
    "diff-cp2-pp2": ["parallel.cp=2", "parallel.pp=2", "trainer.recompute=selective"],
    "diff-cp2-resumed": ["parallel.cp=2", "checkpoint.resume={run_dir}/diff-cp1/checkpoints/step_00000005"],
}


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def ring_checks(rank: int, size: int):
    """Largest absolute error of each output and gradient against full attention, per kind and implementation, around
    the ring of the whole world."""
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


def set_layout(cp: int) -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    distributed.init_distributed("gloo", tp=1, pp=1, seed=0, cp=cp)


def model_loss_and_grads(kind: str, cp: int, tokens: torch.Tensor, documents: bool = False):
    """(per-token losses of this rank's positions, gradients of the sequence's mean loss) of the debug model; with
    ``documents``, masked by the documents the EOD tokens delimit, positions restarting per document."""
    from megatron.core import parallel_state

    from data.datasets import document_ids, document_positions
    from diff_transformer.models.gpt import build_model_chunk
    from diff_transformer.training.steps import context_parallel_batch, loss_func, model_inputs

    set_layout(cp)
    cfg = compose("experiment=smoke", f"model.attention={kind}", f"parallel.cp={cp}")
    model = build_model_chunk(cfg, 4096)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones_like(tokens[:, 1:]),
             "position_ids": torch.arange(tokens.shape[1] - 1).expand(tokens.shape[0], -1)}
    if documents:
        batch["document_ids"] = document_ids(batch["tokens"], EOD)
        batch["position_ids"] = document_positions(batch["document_ids"])
    local, cp_group = context_parallel_batch(batch)
    inputs, positions, packed = model_inputs(local, "cpu", reset_position_ids=documents, cp=cp)
    losses = model(inputs, positions, None, labels=local["labels"], packed_seq_params=packed)
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
    tokens = torch.randint(3, 4000, (2, 65), generator=generator)
    tokens[0, [0, 5, 6, 19, 44]] = EOD  # one-token documents, documents across the edges of the chunks of 8
    tokens[1, [30]] = EOD
    index = load_balanced_indices(64, size, rank)  # CP = the world: the CP rank is the rank
    out = {}
    for name in KIND_NAMES + tuple(f"{kind}+documents" for kind in DOCUMENT_KINDS):
        kind, documents = name.split("+")[0], name.endswith("+documents")
        split_losses, split_grads = model_loss_and_grads(kind, size, tokens, documents)
        whole_losses, whole_grads = model_loss_and_grads(kind, 1, tokens, documents)
        out[name] = {
            "loss": max_error(split_losses, whole_losses[:, index]),
            "grad": max(relative_error(split_grads[n], whole_grads[n]) for n in whole_grads if "lambda_" not in n),
            # λ's gradient sums dO·O2 over every token and head, with cancellation: its fp32 floor is higher
            "lambda_grad": max([relative_error(split_grads[n], whole_grads[n]) for n in whole_grads
                                if "lambda_" in n], default=0.0),
            "parameters": len(whole_grads),
        }
    return out


def training_checks(run_dir: Path):
    from megatron.core import parallel_state

    from diff_transformer.training.trainer import Trainer

    histories = {}
    for name, overrides in TRAINING_RUNS.items():
        parallel_state.destroy_model_parallel()
        cfg = compose(*TRAINING_OVERRIDES, *(o.format(run_dir=run_dir) for o in overrides))
        trainer = Trainer(cfg, str(run_dir / name))
        trainer.setup()
        keys = ("step", "loss", "grad_norm", "val_loss", "lambda")
        histories[name] = [{k: r.get(k) for k in keys} for r in trainer.fit()]
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
