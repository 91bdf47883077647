"""Import a local Hugging Face Llama model directory as a checkpoint of this framework.

    python -m diff_transformer.import_hf path/to/llama --out checkpoints/llama          # then, to train from it:
    python train.py model.attention=vanilla ... checkpoint.load_weights_only=checkpoints/llama

The model settings (sizes, heads, GQA, RoPE θ, norm eps, vocabulary, tied embeddings) come from its config.json and
are printed as the ``model.*`` overrides a run needs; its tokenizer, if any, lands in ``OUT/tokenizer``. Reads only
the local directory; needs ``safetensors`` (the ``hf`` extra) for .safetensors weights.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import List, Optional

from diff_transformer.cli import EXIT_REFUSED, USER_ERRORS, ArgumentParser, print_error
from diff_transformer.fileio import check_output

COMMAND = "diff_transformer.import_hf"  # the mark of its output checkpoints: a rerun may replace them


def overrides_for(model: dict) -> List[str]:
    """The Hydra ``model.*`` overrides of an imported model config (unset keys left out)."""
    return [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in model.items() if v is not None]


def main(argv: Optional[List[str]] = None) -> int:
    parser = ArgumentParser(prog="python -m diff_transformer.import_hf", description=__doc__.split("\n")[0])
    parser.add_argument("hf_dir", help="a local directory with config.json and model.safetensors / pytorch_model.bin")
    parser.add_argument("--out", required=True,
                        help="the checkpoint directory to write: new, empty, or an earlier import (replaced)")
    parser.add_argument("--force", action="store_true",
                        help="write to an --out that holds other files: they are moved aside to OUT.old-<time>")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="model.seq_length to record (default: the config's max_position_embeddings)")
    parser.add_argument("--name", default=None, help="model.name to record (default: the directory's name)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if not os.path.isdir(args.hf_dir):  # refused before torch is imported
            raise FileNotFoundError(f"{args.hf_dir} is not a directory (give a local Hugging Face model directory)")
        check_output(args.out, [args.hf_dir], COMMAND, args.force)
        from diff_transformer.hf.importer import import_hf

        info = import_hf(args.hf_dir, args.out, seq_length=args.seq_length, name=args.name, writer=COMMAND)
    except USER_ERRORS + (ImportError,) as err:
        print_error(err)
        return EXIT_REFUSED
    print(f"wrote {info['path']}: {info['num_parameters']:,} parameters")
    if info["moved_aside"]:
        print(f"what {args.out} held before is kept in {info['moved_aside']}")
    print("train from it with: checkpoint.load_weights_only=" + info["path"] + " " + " ".join(overrides_for(info["model"])))
    if info["tokenizer_dir"]:
        print(f"its tokenizer: data.tokenizer_dir={info['tokenizer_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
