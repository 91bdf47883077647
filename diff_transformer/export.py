"""Export a checkpoint to another format.

    python -m diff_transformer.export runs/x --format hf --out hf/x                 # a run dir, checkpoints dir, latest file
    python -m diff_transformer.export runs/x/checkpoints/step_00001000 --format hf --out hf/x --dtype bfloat16

``--format hf``: a Hugging Face transformers directory (LlamaForCausalLM for vanilla, vanilla_wide and dex;
DiffLlamaForCausalLM for diff) with its tokenizer, loadable with ``AutoModelForCausalLM.from_pretrained(DIR)``.
Needs the ``hf`` extra (``pip install -c constraints.txt -e '.[hf]'``).
"""

from __future__ import annotations

import logging
import sys
from typing import List, Optional

from diff_transformer.cli import EXIT_REFUSED, USER_ERRORS, ArgumentParser, print_error
from diff_transformer.fileio import check_output
from diff_transformer.training.checkpoint_files import check_readable, resolve_checkpoint_path

FORMATS = ("hf",)
COMMAND = "diff_transformer.export"  # the mark of its output directories: a rerun may replace them


def main(argv: Optional[List[str]] = None) -> int:
    parser = ArgumentParser(prog="python -m diff_transformer.export", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a step_* checkpoint; a run or checkpoints directory, or a latest file")
    parser.add_argument("--format", required=True, help="hf: a Hugging Face transformers directory")
    parser.add_argument("--out", required=True,
                        help="the directory to write: new, empty, or an earlier export (replaced)")
    parser.add_argument("--force", action="store_true",
                        help="write to an --out that holds other files: they are moved aside to OUT.old-<time>")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the one the run trained with; none: write no tokenizer)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.format not in FORMATS:
            raise ValueError(f"--format {args.format!r} is unknown; use one of {', '.join(FORMATS)}")
        path = resolve_checkpoint_path(args.checkpoint)  # a path that is no checkpoint: refused before torch is imported
        check_readable(path)  # so is a newer format, or a file that would run code
        inputs = [args.checkpoint, path] + ([args.tokenizer] if args.tokenizer not in (None, "none") else [])
        check_output(args.out, inputs, COMMAND, args.force)
        from diff_transformer.hf.export import export_hf

        info = export_hf(args.checkpoint, args.out, dtype=args.dtype, tokenizer_dir=args.tokenizer, writer=COMMAND)
    except USER_ERRORS + (ImportError,) as err:
        print_error(err)
        return EXIT_REFUSED
    print(f"wrote {info['path']}: {info['architecture']} ({info['attention']}, step {info['step']}, {info['dtype']})")
    if info["moved_aside"]:
        print(f"what {args.out} held before is kept in {info['moved_aside']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
