"""Document masking (data.document_mask): what the mask saves or costs, masked against unmasked in the same run.

    python benchmarks/document_mask.py [--seq-lens 2048] [--mean-document 300] [--skip-training] [--out DIR]

1. Core attention, one layer forward+backward (the modules training builds): DIFF V1 and V2 and the baseline on
   ``sdpa`` (masked: one library call per document on a CPU and in fp32, PyTorch's variable-length FlashAttention in
   fp16/bf16 on a GPU), and on a GPU the fused kernel (``triton``, masked: document ids per tile, blocks outside the
   documents skipped), each unmasked and masked over samples packed from documents of exponentially distributed
   lengths (mean --mean-document tokens). Every masked row is first checked against the eager maps with the same
   mask at a small size. TFLOP/s counts what each row computes: the causal map's pairs s(s+1)/2 a sample unmasked,
   Σ L(L+1)/2 over its documents masked (the blocks the mask removes are not counted: that is MFU's convention in
   training, too), times the products of the kind (training/accounting.py: DIFF's two maps weight the 2d-wide V).
2. A training step (``train.py``, the ``tiny`` model at --train-seq tokens; skipped with --skip-training): on the
   bundled corpus (whole books: nearly every sample one document) and on the bundled corpus cut into short documents
   (``data/short_documents.py``), each without and with ``data.document_mask`` and ``data.reset_position_ids``:
   median step time after two warm-up steps, tokens/s, the loss at the last step, and the attention work the mask
   removes there (``data.inspect``'s figure).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.reports import machine_name, write_report  # noqa: E402

KINDS = ("diff", "diff_v2", "vanilla")


def document_ids(n: int, batch: int, mean: float, seed: int = 0) -> torch.Tensor:
    """(batch, n) int32 ids of samples packed from documents of exponentially distributed lengths (mean ``mean``
    tokens, at least 1), the stream cut into samples as the data pipeline cuts it."""
    generator = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < n * batch:
        lengths.append(max(1, int(torch.empty(1).exponential_(1.0 / mean, generator=generator))))
    stream = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[: n * batch].view(batch, n)
    return (stream - stream[:, :1]).to(torch.int32)


def pairs(ids: torch.Tensor) -> float:
    """(query, key) pairs the masked map computes, Σ L(L+1)/2 over every sample's documents."""
    total = 0.0
    for row in ids:
        lengths = torch.unique_consecutive(row, return_counts=True)[1].double()
        total += float((lengths * (lengths + 1) / 2).sum())
    return total


def flops_per_pair(kind: str, heads: int, d: int) -> float:
    """Forward + backward FLOPs of one (query, key) pair in one layer: accounting's formulas at one key a token."""
    from omegaconf import OmegaConf

    from diff_transformer.config import Config
    from diff_transformer.training.accounting import attention_backward_flops_per_token, attention_flops_per_token

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), {"model": {
        "name": "benchmark", "attention": kind, "num_heads": heads, "head_dim": d, "hidden_size": 2 * heads * d,
        "num_layers": 1, "ffn_hidden_size": 4 * heads * d}, "trainer": {"max_steps": 1, "global_batch_size": 1}}))
    return attention_flops_per_token(cfg, keys=1.0) + attention_backward_flops_per_token(cfg, keys=1.0)


def build(kind: str, backend: str, heads: int, d: int, dtype, device):
    from benchmarks.core_attention import _module

    return _module(kind, backend, "unfused", heads, heads, d, dtype, device)


def fwd_bwd(module, tensors, bias, documents):
    inputs = [t.detach().requires_grad_(True) for t in tensors]
    out = module(*inputs, None, attention_bias=bias, packed_seq_params=documents)
    out.backward(torch.ones_like(out))
    return out.detach(), [t.grad for t in inputs]


def check_masked(kind: str, backend: str, heads: int, d: int, dtype, device, mean: float, n: int = 256) -> float:
    """Worst relative error of the masked output and q, k, v gradients against the eager maps with the same mask in
    fp32 (N = ``n``, two samples)."""
    from benchmarks.core_attention import _inputs, _rel
    from diff_transformer.models.documents import packed_documents

    b = 2
    ids = document_ids(n, b, min(mean, n / 4), seed=1).to(device)
    row = build(kind, backend, heads, d, dtype, device)
    reference = build(kind, "eager", heads, d, torch.float32, device)
    reference.load_state_dict({k: v.float() for k, v in row.state_dict().items()})
    tensors, bias = _inputs(kind, heads, heads, d, n, b, dtype, device)
    got = fwd_bwd(row, tensors, bias, packed_documents(ids, None, n))
    want = fwd_bwd(reference, [t.float() for t in tensors], None if bias is None else bias.float(),
                   packed_documents(ids, None, n))
    return max(_rel(x, y) for x, y in zip([got[0]] + got[1], [want[0]] + want[1]))


def paired_ms(functions, device, repeats):
    """Milliseconds of each function: on a GPU triton's do_bench (median); on a CPU the fastest of ``repeats`` calls,
    the functions' calls interleaved, so that a shared machine's load falls on both alike."""
    if device == "cuda":
        import triton

        return [triton.testing.do_bench(f, warmup=25, rep=100) for f in functions]
    for f in functions:
        f()
    best = [float("inf")] * len(functions)
    for _ in range(repeats):
        for i, f in enumerate(functions):
            start = time.perf_counter()
            f()
            best[i] = min(best[i], time.perf_counter() - start)
    return [b * 1e3 for b in best]


def time_core_attention(args, device, dtype):
    from benchmarks.core_attention import _inputs
    from diff_transformer.models.documents import packed_documents

    backends = args.backends or (["sdpa", "triton"] if device == "cuda" else ["sdpa"])
    check_n = min(256, max(args.seq_lens))
    rows = []
    for n in args.seq_lens:
        b = max(1, args.tokens // n)
        ids = document_ids(n, b, args.mean_document).to(device)
        kept = pairs(ids) / (b * n * (n + 1) / 2)
        for kind in KINDS:
            for backend in backends:
                if backend == "triton" and kind == "vanilla":
                    continue
                check = check_masked(kind, backend, args.heads, args.head_dim, dtype, device, args.mean_document,
                                     check_n)
                module = build(kind, backend, args.heads, args.head_dim, dtype, device)
                tensors, bias = _inputs(kind, args.heads, args.heads, args.head_dim, n, b, dtype, device)
                per_pair = flops_per_pair(kind, args.heads, args.head_dim)
                documents = packed_documents(ids, None, n)
                times = paired_ms([lambda: fwd_bwd(module, tensors, bias, None),
                                   lambda: fwd_bwd(module, tensors, bias, documents)], device, args.repeats)
                for masked, ms in zip((False, True), times):
                    work = pairs(ids) if masked else b * n * (n + 1) / 2
                    rows.append(dict(n=n, batch=b, kind=kind, backend=backend, masked=masked, ms=ms,
                                     tflops=per_pair * work / (ms * 1e-3) / 1e12, kept=kept,
                                     check=f"{check:.1e}" if masked else ""))
                    print(f"N={n} B={b} {kind} {backend} {'masked' if masked else 'unmasked'}: {ms:.2f} ms "
                          f"({rows[-1]['tflops']:.3f} TFLOP/s){' check ' + rows[-1]['check'] if masked else ''}",
                          flush=True)
    return rows


def train_runs(args, root: Path):
    """Median step time, tokens/s and the last loss of train.py runs, masked and unmasked, on both corpora."""
    from data.config import DataConfig
    from data.datasets import prepare
    from data.inspect import summarise_blend
    from data.preprocess import preprocess
    from data.short_documents import write_short_documents

    prepared = prepare(DataConfig())
    write_short_documents(str(root / "short.jsonl"), mean_chars=args.short_document_chars,
                          max_chars=3_000_000)
    preprocess([str(root / "short.jsonl")], prepared.tokenizer_dir, str(root / "short"))
    corpora = {
        "bundled (whole books)": ([], prepared.prefixes[0]),
        f"short documents (mean {args.short_document_chars} characters)": (
            ["data.source=shards", f"data.tokenizer_dir={prepared.tokenizer_dir}", f"data.blend=[{root / 'short'}]"],
            str(root / "short")),
    }
    common = ["model=tiny", f"model.seq_length={args.train_seq}", f"trainer.max_steps={args.train_steps}",
              "trainer.micro_batch_size=4", "trainer.global_batch_size=4", "trainer.eval_interval=0",
              "optim.warmup_steps=1", "checkpoint.interval=0", "checkpoint.save_at_end=false",
              "logging.wandb.mode=disabled"]
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count()), PYTHONWARNINGS="ignore")
    rows = []
    for name, (data, prefix) in corpora.items():
        removed = summarise_blend([prefix], None, "969,30,1", seq_length=args.train_seq)[0].masked_share
        for masked in (False, True):
            switches = ["data.document_mask=true", "data.reset_position_ids=true"] if masked else []
            run_dir = root / f"run-{len(rows)}"
            command = [sys.executable, str(REPO / "train.py"), *common, *data, *switches, f"hydra.run.dir={run_dir}"]
            proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            times = [r["step_time"] for r in records[2:]]
            step, fastest = statistics.median(times), min(times)
            rows.append(dict(corpus=name, masked=masked, step_ms=step * 1e3, fastest_ms=fastest * 1e3,
                             tokens_per_s=4 * args.train_seq / fastest, loss=records[-1]["loss"], removed=removed))
            print(f"{name} {'masked' if masked else 'unmasked'}: {step * 1e3:.1f} ms/step (fastest "
                  f"{fastest * 1e3:.1f}), loss {records[-1]['loss']:.4f}", flush=True)
    return rows


def render(args, core_rows, train_rows, dtype, command) -> str:
    lines = [f"# Document masking: {machine_name()}, {datetime.date.today()}", "",
             f"torch {torch.__version__}; command: `{command}`. Documents of exponentially distributed lengths, mean "
             f"{args.mean_document:g} tokens, packed into samples as the data pipeline packs them.", "",
             "## Core attention, one layer forward+backward", "",
             f"{str(dtype).replace('torch.', '')}; H={args.heads} differential heads (baseline 2H={2 * args.heads}), "
             f"Hkv=H, d={args.head_dim}, about {args.tokens} tokens a call (B = tokens / N). TFLOP/s = FLOPs per "
             "(query, key) pair (accounting.py: forward and backward of the kind's products) × the pairs computed: "
             "N(N+1)/2 a sample unmasked, Σ L(L+1)/2 over its documents masked (masked-out blocks are not counted). "
             "'check': the masked row's worst relative error against the eager maps with the mask (fp32, N ≤ 256). "
             "Times: on a GPU triton.testing.do_bench's median; on a CPU the fastest of --repeats calls, masked and "
             "unmasked calls interleaved.", "",
             "| N | B | kind | backend | mask | fwd+bwd ms | masked / unmasked | work kept | TFLOP/s | check |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in core_rows:
        plain = next(r for r in core_rows if r["n"] == row["n"] and r["kind"] == row["kind"]
                     and r["backend"] == row["backend"] and not r["masked"])
        ratio = f"{row['ms'] / plain['ms']:.2f}x" if row["masked"] else ""
        lines.append(f"| {row['n']} | {row['batch']} | {row['kind']} | {row['backend']} | "
                     f"{'documents' if row['masked'] else 'causal'} | {row['ms']:.2f} | {ratio} | "
                     f"{row['kept'] if row['masked'] else 1:.1%} | {row['tflops']:.3f} | {row['check']} |")
    if train_rows:
        lines += ["", f"## A training step: `tiny`, sequence {args.train_seq}, micro-batch 4, {args.train_steps} "
                      "steps", "",
                  "Step times after two warm-up steps, the median and the fastest (the machine may be shared: the "
                  "fastest step is the one least slowed by others' load; tokens/s from it); masked = "
                  "data.document_mask and data.reset_position_ids; 'removed': the share of the causal attention work "
                  "the mask removes at this sequence length (data.inspect).", "",
                  "| corpus | mask | median ms/step | fastest ms/step | tokens/s | loss at the last step | removed |",
                  "|---|---|---|---|---|---|---|"]
        for row in train_rows:
            lines.append(f"| {row['corpus']} | {'documents' if row['masked'] else 'causal'} | {row['step_ms']:.1f} | "
                         f"{row['fastest_ms']:.1f} | {row['tokens_per_s']:,.0f} | {row['loss']:.4f} | "
                         f"{row['removed']:.1%} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=None, help="default: 2048 (CPU), 4096 32768 (GPU)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens a call (default: the longest --seq-lens)")
    parser.add_argument("--heads", type=int, default=None, help="differential heads (default 4 CPU, 8 GPU)")
    parser.add_argument("--head-dim", type=int, default=None, help="d (default 64 CPU, 128 GPU)")
    parser.add_argument("--mean-document", type=float, default=None, help="mean document length in tokens "
                        "(default 300 CPU, 1500 GPU)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--backends", nargs="+", choices=("sdpa", "triton"), default=None,
                        help="default: sdpa and triton on a GPU, sdpa on a CPU (triton there: the interpreter)")
    parser.add_argument("--skip-training", action="store_true", help="only the core attention")
    parser.add_argument("--train-seq", type=int, default=512)
    parser.add_argument("--train-steps", type=int, default=20)
    parser.add_argument("--short-document-chars", type=int, default=600)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    args.seq_lens = args.seq_lens or ([4096, 32768] if cuda else [2048])
    args.tokens = args.tokens or max(args.seq_lens)
    args.heads = args.heads or (8 if cuda else 4)
    args.head_dim = args.head_dim or (128 if cuda else 64)
    args.mean_document = args.mean_document or (1500.0 if cuda else 300.0)
    if not cuda:
        torch.set_num_threads(os.cpu_count())
    start = time.perf_counter()
    core_rows = time_core_attention(args, device, dtype)
    train_rows = []
    if not args.skip_training:
        with tempfile.TemporaryDirectory() as tmp:
            train_rows = train_runs(args, Path(tmp))
    command = "python benchmarks/document_mask.py " + " ".join(sys.argv[1:])
    write_report(render(args, core_rows, train_rows, dtype, command.strip()), args.out, "document_mask")
    print(f"done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
