"""Compare every attention variant with a reference (DIFF with its mirrored baseline, DIFF V2 with its own): loss
curves, scaling-law fits, and the parameter and token ratios at equal loss; or, with --table, every variant of an
ablation sweep: final validation loss over seeds and paired differences.

    python -m diff_transformer.compare multirun/tiny/2026-11-25_22-10-00 --out docs/tiny_sweep.png
    python -m diff_transformer.compare multirun/v2/2026-11-27_09-00-00 --reference vanilla
    python -m diff_transformer.compare --wandb my-team/diff-transformer/paper-scaling
    python -m diff_transformer.compare multirun/ablations/2026-11-26_05-00-00 --table --out docs/ablations.png

Runs are read from run directories (`run.json` + `metrics.jsonl`, found recursively under each path) or from the W&B
API. Per variant (run.json "variant": the attention kind and its ablation keys) the final validation losses are fitted
with L(N) = E + A * (N / N_ref)^(-alpha) as Hoffmann et al. 2022 (approach 3) and Besiroglu et al. 2024 fit it: a
Huber loss on log-loss, the log-sum-exp form, the best of a grid of starts, 68% intervals from bootstrap refits (runs
resampled within each size where every size has several seeds, else the fit's residuals resampled over the runs). A
law is fitted only to more sizes than it has parameters: with 3 sizes the reduced form A * N^(-alpha) (E fixed at 0,
or at --fixed-E), with fewer none, and the report says which. Each variant's parameter ratio is N_variant /
N_reference at which both fits give the same loss (the paper, DIFF against the Transformer: 62.2% at 6.8B), marked
extrapolated where either size lies outside the sizes trained. The reference is --reference (default vanilla),
except for DIFF V2, which is compared with its own baseline (vanilla with model.num_kv_heads=Hkv/2: the same query
and KV heads; run.json "baseline_variant") when that was trained. The token ratio does the same along one run of
each, on the largest model both trained, with L(D) over the validation losses at its evaluation steps (the paper:
63.7% at 3B). Every run gets a convergence note (tokens per parameter against ~20; loss still falling at the end).
The summary JSON holds numbers or null with the reason, never NaN.

--table groups runs by their variant and reports the mean ± standard deviation of the final validation loss over seeds,
and each variant minus the --reference variants (default vanilla and diff) paired by seed, with a paired t-test
(diff_transformer/analysis/variants.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Sequence

from diff_transformer.cli import EXIT_REFUSED, USER_ERRORS, ArgumentParser, print_error
from diff_transformer.analysis.plots import data_label, plot_comparison, plot_variant_spread
from diff_transformer.analysis.runs import PARAMETER_COUNTS, RunMismatchError, check_comparable, load_runs
from diff_transformer.analysis.scaling import BOOTSTRAP_SAMPLES, compare_runs, format_report
from diff_transformer.analysis.variants import format_table, seed_spread
from diff_transformer.analysis.wandb_runs import load_wandb_runs, log_to_wandb


def _json(summary) -> str:
    """Strict JSON (a NaN or an infinity raises rather than being written as the non-standard NaN)."""
    return json.dumps(summary, indent=2, allow_nan=False, default=lambda value: value.item()) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m diff_transformer.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="run directories or sweep directories holding them")
    parser.add_argument("--wandb", metavar="ENTITY/PROJECT/GROUP", help="read the runs of this W&B group instead, and log the comparison there")
    parser.add_argument("--out", help="figure path (default: compare.png in the first path, or ./compare-<group>.png)")
    parser.add_argument("--parameters", choices=PARAMETER_COUNTS, default="total", help="parameter count on the x axis of the size fit")
    parser.add_argument("--token-ratio-model", help="model name whose runs give each pair's token ratio (default: the largest both trained)")
    parser.add_argument("--token-fit-from", type=float, default=0.1, help="fit L(D) on evaluations past this fraction of training")
    parser.add_argument("--at", type=float, nargs="+", default=[], metavar="N",
                        help="also report the parameter ratio at these DIFF sizes, e.g. --at 6.8e9 (extrapolated)")
    parser.add_argument("--fixed-E", type=float, default=None, metavar="E",
                        help="fit the reduced form E + A*N^-alpha with E fixed at this loss (needs 3 sizes, not 4)")
    parser.add_argument("--bootstrap", type=int, default=BOOTSTRAP_SAMPLES, metavar="N",
                        help=f"bootstrap resamples per fit for the intervals (default {BOOTSTRAP_SAMPLES})")
    parser.add_argument("--allow-unfinished", action="store_true", help="compare runs that stopped before max_steps")
    parser.add_argument("--title", help="figure title")
    parser.add_argument("--table", action="store_true",
                        help="the seed-spread table of every variant instead of the scaling comparison")
    parser.add_argument("--reference", nargs="+", default=None, metavar="VARIANT",
                        help="the variant every other one is compared with (default vanilla; DIFF V2 is compared with "
                             "its own baseline when it was trained); with --table: variants every other one is "
                             "compared with, paired by seed (default vanilla diff)")
    args = parser.parse_args(argv)
    if args.bootstrap < 0:
        parser.error(f"--bootstrap {args.bootstrap}: give a number of resamples ≥ 0 (10 or more for intervals)")
    if bool(args.paths) == bool(args.wandb):
        parser.error("give run or sweep directories, or --wandb ENTITY/PROJECT/GROUP (one of the two)")
    try:
        runs = load_wandb_runs(args.wandb) if args.wandb else load_runs(args.paths)
        if args.table:
            check_comparable(runs, require_finished=not args.allow_unfinished)
            stats = seed_spread(runs, args.reference or ["vanilla", "diff"], args.parameters)
        else:
            if args.reference and len(args.reference) > 1:
                raise ValueError(f"--reference {' '.join(args.reference)}: the scaling comparison takes one reference "
                                 "variant (several only with --table)")
            reference = args.reference[0] if args.reference else "vanilla"
            variants = sorted({r.variant for r in runs})
            if args.reference and reference not in variants:
                raise ValueError(f"--reference {reference!r} is not a variant of these runs; they have: "
                                 f"{', '.join(variants)}")
            comparison = compare_runs(runs, args.parameters, args.token_ratio_model, args.token_fit_from,
                                      not args.allow_unfinished, args.at, reference, args.fixed_E, args.bootstrap)
    except (RunMismatchError,) + USER_ERRORS as error:
        print_error(error)
        return EXIT_REFUSED
    if args.out:
        out = Path(args.out)
    elif args.paths:
        first = Path(args.paths[0])
        out = (first if first.is_dir() else first.parent) / ("variants.png" if args.table else "compare.png")
    else:
        out = Path(f"{'variants' if args.table else 'compare'}-{args.wandb.rstrip('/').split('/')[-1]}.png")
    if args.table:
        print(format_table(stats))
        plot_variant_spread(stats, out, args.title, data_label(runs))
        out.with_suffix(".json").write_text(_json([s.summary() for s in stats]))
        print(f"\nfigure: {out}\nsummary: {out.with_suffix('.json')}")
        return 0
    print(format_report(comparison))
    plot_comparison(comparison, out, args.title)
    out.with_suffix(".json").write_text(_json(comparison.summary()))
    print(f"\nfigure: {out}\nsummary: {out.with_suffix('.json')}")
    if args.wandb:
        print(f"logged to W&B: {log_to_wandb(comparison, out, args.wandb)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
