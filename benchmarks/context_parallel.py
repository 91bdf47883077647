"""Context parallelism on a CPU: what the ring costs at CP=2 against CP=1 on the same total sequence.

    python benchmarks/context_parallel.py [--seq 2048 4096] [--repeats 5] [--out benchmarks/results]

Forward + backward, median of --repeats after a warm-up, each process one thread (OMP_NUM_THREADS=1):
- the core attention of diff, diff_v2 and vanilla (``sdpa``; the modules training builds, hidden 512, 4 differential
  heads of d = 64, batch 1): at CP=1 the usual path over the whole sequence in one process, and the ring's code on a
  ring of one (its block primitive on the whole causal sequence, no exchange); at CP=2 the ring
  (``models/ring_attention.py``) in two processes over gloo, each holding its two chunks of half the sequence;
- the whole ``tiny`` model (4 layers, hidden 128, DIFF) at the same sequence, forward and backward of the loss.
CP=2 has twice the cores of CP=1, so with no overhead it would take half the time: efficiency = t(ring of one) /
(2 · t(CP=2)) measures the ring's own cost (its exchanges, gloo copies on a CPU; the LSE merges; blocks computed
separately instead of one kernel call; the backward's dK/dV round; waiting for the slower rank). Against the usual
CP=1 path the block primitive may differ too (the ring's blocks return their LSE, which only torch's flash op gives
on a CPU). t(CP=2) is the slower rank's time.

Wall-clock times on a machine shared with other jobs move with their load; the CPU seconds the processes use move
much less: "extra CPU" = CPU seconds of both CP=2 ranks over those of the ring of one, minus 1, the work the ring adds
(exchanges, merges, smaller blocks), without its waiting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

KINDS = ("diff", "diff_v2", "vanilla")
CORE_MODEL = ["model.hidden_size=512", "model.num_heads=4", "model.num_layers=2", "model.ffn_hidden_size=1024"]


def compose(*overrides):
    from hydra import compose as hydra_compose, initialize_config_dir

    from diff_transformer.config import register_configs, to_object

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return to_object(hydra_compose("config", overrides=list(overrides)))


def median_seconds(step, repeats: int):
    """(median wall seconds, median CPU seconds of this process) of ``step``."""
    import torch

    step()  # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        torch.distributed.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


class RingOfOne:
    """The ring's code on one rank: its block primitive over the whole causal sequence, nothing exchanged."""

    rank, size = 0, 1


def core_attention_step(kind: str, seq: int, cp: int, ring_of_one: bool = False):
    """forward + backward of one layer's core attention on this rank's chunks, as the model calls it."""
    import torch
    from megatron.core.transformer.enums import AttnMaskType

    from diff_transformer.models.gpt import transformer_config
    from diff_transformer.models.layer_specs import attention_heads, layer_spec_for

    cfg = compose("model=tiny", *CORE_MODEL, f"model.attention={kind}", f"model.seq_length={seq}", f"parallel.cp={cp}")
    spec = layer_spec_for(cfg.model).submodules.self_attention.submodules.core_attention
    module = spec.module(config=transformer_config(cfg), layer_number=1, attn_mask_type=AttnMaskType.causal,
                         **spec.params)
    if ring_of_one:
        module.ring = RingOfOne()
    query_heads, kv_heads, d = attention_heads(cfg.model)
    s = seq // cp
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, 1, h, d, generator=generator).requires_grad_() for h in (query_heads, kv_heads, kv_heads))
    bias = torch.randn(s, 1, cfg.model.num_heads, generator=generator) if kind == "diff_v2" else None

    def step():
        out = module(q, k, v, None, attention_bias=bias)
        out.backward(torch.ones_like(out))

    return step


def model_step(seq: int, cp: int):
    """forward + backward of the tiny DIFF model's loss on this rank's chunks of one sequence."""
    import torch

    from diff_transformer.models.gpt import build_model_chunk
    from diff_transformer.training.steps import context_parallel_batch, loss_func

    cfg = compose("model=tiny", f"model.seq_length={seq}", f"parallel.cp={cp}")
    model = build_model_chunk(cfg, 4096)
    tokens = torch.randint(0, 4000, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(1, seq),
             "position_ids": torch.arange(seq)[None]}
    local, group = context_parallel_batch(batch)

    def step():
        losses = model(local["tokens"], local["position_ids"], None, labels=local["labels"])
        loss, _ = loss_func(local["loss_mask"], losses, cp_group=group)
        loss.backward()

    return step


def worker(out_json: str, seq: int, repeats: int) -> None:
    import torch

    from diff_transformer import distributed

    cp = distributed.world_size_from_env()
    distributed.init_distributed("gloo", tp=1, pp=1, seed=0, cp=cp)
    results = {f"core {kind}": median_seconds(core_attention_step(kind, seq, cp), repeats) for kind in KINDS}
    if cp == 1:
        results.update({f"core {kind} ring": median_seconds(core_attention_step(kind, seq, 1, True), repeats)
                        for kind in KINDS})
    results["tiny model (diff)"] = median_seconds(model_step(seq, cp), repeats)
    # per measurement: the slower rank's wall time, and the CPU seconds of all ranks together
    per_rank = zip(*distributed.all_gather_objects(list(results.values())))
    summary = {name: (max(w for w, _ in ranks), sum(c for _, c in ranks)) for name, ranks in zip(results, per_rank)}
    if torch.distributed.get_rank() == 0:
        Path(out_json).write_text(json.dumps(summary))
    distributed.destroy_distributed()


def measure(cp: int, seq: int, repeats: int, tmp: Path) -> dict:
    from diff_transformer.distributed import free_port

    out = tmp / f"cp{cp}.json"
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={cp}", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", str(Path(__file__).resolve()), "--worker", str(out),
               "--seq", str(seq), "--repeats", str(repeats)]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True)
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.seq[0], args.repeats)
        return 0
    from benchmarks.reports import machine_name, write_report

    load_before = os.getloadavg()[0]
    rows = []
    for seq in args.seq:
        with tempfile.TemporaryDirectory() as tmp:
            one, two = (measure(cp, seq, args.repeats, Path(tmp)) for cp in (1, 2))
        for name in two:
            (wall1, cpu1), (wall2, cpu2) = one[name], two[name]
            ring = one.get(f"{name} ring")
            rows.append(
                f"| {seq} | {name} | {1000 * wall1:.0f} | " + (f"{1000 * ring[0]:.0f}" if ring else "–") +
                f" | {1000 * wall2:.0f} | {wall1 / wall2:.2f}x | " + (f"{ring[0] / wall2 / 2:.0%}" if ring else "–") +
                f" | {1000 * cpu1:.0f} | " + (f"{1000 * ring[1]:.0f}" if ring else "–") + f" | {1000 * cpu2:.0f} | " +
                (f"{cpu2 / ring[1] - 1:+.0%}" if ring else f"{cpu2 / cpu1 - 1:+.0%} (against CP=1)") + " |")
    load_after = os.getloadavg()[0]
    report = "\n".join([
        f"# Context parallelism: CP=2 against CP=1 on {machine_name()}",
        "",
        f"Forward + backward of one sequence, batch 1, fp32, median of {args.repeats} after a warm-up; one "
        "thread a process; CP=2 is two processes over gloo, each with half the sequence (t: the slower rank). Core "
        "attention: the modules training builds (`sdpa`; hidden 512, 4 differential heads of d = 64, the baseline "
        "8 heads of 64); at CP=1 their usual path, at CP=2 the ring. The model: `tiny` DIFF (4 layers, hidden 128). "
        "Speedup: CP=1's usual path over CP=2 (wall). Efficiency: the ring of one over twice CP=2 (wall; CP=2 has "
        "twice the cores; 100% would be a ring that costs nothing). Extra CPU: CP=2's CPU seconds (both ranks) over "
        "the ring of one's, minus 1: the work the ring adds, which the other jobs on the machine disturb much less "
        "than the wall-clock times.",
        "",
        f"1-minute load average {load_before:.1f} before and {load_after:.1f} after, on {os.cpu_count()} cores"
        + (": the machine was shared with other jobs, so the times are noisy and slower than on an idle machine."
           if max(load_before, load_after) > os.cpu_count() else " (no other jobs to speak of)."),
        "",
        "| sequence | what | CP=1 wall (ms) | ring of one wall | CP=2 wall | speedup | efficiency | CP=1 CPU (ms) | "
        "ring of one CPU | CP=2 CPU (both ranks) | extra CPU of the ring |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"`python benchmarks/context_parallel.py --seq {' '.join(map(str, args.seq))} --repeats {args.repeats}`",
        "",
    ])
    write_report(report, args.out, "context_parallel")
    return 0


if __name__ == "__main__":
    sys.exit(main())
