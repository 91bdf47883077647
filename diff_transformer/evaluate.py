"""Evaluate checkpoints: perplexity and multi-needle retrieval; several runs side by side.

    python -m diff_transformer.evaluate RUN_OR_CHECKPOINT [MORE ...] --tasks ppl,niah [--text FILE ...] [--out DIR]
    python -m diff_transformer.evaluate runs/diff runs/vanilla --tasks niah --needles 6 --asked 2 --lengths 4096

RUN_OR_CHECKPOINT: a run directory, a checkpoints directory, a step_* checkpoint, its latest file (any TP/PP layout),
or a .pt file from `python -m diff_transformer.checkpoint convert`. One process by default (GPU when there is one);
under torchrun the work is split over the ranks, each holding the whole model.

Long context: --seq-length N evaluates at N tokens instead of the run's training length (ppl windows and the longest
NIAH context; RoPE positions past the training length when N is larger). --cp C, under torchrun, splits each sequence
over C ranks (context parallelism: ring attention, each rank holds two chunks of every sequence and the model whole),
for contexts whose activations do not fit one device; the world is C x data-parallel ranks:
    torchrun --nproc_per_node=8 -m diff_transformer.evaluate runs/diff-64k --tasks niah,ppl --cp 8 --seq-length 65536

ppl: mean NLL and perplexity on the run's validation split and on each --text file (.txt or .jsonl, tokenized with
the run's tokenizer, documents joined by end-of-document tokens as in training), sliding windows at the model's
sequence length (--stride, default half of it), and the NLL at each position of the window.
niah: N needles "The magic number for <key> is <value>." in a haystack from the validation split, R of them asked
(--needles, --asked), at --depths x --lengths (default 1/4, 1/2, 3/4 and all of the model's sequence length);
accuracy heatmap and the share of attention on the answer needle, the other needles and the haystack per layer. The
paper's 4K anchor (N=6, R=2; Transformer 0.35, DIFF 0.85 at 3B): --needles 6 --asked 2 --lengths 4096.

Writes eval.json (one run) or <label>/eval.json per run and comparison.md, and ppl_by_position.png,
niah_accuracy.png, niah_attention.png in --out (default outputs/evaluate/<time>).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

from diff_transformer.cli import EXIT_REFUSED, USER_ERRORS, ArgumentParser, print_error
from diff_transformer.fileio import check_output

TASKS = ("ppl", "niah")
COMMAND = "diff_transformer.evaluate"  # the mark of its output directories: a rerun may replace them
# --document-mask: the run's data.document_mask, or on or off whatever it trained with
DOCUMENT_MASK_CHOICES = {"run": None, "on": True, "off": False}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m diff_transformer.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_OR_CHECKPOINT")
    parser.add_argument("--tasks", default="ppl,niah", help="comma-separated: ppl, niah (default both)")
    parser.add_argument("--text", action="append", default=[], metavar="FILE", help="also the perplexity of this file")
    parser.add_argument("--out", help="output directory (default outputs/evaluate/<time>)")
    parser.add_argument("--force", action="store_true",
                        help="write to an --out that holds other files: they are moved aside to OUT.old-<time>")
    parser.add_argument("--tokenizer", help="the tokenizer, when the run's is not where its config says")
    parser.add_argument("--max-tokens", type=int, default=1_000_000, help="tokens of each perplexity stream")
    parser.add_argument("--stride", type=int, help="window stride (default half the sequence length)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--backend", help="attention backend to evaluate with (default: the trained one)")
    parser.add_argument("--seq-length", type=int, help="context length to evaluate at (default: the run's)")
    parser.add_argument("--document-mask", choices=DOCUMENT_MASK_CHOICES, default="run",
                        help="attention within the documents the EOD tokens delimit (data.document_mask): as the run "
                             "trained (default), on or off; NIAH prompts stay one document")
    parser.add_argument("--cp", type=int, default=1,
                        help="context parallelism: ranks each sequence is split over (under torchrun; default 1)")
    parser.add_argument("--needles", type=int, default=6, help="N needles per context (default 6)")
    parser.add_argument("--asked", type=int, default=2, help="R of them asked (default 2)")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], help="context lengths, e.g. 1024,2048,4096")
    parser.add_argument("--depths", type=lambda s: [float(x) for x in s.split(",")], help="depths in [0, 1] (default 0,0.25,0.5,0.75,1)")
    parser.add_argument("--samples", type=int, default=10, help="samples per (length, depth) cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--value-digits", type=int, default=4)
    return parser.parse_args(argv)


def context_length(args, run) -> int:
    """The context the run is evaluated at: --seq-length, else its training length."""
    return args.seq_length or run.seq_length


def niah_config(args, run):
    """The NIAH settings for ``run``: --lengths, or the quarters of its context length that hold the needles."""
    from diff_transformer.evaluation.inference import load_run_tokenizer
    from diff_transformer.evaluation.niah import DEFAULT_DEPTHS, NeedleFactory, NiahConfig

    length = context_length(args, run)
    minimum = NeedleFactory(load_run_tokenizer(run), args.value_digits).minimum_length(args.needles, args.asked)
    lengths = args.lengths or [n for n in sorted({length * k // 4 for k in (1, 2, 3, 4)}) if n >= minimum]
    config = NiahConfig(needles=args.needles, asked=args.asked, lengths=tuple(lengths or [length]),
                        depths=tuple(args.depths or DEFAULT_DEPTHS), samples=args.samples, seed=args.seed,
                        value_digits=args.value_digits)
    config.validate(max_length=length, min_length=minimum)
    return config


def check_runs_exist(runs: Sequence[str]) -> None:
    """Before torch is imported: every run or checkpoint named exists."""
    for run in runs:
        if not os.path.exists(run):
            raise FileNotFoundError(f"{run} does not exist")


def check_out(args: argparse.Namespace, command: str) -> None:
    """Before torch is imported: ``--out`` may take the results (never a run, a checkpoint, an input, or a directory
    of other files without --force)."""
    if args.out:
        check_output(args.out, list(args.runs) + list(getattr(args, "text", [])), command, args.force)


def run_command(args: argparse.Namespace, command: str, body) -> int:
    """What ``evaluate`` and ``analyze`` share around their work: the runs and ``--out`` checked before anything is
    loaded, and a user's error as one ``error:`` line with exit status 2."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        check_runs_exist(args.runs)
        check_out(args, command)
        return body(args)
    except USER_ERRORS as error:
        print_error(error)
        return EXIT_REFUSED


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_command(parse_args(argv), COMMAND, evaluate)


def evaluate(args: argparse.Namespace) -> int:
    from diff_transformer.distributed import destroy_distributed
    from diff_transformer.evaluation import plots, report
    from diff_transformer.evaluation.inference import load_for_inference, resolve_run
    from diff_transformer.evaluation.perplexity import read_text_documents

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"--tasks {args.tasks!r}: use a comma-separated subset of {', '.join(TASKS)}")
    # everything that can be checked without a model first: one clear error before minutes of loading
    runs = [resolve_run(path, args.tokenizer) for path in args.runs]
    if args.seq_length is not None and args.seq_length < 2:
        raise ValueError(f"--seq-length {args.seq_length} must be at least 2")
    for path in args.text:
        read_text_documents(path)
    configs = [niah_config(args, run) if "niah" in tasks else None for run in runs]
    if args.stride is not None and not all(1 <= args.stride <= context_length(args, run) for run in runs):
        raise ValueError(f"--stride {args.stride} must lie in [1, the model's sequence length]")
    labels = report.unique_labels([run.label for run in runs])
    out = report.output_dir(args.out, "evaluate")

    results: Dict[str, Dict] = {}
    try:
        for run, label, config in zip(runs, labels, configs):
            model = load_for_inference(run, args.backend, args.seq_length, args.cp,
                                       DOCUMENT_MASK_CHOICES[args.document_mask])
            results[label] = evaluate_one(model, run, args, tasks, config)
            rank = model.global_rank
            del model
            gc.collect()
    finally:
        destroy_distributed()
    if rank != 0:
        return 0
    with report.writing_output(out, COMMAND) as staging:
        report.write_run_results(staging, {label: results[label] for label in labels}, "eval.json")
        run_of = {k: v["run"] for k, v in results.items()}
        if "ppl" in tasks:
            plots.plot_position_loss({k: v["ppl"] for k, v in results.items()}, staging / "ppl_by_position.png",
                                     run_of)
        if "niah" in tasks:
            niah_results = {k: v["niah"] for k, v in results.items()}
            plots.plot_niah_heatmaps(niah_results, staging / "niah_accuracy.png", run_of)
            if any(r["attention_allocation"] for r in niah_results.values()):  # none under context parallelism
                plots.plot_attention_allocation(niah_results, staging / "niah_attention.png", run_of)
        table = comparison_table(results, tasks)
        (staging / "comparison.md").write_text(table)
    print(table)
    print(f"results: {out}")
    return 0


def evaluate_one(model, run, args, tasks: List[str], config) -> Dict:
    from diff_transformer.evaluation import report
    from diff_transformer.evaluation import tasks as task_lib
    from diff_transformer.evaluation.inference import load_run_tokenizer
    from diff_transformer.training.accounting import memory_gib

    start = time.perf_counter()
    tokenizer = load_run_tokenizer(run)
    result: Dict = {"run": {"label": run.label, "checkpoint": run.checkpoint, "step": run.step,
                            "attention": run.attention, "seq_length": run.seq_length,
                            **report.training_of(run.config, run.step),
                            "evaluated_length": model.seq_length, "rope_base": model.cfg.model.rope_base,
                            "device": str(model.device), "dtype": str(model.dtype).replace("torch.", ""),
                            "world_size": model.world_size * model.cp, "context_parallel": model.cp}}
    if "ppl" in tasks:
        result["ppl"] = task_lib.run_ppl(model, tokenizer, args.text, args.max_tokens, args.stride, args.batch_size,
                                         args.tokenizer)
    if "niah" in tasks:
        haystack = task_lib.haystack_stream(model, max(args.max_tokens, 4 * max(config.lengths)), args.tokenizer)
        result["niah"] = task_lib.run_niah(model, tokenizer, config, haystack, args.batch_size)
    if model.lambdas():
        result["lambda"] = model.lambdas()
    result["seconds"] = time.perf_counter() - start
    result["peak_memory_gib"] = memory_gib()  # this process's peak GPU memory (resident memory on a CPU)
    return result


def comparison_table(results: Dict[str, Dict], tasks: List[str]) -> str:
    from diff_transformer.evaluation import report

    header = ["run"]
    texts = sorted({k for r in results.values() for k in r.get("ppl", {}) if k.startswith("text:")})
    if "ppl" in tasks:
        header += ["validation NLL", "validation ppl"] + [f"{t[5:]} ppl" for t in texts]
    if "niah" in tasks:
        header += ["NIAH accuracy", "attention on answer", "attention on haystack"]
    rows = []
    for label, r in results.items():
        row = [label]
        if "ppl" in tasks:
            row += [r["ppl"]["validation"]["nll"], r["ppl"]["validation"]["perplexity"]]
            row += [r["ppl"][t]["perplexity"] if t in r["ppl"] else None for t in texts]
        if "niah" in tasks:
            allocation = r["niah"]["attention_allocation"].values()  # empty under context parallelism
            row += [r["niah"]["accuracy"]] + [
                sum(a[region] for a in allocation) / len(allocation) if allocation else None
                for region in ("answer", "haystack")
            ]
        rows.append(row)
    return report.markdown_table(header, rows)


if __name__ == "__main__":
    sys.exit(main())
