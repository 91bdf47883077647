"""Inspect and convert checkpoints.

    python -m diff_transformer.checkpoint inspect runs/x                        # a run dir, checkpoints dir, latest file
    python -m diff_transformer.checkpoint inspect runs/x/checkpoints/step_00000100
    python -m diff_transformer.checkpoint convert runs/x/checkpoints/latest model.pt
    python -m diff_transformer.checkpoint convert runs/ds/checkpoints/latest runs/ds/torch_dist --to torch_dist

A DeepSpeed checkpoint (engine=deepspeed, any ZeRO stage) converts to torch_dist, which engine=megatron starts from
with checkpoint.load_weights_only=OUT; engine=deepspeed starts from a torch_dist checkpoint the same way.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import List, Optional

from diff_transformer.training.checkpoint_tools import convert_to_torch, convert_to_torch_dist, describe


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diff_transformer.checkpoint", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="print step, layout, config and sizes")
    p_inspect.add_argument("path", help="a step_* checkpoint; a run or checkpoints directory, or a latest file (then its latest)")
    p_inspect.add_argument("--json", action="store_true", help="print JSON")
    p_convert = sub.add_parser(
        "convert", help="write a single-file PyTorch state dict (TP=1, PP=1), or a DeepSpeed checkpoint as torch_dist"
    )
    p_convert.add_argument("path", help="as for inspect")
    p_convert.add_argument("output")
    p_convert.add_argument(
        "--to", choices=("torch", "torch_dist"), default="torch",
        help="torch: one .pt file (default); torch_dist: a checkpoint directory engine=megatron loads (from DeepSpeed)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.command == "inspect":
            info = describe(args.path)
            if args.json:
                print(json.dumps(info, indent=2))
                return 0
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
        elif args.to == "torch_dist":
            out = convert_to_torch_dist(args.path, args.output)
            print(
                f"wrote {out['path']}: torch_dist weights at tp={out['tp']} from ZeRO-{out['zero_stage']}; start from "
                f"them with checkpoint.load_weights_only={out['path']}"
            )
        else:
            out = convert_to_torch(args.path, args.output)
            print(f"wrote {out['path']}: {out['tensors']} tensors, {out['parameters']:,} parameters")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
