"""Inspect (and verify) and convert checkpoints.

    python -m diff_transformer.checkpoint inspect runs/x                        # a run dir, checkpoints dir, latest file
    python -m diff_transformer.checkpoint inspect runs/x/checkpoints/step_00000100
    python -m diff_transformer.checkpoint convert runs/x/checkpoints/latest model.pt
    python -m diff_transformer.checkpoint convert runs/ds/checkpoints/latest runs/ds/torch_dist --to torch_dist

``inspect`` checks every file against the checkpoint's manifest (size and crc32) and names each one that fails; it
exits 2 for a damaged checkpoint. A DeepSpeed checkpoint (engine=deepspeed, any ZeRO stage) converts to torch_dist,
which engine=megatron starts from with checkpoint.load_weights_only=OUT; engine=deepspeed starts from a torch_dist
checkpoint the same way.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import List, Optional

from diff_transformer.cli import EXIT_REFUSED, ArgumentParser, print_error, run
from diff_transformer.fileio import check_output
from diff_transformer.training.checkpoint_files import (
    check_readable, describe, format_bytes, resolve_checkpoint_path, verify,
)

COMMAND = "diff_transformer.checkpoint"  # the mark of the checkpoint directories convert writes


def main(argv: Optional[List[str]] = None) -> int:
    """The command's exit status; a user error is one ``error:`` line and 2."""
    return run(_command, argv)


def _command(argv: Optional[List[str]]) -> int:
    parser = ArgumentParser(prog="python -m diff_transformer.checkpoint", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="verify the files; print step, layout, config and sizes")
    p_inspect.add_argument("path", help="a step_* checkpoint; a run or checkpoints directory, or a latest file (then its latest)")
    p_inspect.add_argument("--json", action="store_true", help="print JSON")
    p_inspect.add_argument("--sizes-only", action="store_true", help="check file sizes only, not checksums (fast)")
    p_convert = sub.add_parser(
        "convert", help="write a single-file PyTorch state dict (TP=1, PP=1), or a DeepSpeed checkpoint as torch_dist"
    )
    p_convert.add_argument("path", help="as for inspect")
    p_convert.add_argument("output")
    p_convert.add_argument(
        "--to", choices=("torch", "torch_dist"), default="torch",
        help="torch: one .pt file (default); torch_dist: a checkpoint directory engine=megatron loads (from DeepSpeed)",
    )
    p_convert.add_argument("--force", action="store_true",
                           help="replace an existing output file, or move aside what an output directory holds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "inspect":
        return inspect(args.path, args.json, checksums=not args.sizes_only)
    # the output, checked before seconds of loading: never an input, a run, another checkpoint or someone's files
    inputs = [args.path, resolve_checkpoint_path(args.path)]
    check_readable(inputs[1])  # a newer format, or a file that would run code: refused before any loading
    check_output(args.output, inputs, COMMAND, args.force, directory=args.to == "torch_dist", option="output")
    from diff_transformer.training.checkpoint_tools import convert_to_torch, convert_to_torch_dist

    if args.to == "torch_dist":
        out = convert_to_torch_dist(args.path, args.output, writer=COMMAND)
        print(
            f"wrote {out['path']}: torch_dist weights at tp={out['tp']} from ZeRO-{out['zero_stage']}; start from "
            f"them with checkpoint.load_weights_only={out['path']}"
        )
    else:
        out = convert_to_torch(args.path, args.output)
        print(f"wrote {out['path']}: {out['tensors']} tensors, {out['parameters']:,} parameters")
    return 0


def inspect(path: str, as_json: bool, checksums: bool) -> int:
    path = resolve_checkpoint_path(path)
    result = verify(path, checksums)
    if result.ok and not result.has_manifest:  # the older format's checks read torch_dist's .metadata: torch
        from diff_transformer.training.checkpoint import verify_checkpoint

        result = verify_checkpoint(path, checksums)
    try:
        info = describe(path)
    except (ValueError, KeyError, TypeError):
        if result.ok:
            raise
        info = {"path": path}  # trainer_state.json is among the damaged files
    info["verification"] = {
        "ok": result.ok, "problems": result.problems, "manifest": result.has_manifest,
        "checksums": result.checksums, "files": result.files, "bytes": result.bytes,
    }
    if as_json:
        print(json.dumps(info, indent=2))
    elif "step" in info:
        _print_description(info)
    if not as_json:
        if not result.ok:
            for problem in result.problems:
                print(f"damaged      {problem}")
        elif not result.has_manifest:
            print("verified     no manifest (saved before checkpoints recorded checksums): files present and long "
                  "enough, contents unverified")
        else:
            what = "sizes and crc32" if result.checksums else "sizes"
            print(f"verified     {result.files} files, {format_bytes(result.bytes)}: {what} match the manifest "
                  f"({result.seconds:.2f} s)")
    if not result.ok:
        print_error(f"checkpoint {path} is damaged: {result.summary()}")
        return EXIT_REFUSED
    return 0


def _print_description(info) -> None:
    lay = info["layout"]
    print(f"checkpoint   {info['path']}")
    print(f"step         {info['step']} ({info['consumed_samples']:,} samples, {info['skipped_steps']} skipped)")
    print(
        f"layout       tp={lay['tp']} pp={lay['pp']} dp={lay['dp']} world={lay['world_size']} "
        f"distributed_optimizer={lay['distributed_optimizer']}"
    )
    if info["engine"] == "deepspeed":
        print(
            f"engine       deepspeed ZeRO-{lay['zero_stage']} (offload optimizer {lay['offload_optimizer']}, "
            f"parameters {lay['offload_param']})"
        )
    else:
        print("engine       megatron (torch_dist)" + (f"; weights only, {info['converted_from']}"
                                                      if info["weights_only"] else ""))
    n = info["num_parameters"]
    print(f"parameters   {n:,}" if n else "parameters   ?")
    print(f"size         {info['size_bytes'] / 2**20:.2f} MiB")
    print(f"saved        {info['saved_at']} in {info['save_seconds']} s; W&B run {info['wandb_run_id']}")
    print("model        " + ", ".join(f"{k}={v}" for k, v in info["model"].items()))


if __name__ == "__main__":
    sys.exit(main())
