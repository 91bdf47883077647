"""Compare every attention variant with a reference (DIFF with its mirrored baseline, DIFF V2 with its own): a verdict
against seed noise, scaling-law fits, and the parameter, token, FLOPs and device-time ratios at equal loss; or, with
--table, every variant of an ablation sweep: final validation loss over seeds and paired differences.

    python -m diff_transformer.compare multirun/tiny/2026-11-25_22-10-00 --out docs/tiny_sweep.png
    python -m diff_transformer.compare multirun/v2/2026-11-27_09-00-00 --reference vanilla
    python -m diff_transformer.compare --wandb my-team/diff-transformer/<sweep id>
    python -m diff_transformer.compare multirun/ablations/2026-11-26_05-00-00 --table --out docs/ablations.png

Runs are read from run directories (`run.json` + `metrics.jsonl`, found recursively under each path) or from the W&B
API (one sweep: its group, or its tag sweep:<id>). Replicates are runs of one (variant, model, lr) that differ by
seed; where a (variant, model) has several lrs, the lr with the lowest mean final loss over seeds is kept, and the
report says so. Each variant gets a verdict against its reference (diff_transformer/analysis/verdict.py): a
two-sided t-test at level 5% of the mean over sizes of the per-size difference in final validation loss (paired by
seed), `better`, `worse`, `indistinguishable` or `undetermined` (a size with one seed). Ratios are findings only when
the verdict is `better` or `worse`; otherwise they are withheld (compare.json keeps them under `withheld_ratios`).

Per variant the final validation losses are fitted with L(N) = E + A * (N / N_ref)^(-alpha) as Hoffmann et al. 2022
(approach 3) and Besiroglu et al. 2024 fit it: a Huber loss on log-loss, the log-sum-exp form, the best of a grid of
starts, 68% intervals from bootstrap refits (seeds resampled within each size where every size has several, else
the fit's residuals, and none from a fit with fewer than 2 residual degrees of freedom). A law is fitted only to more
sizes than it has parameters: with 3 sizes the reduced form A * N^(-alpha) (E fixed at 0, or at --fixed-E). The
parameter ratio is N_variant / N_reference at equal loss (the paper: 62% at 6.8B), marked extrapolated outside the
sizes trained. The token ratio comes from L(D) fitted on the final losses of finished runs at several token budgets
(cooldown branches, or runs with different max_steps); evaluations along one run give one only at a constant
learning rate. The FLOPs ratio fits loss against training FLOPs (run.json flops_per_token x tokens) and says where
the two curves cross; the device-time ratio, when every run ran on the same device, uses each run's measured
tokens/s. Ratios print to 2 significant figures; the summary JSON holds numbers or null with the reason.

--table groups runs by their variant and reports the mean ± standard deviation of the final validation loss over seeds,
and each variant minus the --reference variants (default vanilla and diff) paired by seed, with a paired t-test
(diff_transformer/analysis/variants.py).

compare never writes over a figure or summary it did not write (its summary carries "written_by" and the figure's
hash): such a path is refused unless --force.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Sequence

from diff_transformer.cli import EXIT_REFUSED, USER_ERRORS, ArgumentParser, print_error
from diff_transformer.fileio import atomic_write_text
from diff_transformer.analysis.plots import data_label, plot_comparison, plot_variant_spread, tokens_label
from diff_transformer.analysis.runs import PARAMETER_COUNTS, RunMismatchError, check_comparable, load_runs
from diff_transformer.analysis.scaling import BOOTSTRAP_SAMPLES, compare_runs, format_report
from diff_transformer.analysis.variants import format_table, seed_spread
from diff_transformer.analysis.wandb_runs import load_wandb_runs, log_to_wandb


WRITTEN_BY = "diff_transformer.compare"  # the summary's signature: this figure and summary are compare's own


def _json(summary) -> str:
    """Strict JSON (a NaN or an infinity raises rather than being written as the non-standard NaN)."""
    return json.dumps(summary, indent=2, allow_nan=False, default=lambda value: value.item()) + "\n"


def _figure_formats() -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return sorted(Figure().canvas.get_supported_filetypes())


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _written_by_compare(figure: Path) -> bool:
    """Whether the summary beside ``figure`` is compare's and, where the figure exists, names it with its hash."""
    try:
        summary = json.loads(figure.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(summary, dict) or summary.get("written_by") != WRITTEN_BY:
        return False
    return not figure.exists() or (summary.get("figure") or {}).get("sha256") == _sha256(figure)


def check_out(figure: Path, force: bool, given: bool) -> None:
    """Refuse, before any work, a figure format matplotlib cannot write, and a figure or summary path holding a
    file compare did not write (unless ``force``)."""
    what = f"--out {figure}" if given else f"the default output {figure} (give --out to choose another)"
    formats = _figure_formats()
    if figure.suffix.lower().lstrip(".") not in formats:
        raise ValueError(f"{what}: no figure can be written as {figure.suffix or 'a name without an extension'!r}; "
                         f"end the path in one of {', '.join('.' + f for f in formats)}")
    for path in (figure, figure.with_suffix(".json")):
        if path.is_dir():
            raise ValueError(f"{what}: {path} is a directory; give the path of a file")
    if force or _written_by_compare(figure):
        return
    for path in (figure, figure.with_suffix(".json")):
        if path.exists():
            raise ValueError(f"{what}: {path} exists and was not written by compare; give a new path, or add --force "
                             "to replace it")


def _write_summary(figure: Path, payload: dict) -> Path:
    """The summary beside the figure, signed as compare's with the figure's hash (what check_out looks for)."""
    path = figure.with_suffix(".json")
    signed = {"written_by": WRITTEN_BY, "figure": {"path": figure.name, "sha256": _sha256(figure)}, **payload}
    atomic_write_text(str(path), _json(signed))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m diff_transformer.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="run directories or sweep directories holding them")
    parser.add_argument("--wandb", metavar="ENTITY/PROJECT/GROUP",
                        help="read the runs of one sweep from W&B instead (its group, the sweep id; or sweep:<id>, its "
                             "tag), and log the comparison there")
    parser.add_argument("--out", help="figure path (default: compare.png in the first path, or ./compare-<group>.png); "
                                      "the summary goes beside it as .json")
    parser.add_argument("--force", action="store_true",
                        help="replace a figure or summary at the output path that compare did not write")
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
    if args.out:
        out = Path(args.out)
    elif args.paths:
        first = Path(args.paths[0])
        out = (first if first.is_dir() else first.parent) / ("variants.png" if args.table else "compare.png")
    else:
        group = args.wandb.rstrip("/").split("/")[-1].replace(":", "-")
        out = Path(f"{'variants' if args.table else 'compare'}-{group}.png")
    try:
        check_out(out, args.force, bool(args.out))
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
    if args.table:
        print(format_table(stats))
        plot_variant_spread(stats, out, args.title, f"{data_label(runs)}; {tokens_label(runs)}")
        summary = _write_summary(out, {"variants": [s.summary() for s in stats]})
        print(f"\nfigure: {out}\nsummary: {summary}")
        return 0
    print(format_report(comparison))
    plot_comparison(comparison, out, args.title)
    summary = _write_summary(out, comparison.summary())
    print(f"\nfigure: {out}\nsummary: {summary}")
    if args.wandb:
        print(f"logged to W&B: {log_to_wandb(comparison, out, args.wandb)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
