"""Look inside a checkpoint's attention on a probe batch, with the maps materialised (eager backend).

    python -m diff_transformer.analyze RUN_OR_CHECKPOINT [MORE ...] [--batch FILE | --niah] [--out DIR]

RUN_OR_CHECKPOINT as for evaluate. The probe batch: --sequences windows of --length tokens (default: the model's
sequence length) from the run's validation split, from --batch FILE (.txt or .jsonl), or --niah retrieval prompts
(--needles, --asked; the A1/A2 comparison then reads the answer rows, with the needles as the relevant keys).

Writes analysis.json (one run; <label>/analysis.json per run and comparison.md for several) and analysis.png in
--out (default outputs/analyze/<time>): per layer and head, and averaged, the entropy, Gini, top-1% and top-k mass,
first-token mass and sink rate of each map; for DIFF kinds A1 vs A2 cosine and KL on relevant and irrelevant keys,
negative entries of A1 − λA2, and the effective rank of λ·A2, A1 and A1 − λ·A2; the largest attention logits and
hidden states per layer; λ per layer, and over training when given a run directory (from its metrics.jsonl, or its
checkpoints where they hold more points).
Definitions: diff_transformer/attention_metrics.py and diff_transformer/evaluation/attention_analysis.py.
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Dict, List, Optional, Sequence

from diff_transformer.cli import ArgumentParser
from diff_transformer.evaluate import DOCUMENT_MASK_CHOICES, run_command

COMMAND = "diff_transformer.analyze"  # the mark of its output directories: a rerun may replace them


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m diff_transformer.analyze", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_OR_CHECKPOINT")
    probe = parser.add_mutually_exclusive_group()
    probe.add_argument("--batch", metavar="FILE", help="probe text (.txt or .jsonl) instead of the validation split")
    probe.add_argument("--niah", action="store_true", help="multi-needle retrieval prompts as the probe batch")
    parser.add_argument("--sequences", type=int, default=4, help="probe sequences (default 4)")
    parser.add_argument("--length", type=int, help="tokens per probe sequence (default: the model's sequence length)")
    parser.add_argument("--topk", type=int, default=8, help="k of the top-k mass and of the relevant keys (default 8)")
    parser.add_argument("--needles", type=int, default=6, help="--niah: needles per prompt (default 6)")
    parser.add_argument("--asked", type=int, default=2, help="--niah: needles asked (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-trajectory", action="store_true", help="skip λ over training (metrics.jsonl or checkpoints)")
    parser.add_argument("--document-mask", choices=DOCUMENT_MASK_CHOICES, default="run",
                        help="maps within the documents the EOD tokens delimit (data.document_mask): as the run "
                             "trained (default), on or off")
    parser.add_argument("--tokenizer", help="the tokenizer, when the run's is not where its config says")
    parser.add_argument("--out", help="output directory (default outputs/analyze/<time>)")
    parser.add_argument("--force", action="store_true",
                        help="write to an --out that holds other files: they are moved aside to OUT.old-<time>")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_command(parse_args(argv), COMMAND, analyze)


def analyze(args: argparse.Namespace) -> int:
    from diff_transformer.distributed import destroy_distributed, world_size_from_env
    from diff_transformer.evaluation import plots, report
    from diff_transformer.evaluation.inference import load_for_inference, resolve_run
    from diff_transformer.evaluation.perplexity import read_text_documents

    if world_size_from_env() != 1:
        raise ValueError("analyze runs in one process (the maps of one probe sequence at a time); start it without "
                         "torchrun")
    if args.sequences < 1 or args.topk < 1:
        raise ValueError(f"--sequences {args.sequences} and --topk {args.topk} must be >= 1")
    runs = [resolve_run(path, args.tokenizer) for path in args.runs]
    for run in runs:
        if args.length is not None:
            if not 2 <= args.length <= run.seq_length:
                raise ValueError(f"--length {args.length} is outside [2, {run.seq_length}], the model's maximum "
                                 "sequence length (model.seq_length)")
    documents = read_text_documents(args.batch) if args.batch else None
    labels = report.unique_labels([run.label for run in runs])
    out = report.output_dir(args.out, "analyze")
    results: Dict[str, Dict] = {}
    try:
        for run, label in zip(runs, labels):
            model = load_for_inference(run, attention_backend="eager",
                                       document_mask=DOCUMENT_MASK_CHOICES[args.document_mask])
            results[label] = analyze_one(model, run, args, documents)
            del model
            gc.collect()
    finally:
        destroy_distributed()
    with report.writing_output(out, COMMAND) as staging:
        report.write_run_results(staging, {label: results[label] for label in labels}, "analysis.json")
        plots.plot_analysis(results, staging / "analysis.png")
        table = comparison_table(results)
        (staging / "comparison.md").write_text(table)
    print(table)
    print(f"results: {out}")
    return 0


def probe_batch(model, run, args, documents) -> tuple:
    """(probes, description) of the probe batch."""
    import numpy as np
    import torch

    from diff_transformer.evaluation import niah
    from diff_transformer.evaluation.attention_analysis import Probe
    from diff_transformer.evaluation.inference import load_run_tokenizer
    from diff_transformer.evaluation.perplexity import text_stream, validation_stream

    length = args.length or run.seq_length
    tokenizer = load_run_tokenizer(run)
    needed = args.sequences * length
    if args.niah:
        haystack, _ = validation_stream(run.config, max(needed, 4 * length), args.tokenizer)
        if model.document_mask:  # a prompt is one document
            haystack = haystack[haystack != model.eod]
        config = niah.NiahConfig(needles=args.needles, asked=args.asked, lengths=(length,),
                                 depths=tuple(float(d) for d in np.linspace(0, 1, args.sequences)), samples=1,
                                 seed=args.seed)
        config.validate(max_length=run.seq_length,
                        min_length=niah.NeedleFactory(tokenizer, config.value_digits).minimum_length(
                            args.needles, args.asked), length_flag="--length")
        probes = []
        for sample in niah.generate(config, tokenizer, haystack, length_flag="--length"):
            relevant = torch.zeros(length, dtype=torch.bool)
            for needle in sample.needles:
                if needle.asked:
                    relevant[slice(*needle.span)] = True
            rows = torch.cat([niah.answer_rows(q) for q in sample.queries])
            probes.append(Probe(sample.tokens, rows=rows, relevant=relevant))
        return probes, {"source": "niah", "needles": args.needles, "asked": args.asked, "sequences": len(probes),
                        "length": length, "relevant_keys": "the asked needles' tokens, on the answer rows"}
    if documents is not None:
        stream, source = text_stream(documents, tokenizer, needed), {"source": "file", "file": args.batch}
    else:
        stream, _ = validation_stream(run.config, needed, args.tokenizer)
        source = {"source": "validation"}
    count = len(stream) // length
    if count < 1:
        raise ValueError(f"the probe text holds {len(stream)} tokens, fewer than one sequence of {length}")
    probes = [Probe([int(t) for t in stream[i * length:(i + 1) * length]]) for i in range(min(count, args.sequences))]
    source.update({"sequences": len(probes), "length": length,
                   "relevant_keys": f"each query row's top-{args.topk} keys of the combined map"})
    return probes, source


def analyze_one(model, run, args, documents) -> Dict:
    from diff_transformer.evaluation.attention_analysis import analyze as analyze_attention
    from diff_transformer.evaluation import report
    from diff_transformer.evaluation.attention_analysis import lambda_trajectory

    probes, description = probe_batch(model, run, args, documents)
    result = {"run": {"label": run.label, "checkpoint": run.checkpoint, "step": run.step, "attention": run.attention,
                      "device": str(model.device), **report.training_of(run.config, run.step)},
              "probe": description, "topk": args.topk}
    result.update(analyze_attention(model, probes, args.topk))
    if model.lambdas():
        result["lambda"] = model.lambdas()
    if not args.no_trajectory:
        # λ over training from metrics.jsonl (every logging step, no loading) unless the checkpoints hold more points
        logged = report.lambda_over_training(run.run_dir, run.step)
        checkpoints = run.checkpoints()
        if logged and len(logged) >= len(checkpoints):
            result["lambda_trajectory"], result["lambda_trajectory_source"] = logged, "metrics.jsonl"
        else:
            result["lambda_trajectory"] = lambda_trajectory(model, checkpoints)
            result["lambda_trajectory_source"] = "checkpoints"
    return result


SUMMARY_KEYS = (
    "combined/entropy", "combined/gini", "combined/top1pct_mass", "combined/topk_mass", "combined/sink_rate",
    "differential/cosine_relevant", "differential/cosine_irrelevant", "differential/kl_relevant",
    "differential/kl_irrelevant", "differential/negative_fraction", "differential/negative_relative_mass",
    "differential/effective_rank_lambda_A2", "differential/effective_rank_A1",
    "differential/effective_rank_A1_minus_lambda_A2", "logits/top1", "logits/median", "hidden/top1", "hidden/median",
)


def comparison_table(results: Dict[str, Dict]) -> str:
    """Each metric averaged over layers (and heads), one column per run."""
    from diff_transformer.evaluation import report

    labels: List[str] = list(results)
    rows = [[key] + [results[label]["mean"].get(key) for label in labels] for key in SUMMARY_KEYS]
    return report.markdown_table(["metric (mean over layers)"] + labels, rows)


if __name__ == "__main__":
    sys.exit(main())
