"""Benchmark: checkpoint save and load of a ~110M-parameter DIFF model with its Adam state (torch_dist format), with
and without verification.

It builds the model, optimizer and scheduler with the trainer's own code (one process, TP=PP=DP=1), takes one
training step so the Adam moments exist, then times, each ``--repeats`` times (median reported), once with crc32
recorded for every file (``checkpoint.verify=true``, the default) and once with sizes only (``verify=false``):
    save (sync)           CheckpointManager.save: staging, writing, the file records, fsync, manifest, rename, `latest`
    save (async)          the time the loop is blocked by an asynchronous save, and the time until it is on disk (the
                          crc32 of the tensor files is computed in the background writer)
    verify                what a resume checks before loading: every file's size (and crc32) against the manifest
    load                  CheckpointManager.load into the same model and optimizer (resume path)
GB/s = checkpoint bytes on disk / seconds. Every loaded tensor is checked against the saved one before timing. The
checkpoint was just written, so verification reads it from the page cache; from a cold disk it reads every byte once
more at the disk's speed (the load then finds the files cached).

    .venv/bin/python benchmarks/checkpoint.py                  # prints a markdown table
    .venv/bin/python benchmarks/checkpoint.py --out benchmarks/results   # also writes checkpoint_<hw>_<date>.md
"""

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from diff_transformer.training.checkpoint import CheckpointManager, directory_bytes, require_verified  # noqa: E402
from diff_transformer.config import register_configs, to_object  # noqa: E402
from diff_transformer.distributed import destroy_distributed, init_distributed  # noqa: E402
from diff_transformer.training.trainer import Trainer  # noqa: E402

# ~110M parameters: 12 layers of width 768 (6 differential heads of d=64), SwiGLU 2048, a 32k vocabulary
MODEL_OVERRIDES = [
    "model=debug", "model.name=bench-110m", "model.num_layers=12", "model.hidden_size=768", "model.num_heads=6",
    "model.ffn_hidden_size=2048", "model.vocab_size=32000", "model.seq_length=128",
]


def compose(overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    return to_object(cfg)


def build_trainer(cfg, run_dir):
    """The trainer's model, optimizer and scheduler without its data: what a checkpoint holds."""
    from diff_transformer.config import padded_vocab_size
    from diff_transformer.models.gpt import count_parameters

    trainer = Trainer(cfg, run_dir)
    init_distributed(cfg.parallel.backend, cfg.parallel.tp, cfg.parallel.pp, cfg.seed)
    trainer.rank = 0
    trainer.dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    trainer.padded_vocab = padded_vocab_size(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by, 1)
    trainer.model = [trainer._build_model()]
    trainer.optimizer, trainer.scheduler = trainer._build_optimizer()
    trainer.num_parameters = count_parameters(trainer.model)
    return trainer


def one_step(trainer):
    """A step on random tokens, so that Adam's moments are allocated and non-zero."""
    model = trainer.model[0]
    device = next(model.parameters()).device
    s = trainer.cfg.model.seq_length
    tokens = torch.randint(0, trainer.cfg.model.vocab_size, (1, s), device=device)
    position_ids = torch.arange(s, device=device).unsqueeze(0)
    model.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    loss = model(tokens, position_ids, None, labels=tokens).float().mean()
    loss.backward()
    trainer.optimizer.step()
    trainer.step += 1


def snapshot(trainer):
    state = {f"param.{n}": p.detach().clone() for n, p in trainer.model[0].named_parameters()}
    for inner in trainer.optimizer.chained_optimizers if hasattr(trainer.optimizer, "chained_optimizers") else [
        trainer.optimizer
    ]:
        for i, (p, st) in enumerate(inner.optimizer.state.items()):
            for k, v in st.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    state[f"optim.{id(inner)}.{i}.{k}"] = v.detach().clone()
    return state


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write checkpoints (default: a temporary directory)")
    parser.add_argument("--out", default=None, help="directory for the markdown result file")
    args = parser.parse_args()

    work = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    cfg = compose(MODEL_OVERRIDES + ["trainer.max_steps=10", "trainer.global_batch_size=1", "optim.warmup_steps=1"])
    trainer = build_trainer(cfg, str(work))
    try:
        one_step(trainer)
        manager = CheckpointManager(trainer, str(work / "checkpoints"))
        rows = ("save (sync)", "save (async), loop blocked", "save (async), on disk", "verify", "load",
                "verify + load")
        wall = {(row, mode): [] for row in rows for mode in (True, False)}
        cpu = {(row, mode): [] for row in rows for mode in (True, False)}  # this process, all its threads

        def record(row, mode, start):
            wall[row, mode].append(time.perf_counter() - start[0])
            cpu[row, mode].append(time.process_time() - start[1])

        def clock():
            return time.perf_counter(), time.process_time()

        size = 0
        for repeat in range(args.repeats):
            for checksums in (True, False):  # interleaved, so that a busy moment of the machine hits both
                manager.config.verify = checksums
                trainer.step = 100 + 2 * repeat + (not checksums)
                start = clock()
                path = manager.save(reason="benchmark")
                record("save (sync)", checksums, start)
                size = directory_bytes(path)

                reference = snapshot(trainer)
                with torch.no_grad():  # scramble, so that a load that wrote nothing would show
                    for p in trainer.model[0].parameters():
                        p.add_(1.0)
                start = clock()
                require_verified(path, checksums)
                record("verify", checksums, start)
                loading = clock()
                manager.load(path)
                record("load", checksums, loading)
                record("verify + load", checksums, start)
                loaded = snapshot(trainer)
                for key, tensor in reference.items():
                    torch.testing.assert_close(loaded[key], tensor, rtol=0, atol=0, msg=key)
                shutil.rmtree(path)

                manager.config.async_save = True
                trainer.step = 200 + 2 * repeat + (not checksums)
                start = clock()
                path = manager.save(reason="benchmark")
                record("save (async), loop blocked", checksums, start)
                manager.wait()
                record("save (async), on disk", checksums, start)
                manager.config.async_save = False
                require_verified(path, checksums)  # the background writer's records are right
                shutil.rmtree(path)

        hw = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or 'cpu'}, {os.cpu_count()} cores)"
        lines = [
            f"# Checkpoint save/load with and without verification, {trainer.num_parameters / 1e6:.1f}M-parameter DIFF "
            f"model + Adam state, {hw}",
            "",
            f"Checkpoint size {size / 1e9:.3f} GB (weights {str(trainer.dtype).replace('torch.', '')}, Adam moments "
            f"fp32), torch_dist format, one process; median of {args.repeats}. crc32: every file's size and crc32 "
            "recorded at save and checked before loading (`checkpoint.verify=true`, the default); sizes: sizes only "
            "(`checkpoint.verify=false`). Wall seconds, and CPU seconds of the training process (all its threads; "
            "not the forked writers, where an async save hashes); GB/s = size / wall time.",
            "",
            "| operation | crc32: wall s | GB/s | CPU s | sizes only: wall s | GB/s | CPU s | crc32 costs (wall, CPU) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            w1, w0 = statistics.median(wall[row, True]), statistics.median(wall[row, False])
            c1, c0 = statistics.median(cpu[row, True]), statistics.median(cpu[row, False])
            lines.append(
                f"| {row} | {w1:.3f} | {size / 1e9 / w1:.2f} | {c1:.3f} | {w0:.3f} | {size / 1e9 / max(w0, 1e-9):.2f} | "
                f"{c0:.3f} | {w1 - w0:+.3f} s, {c1 - c0:+.3f} s |"
            )
        text = "\n".join(lines)
        print(text)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            tag = "gpu" if torch.cuda.is_available() else "cpu"
            target = Path(args.out) / f"checkpoint_{tag}_{datetime.date.today().isoformat()}.md"
            target.write_text(text + "\n")
            print(f"wrote {target}")
    finally:
        destroy_distributed()
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
