"""Benchmark: ``trainer.fusions``' RoPE under ``torch.compile`` and its cross-entropy, each against the alternative it
replaces, in the same run: the GPU's time a call, forward and backward (``triton.testing.do_bench``'s median; on a
CPU the median wall time of ``--repeats`` calls), and for the cross-entropy the peak memory a call adds to its logits.

    GPU:  python benchmarks/fusions.py      # the 830m: query and key [2048, 4, 16, 96], logits [2048, 4, 100352], bf16
    CPU:  python benchmarks/fusions.py --seq 32 --batch 1 --heads 2 --head-dim 16 --vocab 512 --repeats 2
          # the same code paths in fp32 at toy sizes (wall time; torch.compile is off under TORCHDYNAMO_DISABLE=1)

RoPE, a layer's query and key as views of one projection, under ``torch.compile`` (``trainer.compile``'s layers):
megatron-core's unfused RoPE compiled, where inductor computes cos and sin for every element of the query and key (as
the model's compiled RoPE did before ``models/rope.py``'s ``rope_cos_sin``), against the model's compiled RoPE, which
reads them from one call a layer; the Triton kernel (the model's RoPE on a GPU outside compiled layers) for
reference. Cross-entropy, logits [s, b, V] and their targets: megatron-core's native fused cross-entropy (what
``trainer.fusions`` ran before ``models/cross_entropy.py``: an fp32 softmax saved for the backward) against the
model's (the logits saved with a log-sum-exp; the softmax recomputed in the backward).

The report goes to ``--out`` (fusions_<machine>_<date>.md); the ``headline`` lines give each row's time and its ratio
to the alternative.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.reports import positive_int, table_cell, time_ms, write_report  # noqa: E402


def peak_bytes(call, device: str):
    """The peak bytes allocated during one ``call()`` above what was allocated before it (None on a CPU)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def rope_rows(seq, batch, heads, head_dim, dtype, device):
    """(label, call) of RoPE on a layer's query and key, forward and backward."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from diff_transformer.models.rope import FusedRoPEFunction
    from kernels.rope import rotary

    width = heads * head_dim
    mixed = torch.randn(seq, batch, 2 * width, dtype=dtype, device=device, requires_grad=True)
    inverse = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32, device=device), inverse)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    grad = torch.randn(seq, batch, heads, head_dim, dtype=dtype, device=device)

    def layer(rope):
        def fn(x):
            q, k = x[..., :width].view(seq, batch, heads, head_dim), x[..., width:].view(seq, batch, heads, head_dim)
            return rope(q, freqs), rope(k, freqs)
        return fn

    def call_of(fn):
        def call():
            q, k = fn(mixed)
            torch.autograd.backward((q, k), (grad, grad))
            mixed.grad = None
        return call

    rows = [("megatron-core unfused, compiled (cos and sin per element)",
             call_of(torch.compile(layer(_apply_rotary_pos_emb_bshd), dynamic=False))),
            ("model's compiled RoPE (cos and sin once a layer)",
             call_of(torch.compile(layer(FusedRoPEFunction.apply), dynamic=False)))]
    if device == "cuda":
        rows.append(("Triton kernel, eager (for reference)", call_of(layer(rotary))))
    return rows


def cross_entropy_rows(seq, batch, vocab, dtype, device, group):
    """(label, call) of the cross-entropy of logits [seq, batch, vocab], forward and backward."""
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    from diff_transformer.models.cross_entropy import vocab_parallel_cross_entropy

    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(seq, batch, vocab, dtype=dtype, device=device, generator=generator).requires_grad_(True)
    target = torch.randint(0, vocab, (seq, batch), device=device, generator=generator)

    def call_of(fn):
        def call():
            fn(logits, target, group).sum().backward()
            logits.grad = None
        return call

    return [("megatron-core native fused (fp32 softmax saved)", call_of(fused_vocab_parallel_cross_entropy)),
            ("model's (logits and log-sum-exp saved)", call_of(vocab_parallel_cross_entropy))]


def measure(rows, device, repeats):
    results = []
    for label, call in rows:
        try:
            results.append((label, time_ms(call, device, repeats, "median"), peak_bytes(call, device), ""))
        except Exception as err:  # one failing row hides no other
            results.append((label, None, None, table_cell(f"failed: {type(err).__name__}: {err}")))
        print(results[-1], flush=True)
    return results


def render(rope, cross_entropy, args, dtype, device, compiled: bool) -> str:
    def ratio(ms, base):
        return f"{ms / base:.2f}" if ms is not None and base else ""

    lines = [
        "# trainer.fusions' RoPE (compiled) and cross-entropy against the alternatives",
        "",
        f"`python benchmarks/fusions.py --seq {args.seq} --batch {args.batch} --heads {args.heads} --head-dim "
        f"{args.head_dim} --vocab {args.vocab} --repeats {args.repeats}`; {device}, {str(dtype).split('.')[-1]}, "
        f"torch {torch.__version__}; "
        + ("median GPU time of a call, forward and backward (triton.testing.do_bench)." if device == "cuda" else
           "median wall time of a call, forward and backward.")
        + ("" if compiled else " torch.compile is off in this process (TORCHDYNAMO_DISABLE=1): the compiled rows "
           "ran eagerly."),
        "",
        f"RoPE on a layer's query and key, [{args.seq}, {args.batch}, {args.heads}, {args.head_dim}] each:",
        "",
        "| RoPE | ms | / megatron-core compiled | note |",
        "|---|---|---|---|",
    ]
    base = rope[0][1]
    lines += [f"| {label} | {'' if ms is None else f'{ms:.3f}'} | {ratio(ms, base)} | {note} |"
              for label, ms, _, note in rope]
    lines += ["", f"Cross-entropy of logits [{args.seq}, {args.batch}, {args.vocab}]:", "",
              "| cross-entropy | ms | / megatron-core native | peak GiB above the logits | note |",
              "|---|---|---|---|---|"]
    base = cross_entropy[0][1]
    lines += [f"| {label} | {'' if ms is None else f'{ms:.3f}'} | {ratio(ms, base)} | "
              f"{'' if peak is None else f'{peak / 2**30:.2f}'} | {note} |" for label, ms, peak, note in cross_entropy]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from diff_transformer.cli import ArgumentParser

    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=positive_int, default=2048)
    parser.add_argument("--batch", type=positive_int, default=4)
    parser.add_argument("--heads", type=positive_int, default=16, help="query (and key) heads of a layer")
    parser.add_argument("--head-dim", type=positive_int, default=96)
    parser.add_argument("--vocab", type=positive_int, default=100352, help="the padded vocabulary (830m: 100,352)")
    parser.add_argument("--repeats", type=positive_int, default=20,
                        help="timed calls a row on a CPU (a GPU times with triton.testing.do_bench)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"),
                        help="directory of the report fusions_<machine>_<date>.md")
    args = parser.parse_args(argv)
    if args.head_dim % 2:
        parser.error(f"--head-dim {args.head_dim}: RoPE rotates pairs of features; expected an even number")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out}: a file, not a directory for the report")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cpu":
        from diff_transformer.compat import apply_cpu_patches

        apply_cpu_patches()
    compiled = os.environ.get("TORCHDYNAMO_DISABLE") != "1"
    torch.manual_seed(0)
    rope = measure(rope_rows(args.seq, args.batch, args.heads, args.head_dim, dtype, device), device, args.repeats)
    try:  # a world of one: megatron-core's cross-entropy all-reduces over it (the model's skips a group of one)
        torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1,
                                             store=torch.distributed.HashStore())
        rows = cross_entropy_rows(args.seq, args.batch, args.vocab, dtype, device, torch.distributed.group.WORLD)
    except Exception as err:  # the RoPE table stands without it
        cross_entropy = [("cross-entropy", None, None, table_cell(f"failed: {type(err).__name__}: {err}"))]
    else:
        cross_entropy = measure(rows, device, args.repeats)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    write_report(render(rope, cross_entropy, args, dtype, device, compiled), out, "fusions")
    for name, rows in (("RoPE, query and key", rope), ("cross-entropy", cross_entropy)):
        base = rows[0][1]
        print(f"headline: {name}, ms fwd+bwd (/ the first): " + "; ".join(
            f"{label.split(' (')[0]} " + ("failed" if ms is None else
                                          f"{ms:.3f}" + (f" ({ms / base:.2f}x)" if base else "")
                                          + ("" if peak is None else f", peak +{peak / 2**30:.2f} GiB"))
            for label, ms, peak, _ in rows))
    return 0 if all(r[1] is not None for r in rope + cross_entropy) else 1


if __name__ == "__main__":
    from diff_transformer.cli import run

    sys.exit(run(main))
