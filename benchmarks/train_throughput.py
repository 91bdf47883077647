"""Training throughput of DIFF against its mirrored baseline, each at its best (model.attention_backend=auto,
trainer.fusions on a GPU), with where each step's time goes.

    python benchmarks/train_throughput.py [--model tiny] [--steps 12] [--micro-batches 8] [--tp 1]
    python benchmarks/train_throughput.py --model 830m --micro-batch-size 4 --seq-length 2048          # one GPU
    python benchmarks/train_throughput.py --model 3b --micro-batch-size 1 --seq-length 4096 --fit-gib auto
    python benchmarks/train_throughput.py --model 830m --kinds diff_v2 v2_baseline --compile on   # V2, its baseline

Each configuration is a real ``train.py`` run (megatron-core schedules, DDP, optimizer; no validation, no
checkpoints) whose steps hold ``--micro-batches`` micro-batches (at least 8, so that per-step fixed costs weigh as
in real training: the paper's recipe has 32 at micro-batch 4 on one GPU). Per run: the median step time after the
warm-up (the first 20% of steps, at least 2) without the profiled step, tokens/s, MFU, the peak memory next to the
memory plan's estimate, the attention backend ``auto`` chose (and its timings), the kernel torch's SDPA dispatcher
picks for each attention call, and one step's time by kind of work (``trainer.profile_step``: GEMM, attention, DIFF
epilogue, norms, other elementwise, optimizer, communication, idle). ``--fit-gib GIB`` picks the least recomputation
(none, selective, block recomputation of N layers, full; fewest recomputed FLOPs) whose memory plan fits that many GiB,
``--fit-gib auto`` the card's memory (a simulated GPU's in gpu_run.sh's dry run); either way the plan may fill 90% of
it, the margin train.py's own check keeps. Kind ``v2_baseline`` is DIFF V2's mirrored baseline (``model.attention=
vanilla`` with V2's KV heads, ``gpt.v2_baseline``); DIFF V2 is compared with it. ``--compile off on`` runs each
configuration eagerly and with ``trainer.compile=true`` (each layer under torch.compile); every row shows its first
step's time (which under compile includes compiling) apart from the median. Hydra overrides after the options go to
every run. Ratios are only meaningful between rows of the same run on the same machine. Runs made one after the
other see different loads on a shared machine: at TP=1 (by default on a CPU, ``--ab-rounds``) DIFF and the
Transformer then also train in one process in alternating windows (``training.paired_throughput``), whose
ratio a neighbour's load does not move, with its interval. Writes ``<out>/train_throughput_<model>_<machine>_<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.reports import machine_name, write_report  # noqa: E402

from diff_transformer.distributed import free_port  # noqa: E402
from diff_transformer.figure_style import variant_name  # noqa: E402
from diff_transformer.training.accounting import USABLE_MEMORY_FRACTION  # noqa: E402

CATEGORIES = ("GEMM", "attention", "DIFF epilogue", "norms", "other elementwise", "optimizer", "communication", "idle")


def compose(overrides):
    from hydra import compose as hydra_compose, initialize_config_dir

    from diff_transformer.config import register_configs, to_object

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return to_object(hydra_compose("config", overrides=list(overrides)))


def card_memory(overrides) -> tuple[float, str] | None:
    """``--fit-gib auto``'s budget: (GiB, what it is) of the memory train.py's plan checks against
    (``trainer.gpu_memory_gib``, else this GPU's total memory), else, in Triton's interpreter simulating a GPU
    (gpu_run.sh --dry-run), that GPU's; None without either."""
    from diff_transformer.training.accounting import device_memory_gib
    from kernels import gpu_target

    cfg = compose(overrides)
    gib = device_memory_gib(cfg)
    if gib is not None:
        what = "trainer.gpu_memory_gib" if cfg.trainer.gpu_memory_gib is not None else torch.cuda.get_device_name()
        return gib, what
    simulated = gpu_target.simulated()
    if simulated is not None:
        return simulated.memory / 2**30, f"{simulated.name}, simulated ({gpu_target.SIMULATE_ENV})"
    return None


def fit_budget(text: str):
    """argparse ``type`` of ``--fit-gib``: ``auto`` or GiB above 0."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give GiB above 0, or auto (the card's memory)")
    return value


def fit_budget_gib(args, overrides) -> tuple[float, str]:
    """``--fit-gib``'s budget in GiB and what it is. Raises ValueError for ``auto`` without a GPU."""
    if args.fit_gib != "auto":
        return args.fit_gib, "--fit-gib"
    card = card_memory(overrides)
    if card is None:
        raise ValueError("--fit-gib auto takes the GPU's memory, and there is no GPU here (nor one simulated: "
                         "TRITON_INTERPRET=1 DIFF_ATTN_SIMULATE_GPU=sm_90); give --fit-gib GIB")
    return card


def fitting_recompute(overrides, world: int, budget_gib: float) -> tuple[list[str], str, float]:
    """The least recomputation whose memory plan fits ``budget_gib`` (90% usable, as train.py checks; see
    ``accounting.least_recomputation``): its overrides, its table label and its estimate (GiB). Raises ValueError
    naming what would fit when none does."""
    from diff_transformer.config import padded_vocab_size
    from diff_transformer.training.accounting import least_recomputation, recompute_label

    cfg = compose(overrides)
    vocab = padded_vocab_size(cfg.model.vocab_size or 4096, cfg.model.make_vocab_size_divisible_by, cfg.parallel.tp)
    changes, estimate = least_recomputation(cfg, torch.bfloat16, world, vocab, budget_gib, "cuda")
    fitted = [f"{key}={'null' if value is None else value}" for key, value in changes.items()]
    return fitted, recompute_label(compose(overrides + fitted)), estimate


def sdpa_kernels(overrides) -> list[str]:
    """The kernel torch's SDPA dispatcher picks for each attention call of one layer of this configuration (its
    sdpa backend, this machine, the run's dtype and per-rank shape)."""
    from diff_transformer.compat import apply_cpu_patches
    from diff_transformer.models.attention.base import record_sdpa_kernels
    from diff_transformer.models.gpt import epilogue_impl, resolve_precision
    from diff_transformer.training.backend_choice import core_attention_problem

    apply_cpu_patches()
    cfg = compose(overrides)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    module, (q, k, v), bias = core_attention_problem(cfg, "sdpa", resolve_precision("auto"), epilogue_impl(cfg), device)
    with record_sdpa_kernels() as calls:
        module(q, k, v, None, attention_bias=bias)
    del module, q, k, v
    if device == "cuda":
        torch.cuda.empty_cache()
    return calls


def run(overrides, tp: int, run_dir: Path) -> dict:
    if tp == 1:
        cmd = [sys.executable, str(REPO / "train.py"), *overrides, f"hydra.run.dir={run_dir}"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tp}", f"--master_port={free_port()}",
               str(REPO / "train.py"), *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:  # report it and go on with the next configuration: one failure hides no other result
        print(f"train.py failed with exit {proc.returncode} ({' '.join(overrides)}):\n{proc.stdout[-3000:]}\n"
              f"{proc.stderr[-6000:]}", flush=True)
        return {"failed": f"exit {proc.returncode}"}
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    info = json.loads((run_dir / "run.json").read_text())
    profiles = sorted(run_dir.glob("profile_step_*.json"))
    profile = json.loads(profiles[0].read_text()) if profiles else None
    warmup = max(2, len(records) // 5)
    kept = [r for r in records[warmup:] if profile is None or r["step"] != profile["step"]] or records[-1:]
    step_time = statistics.median(r["step_time"] for r in kept)
    first = records[0]
    mfu = [r["mfu"] for r in kept if r.get("mfu") is not None]
    choice_path = run_dir / "attention_backend.json"
    return {
        "step_time_s": step_time, "tokens_per_s": info["tokens_per_step"] / step_time,
        "mfu": statistics.median(mfu) if mfu else None,
        "memory_gib": max(r.get("memory_gib") or 0.0 for r in records),
        "estimate_gib": info.get("memory_estimate_gib"), "backend": info.get("attention_backend"),
        "choice": json.loads(choice_path.read_text()) if choice_path.exists() else None,
        "first_step_s": first["step_time"] if first["step"] == 1 else None,
        "first_loss": first["loss"], "last_loss": records[-1]["loss"], "profile": profile,
        "cuda_graphs": cuda_graphs_report(run_dir),
    }


def cuda_graphs_report(run_dir: Path):
    """trainer.cuda_graphs' line of the run's log: what torch recorded or skipped, and why (None without it)."""
    log = run_dir / "train.log"
    lines = log.read_text().splitlines() if log.exists() else []
    found = [line.split("trainer.cuda_graphs=", 1)[1] for line in lines
             if "trainer.cuda_graphs=" in line and ("recorded by step" in line or "no CUDA graph" in line)]
    return found[-1].split(": ", 1)[-1] if found else None


def _percent(value) -> str:
    return "" if value is None else f"{100 * value:.1f}%"


def _compile_cell(row) -> str:
    """on/off, and under trainer.cuda_graphs the graphs recorded against those expected (the log's report)."""
    cell = "on" if row["compile"] else "off"
    if not row.get("cuda_graphs_on"):
        return cell
    found = re.match(r"(\d+) CUDA graphs recorded by step \d+ \(expected (\d+)", row.get("cuda_graphs") or "")
    graphs = f"{found.group(1)}/{found.group(2)}" if found else "none" if row.get("cuda_graphs") else "?"
    return f"{cell}, CUDA graphs {graphs}"


def _seconds(value) -> str:
    return "" if value is None else f"{value:.2f}"


def profile_table(rows) -> list[str]:
    profiled = [r for r in rows if r.get("profile")]
    if not profiled:
        return []
    head = " | ".join(f"{r['label']} ms | %" for r in profiled)
    lines = [
        f"One step by kind of work (torch.profiler; {'kernel time' if profiled[0]['profile']['device'] == 'cuda' else 'operators’ own CPU time'}, "
        "idle = the step's wall time left over):", "",
        f"| kind of work | {head} |", "|---|" + "---|---|" * len(profiled),
    ]
    for kind in CATEGORIES:
        cells = []
        for r in profiled:
            p = r["profile"]
            seconds = p["seconds"].get(kind, 0.0)
            cells.append(f"{seconds * 1e3:.1f} | {100 * seconds / p['step_time_s']:.1f}%")
        lines.append(f"| {kind} | {' | '.join(cells)} |")
    steps = " | ".join(f"{r['profile']['step_time_s'] * 1e3:.1f} | 100%" for r in profiled)
    lines.append(f"| step (profiled) | {steps} |")
    lines += ["", "Largest items of the profiled step:", ""]
    for r in profiled:
        top = ", ".join(f"{t['name'][:60]} ({t['kind']}, {t['seconds'] * 1e3:.2f} ms)" for t in r["profile"]["top"][:8])
        lines.append(f"- {r['label']}: {top}")
    # the elementwise kernels by name: what fusing further would take off (inductor's names say what each fused)
    lines += ["", "Largest elementwise items (other elementwise, norms) of the profiled step:", ""]
    for r in profiled:
        top = ", ".join(f"{t['name'][:100]} ({t['seconds'] * 1e3:.2f} ms)" for t in r["profile"]["top"]
                        if t["kind"] in ("other elementwise", "norms"))
        lines.append(f"- {r['label']}: {top or 'none among the 30 largest items'}")
    return lines + [""] + idle_lines(profiled)


def idle_lines(profiled) -> list[str]:
    """Where the GPU waited in the profiled step (GPU profiles only): the median step's idle, estimated from the
    profiled step's busy time, the largest gaps by the operator that launched the kernel after each, the host syncs."""
    profiled = [r for r in profiled if r["profile"]["device"] == "cuda"]
    if not profiled:
        return []
    lines = ["Where the GPU waited (idle: no kernel or copy running). The median step's idle is an estimate: its "
             "time less the profiled step's busy time (the profiler slows the host, so the profiled step idles "
             "more). Gaps are put on the operator that launched the kernel after each (the module it ran in, or "
             "its backward node):", ""]
    for r in profiled:
        p = r["profile"]
        median_idle = max(0.0, r["step_time_s"] - p["busy_s"])
        gaps = "; ".join(f"{g['site'][:90]} {g['seconds'] * 1e3:.1f} ms ({g['count']} gaps, largest "
                         f"{g['largest_ms']:.2f} ms)" for g in p["idle_gaps"][:6])
        syncs = ", ".join(f"{s['site'][:70]} ×{s['count']}" for s in p["host_syncs"]) or "none"
        sites = ", ".join(f"{s['site']} ×{s['count']}" for s in p["sync_sites"][:6]) or "none"
        lines += [f"- {r['label']}: busy {p['busy_s'] * 1e3:.1f} ms of the profiled step's "
                  f"{p['step_time_s'] * 1e3:.1f}; idle in a median step ≈ {median_idle * 1e3:.1f} ms of "
                  f"{r['step_time_s'] * 1e3:.1f} ({100 * median_idle / r['step_time_s']:.1f}%)",
                  f"  - largest gaps: {gaps or 'none'}",
                  f"  - host syncs (CUDA runtime): {syncs}; at Python lines: {sites}"]
    return lines + [""]


def fill_lines(profiled, micro_batches: int, top: int = 12) -> list[str]:
    """The profiled step's memsets and fill kernels (GPU profiles only) by the operator that launched them, its
    module or backward node and Python frame, and the chain of operators from its call to the fill; per micro-batch
    too, the work that most often came next on its stream, and how each launcher was found."""
    profiled = [r for r in profiled if r["profile"]["device"] == "cuda" and "fills" in r["profile"]]
    if not profiled:
        return []
    lines = ["Memsets and fill kernels of the profiled step by launcher (the operator that launched each, with its "
             "module or backward node; operators: from its call to the fill; MB where the trace records a memset's "
             "bytes; most often next: the device work that followed on the same stream, which a library's memset "
             "prepares):", ""]
    for r in profiled:
        totals, how = r["profile"]["fill_totals"], r["profile"]["fill_launchers"]["how"]
        lines.append(f"- {r['label']}: {totals['memset']['count']} memsets ({totals['memset']['ms']:.2f} ms) and "
                     f"{totals['fill']['count']} fill kernels ({totals['fill']['ms']:.2f} ms) in the profiled step; "
                     f"launchers: {how['linked']} linked by the profiler, {how['runtime call']} by the runtime call, "
                     f"{how['time span']} by time span, {how['not recorded']} not recorded")
    lines += ["", "| run | kind | launched by | operators | count | per micro-batch | MB | ms | most often next |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in profiled:
        for f in r["profile"]["fills"][:top]:
            megabytes = f"{f['bytes'] / 1e6:.3f}" if f["bytes"] else "–"  # bytes the trace did not record
            lines.append(f"| {r['label']} | {f['kind']} | {f['site'][:120]} | {f['chain'][:90]} | {f['count']} "
                         f"| {f['count'] / micro_batches:.1f} | {megabytes} | {f['ms']:.3f} "
                         f"| {f['next']['name'][:60]} ×{f['next']['count']} |")
    return lines + [""]


def report(args, rows) -> str:
    """The markdown report of the runs so far (rewritten after each, so that a run cut off keeps what it measured)."""
    failed = [r for r in rows if "failed" in r]
    rows = [r for r in rows if "failed" not in r]
    seq = args.seq_length or compose([f"model={args.model}"]).model.seq_length
    command = " ".join([f"python benchmarks/train_throughput.py --model {args.model} --steps {args.steps}",
                        f"--micro-batches {args.micro_batches} --micro-batch-size {args.micro_batch_size}",
                        *([f"--seq-length {args.seq_length}"] if args.seq_length else []),
                        f"--tp {' '.join(map(str, args.tp))} --kinds {' '.join(args.kinds)}",
                        f"--compile {' '.join(args.compile)}",
                        *([f"--fit-gib {args.fit_gib}"] if args.fit_gib else []), *args.overrides])
    lines = [
        f"# Training throughput, `{args.model}` at sequence {seq}, {machine_name()}, {datetime.date.today()}",
        "",
        f"Command: `{command}` ({args.micro_batches} micro-batches of {args.micro_batch_size} per step and "
        f"data-parallel rank; bf16 on a GPU, fp32 on a CPU; median step time after the warm-up, without the profiled "
        f"step; first step: step 1's time, which with compile on includes compiling the layers, and with CUDA "
        f"graphs recording them). Machine: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}.",
        "",
        "| attention (backend) | TP | recompute | compile | ms/step | first step s | tokens/s | MFU | peak GiB "
        "| plan GiB | plan / peak | first loss | last loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *[f"| {r['label']} | {r['tp']} | {r['recompute'] or 'none'} | {_compile_cell(r)} "
          f"| {r['step_time_s'] * 1e3:.1f} | {_seconds(r['first_step_s'])} | {r['tokens_per_s']:,.0f} "
          f"| {_percent(r['mfu'])} | {r['memory_gib']:.2f} | {r['estimate_gib']:.2f} | {r['estimate_gib'] / r['memory_gib']:.2f} "
          f"| {r['first_loss']:.3f} | {r['last_loss']:.3f} |" for r in rows],
        *[f"| {r['label']} | {r['tp']} | | {_compile_cell(r)} | failed: {r['failed']} | | | | | | | | |"
          for r in failed],
        "",
    ]
    if getattr(args, "budget_gib", None) is not None:
        lines += [f"Recomputation: the least (fewest recomputed FLOPs) whose memory plan fits {args.budget_what}, "
                  f"{args.budget_gib:.1f} GiB (`--fit-gib {args.fit_gib}`), filling at most "
                  f"{USABLE_MEMORY_FRACTION:.0%} of it ({USABLE_MEMORY_FRACTION * args.budget_gib:.1f} GiB: the margin train.py's check keeps for the CUDA context, the "
                  "allocator and transient tensors); its plan is each row's plan GiB.", ""]
    by = {}
    for r in rows:  # the first row of each kind stands for it in the ratios
        by.setdefault((r["kind"], r["tp"], r["compile"]), r)
    for r in rows:
        eager = by.get((r["kind"], r["tp"], False))
        if r["compile"] and eager is not None:
            lines.append(f"- **{r['label']} / {eager['label']} tokens/s at TP={r['tp']}: "
                         f"{r['tokens_per_s'] / eager['tokens_per_s']:.3f}**; first step "
                         f"{_seconds(r['first_step_s'])} s against {_seconds(eager['first_step_s'])} s; peak memory "
                         f"{r['memory_gib'] / eager['memory_gib']:.3f}×")
    for r in rows:  # against every row of its baseline at its TP and compile mode (the baseline on each backend run)
        baseline = BASELINE_OF.get(r["kind"], "vanilla")
        bases = [b for b in rows if b["kind"] == baseline and (b["tp"], b["compile"]) == (r["tp"], r["compile"])]
        for base in bases if r["kind"] not in BASELINE_KINDS else []:
            lines.append(f"- **{r['label']} / {base['label']} tokens/s at TP={r['tp']}: "
                         f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}**; peak memory "
                         f"{r['memory_gib'] / base['memory_gib']:.3f}× (runs one after the other: a neighbour's load on a "
                         f"shared machine moves this ratio; the interleaved one does not)")
    for (tp, compiled), ab in sorted(getattr(args, "paired", {}).items()):
        lines.append(f"- **interleaved in one process at TP={tp}{', compiled' if compiled else ''}: "
                     f"{ab.describe('DIFF', 'Transformer')}**")
    graphs = [r for r in rows if r.get("cuda_graphs_on")]
    if graphs:
        lines += ["", "CUDA graphs per run (trainer.cuda_graphs, from the run's log):", ""]
        lines += [f"- {r['label']}: {r.get('cuda_graphs') or 'no report in the log'}" for r in graphs]
    lines += ["", "Attention backend and kernels per run:", ""]
    for r in rows:
        choice = r.get("choice") or {}
        timings = ", ".join(f"{b} {t:.3f} ms" if t is not None else f"{b} failed"
                            for b, t in (choice.get("timings_ms") or {}).items())
        lines.append(f"- {r['label']}: backend {r['backend']} ({choice.get('how', 'explicit')}"
                     f"{'; one layer fwd+bwd: ' + timings if timings else ''}); SDPA kernels of one layer's sdpa "
                     f"path{'' if r['backend'] == 'sdpa' else ' (not the backend this run trained on)'}: "
                     f"{'; '.join(r['kernels']) or 'none'}")
    lines += ["", *profile_table(rows), *fill_lines([r for r in rows if r.get("profile")], args.micro_batches)]
    return "\n".join(lines) + "\n"


# DIFF V2 against its mirrored baseline (gpt.v2_baseline), every other kind against the Transformer
BASELINE_OF = {"diff_v2": "v2_baseline"}
BASELINE_KINDS = ("vanilla", "v2_baseline")


def attention_overrides(args, kind: str) -> list[str]:
    """``model.attention`` for kind ``kind``; ``v2_baseline``: the Transformer with DIFF V2's query and KV heads at
    this model (and the user's overrides). Raises ValueError where V2 has no baseline (an odd number of KV heads)."""
    if kind != "v2_baseline":
        return [f"model.attention={kind}"]
    from diff_transformer.models.gpt import v2_baseline

    v2 = compose([f"model={args.model}", *args.overrides, "model.attention=diff_v2"])
    baseline, overrides = v2_baseline(v2.model)
    if baseline is None:
        raise ValueError(f"--kinds v2_baseline: {overrides}")
    return overrides.split()


def run_overrides(args, tp: int, spec: str, compile_mode: str, profile_step: int) -> list[str]:
    """train.py's overrides for attention kind[:backend] ``spec`` at TP ``tp``, trainer.compile ``compile_mode`` (the
    user's overrides come last and win)."""
    kind, _, backend = spec.partition(":")
    return [
        f"model={args.model}", *attention_overrides(args, kind), f"parallel.tp={tp}",
        f"trainer.max_steps={args.steps}", f"trainer.micro_batch_size={args.micro_batch_size}",
        f"trainer.global_batch_size={args.micro_batch_size * args.micro_batches}",
        *([f"model.seq_length={args.seq_length}"] if args.seq_length else []),
        *([f"model.attention_backend={backend}"] if backend else []),
        "trainer.eval_interval=0", "trainer.log_interval=1000000", f"optim.warmup_steps={max(1, args.steps // 10)}",
        f"trainer.profile_step={profile_step}", "logging.wandb.mode=disabled", "checkpoint.interval=0",
        "checkpoint.save_at_end=false", "checkpoint.check_free_space=false",
        "failures.signals=[]",  # a time limit's SIGTERM ends the run; no checkpoint (45 GB at 3b) is saved
        f"trainer.compile={'true' if compile_mode == 'on' else 'false'}",
        *args.overrides,
    ]


def measure(args, tp: int, spec: str, compile_mode: str, overrides: list[str], fit, tmp: Path) -> dict:
    """One configuration's row: ``overrides`` (:func:`run_overrides`) and ``fit``, the recomputation that
    ``--fit-gib`` chose (:func:`fitting_recompute`) or None."""
    kind, _, backend = spec.partition(":")
    composed = compose(overrides).trainer  # what the run does, whichever option or override set it
    compiled, graphs = composed.compile, composed.cuda_graphs != "off"
    recompute = None
    if fit is not None:
        fitted, recompute, estimate = fit
        overrides = overrides + fitted
        how = "" if recompute == "none" else f" ({' '.join(fitted)})"
        print(f"{kind}: recompute {recompute}{how} fits {args.budget_what}, {args.budget_gib:.1f} GiB "
              f"(plan {estimate:.1f} GiB of the {USABLE_MEMORY_FRACTION:.0%} usable, "
              f"{USABLE_MEMORY_FRACTION * args.budget_gib:.1f})", flush=True)
    try:
        kernels = sdpa_kernels(overrides)
    except Exception as err:  # the attention kinds without an sdpa path (none today), or no memory left
        kernels = [f"not measured: {type(err).__name__}: {err}"]
    print(f"{variant_name(kind)}: SDPA kernels per layer: {kernels}", flush=True)
    run_dir = tmp / f"{kind}-{backend or 'auto'}-tp{tp}-compile-{compile_mode}"
    result = run(overrides, tp, run_dir)
    from diff_transformer.models.gpt import dynamo_disabled

    from diff_transformer.models.layer_specs import variant_label

    # the Transformer with V2's KV heads named as compare names it ("Transformer num_kv_heads=4")
    name = variant_label(compose(overrides).model) if kind == "v2_baseline" else kind
    label = f"{variant_name(name)} ({result.get('backend') or backend or 'auto'})"
    if compiled:  # under TORCHDYNAMO_DISABLE=1 (gpu_run.sh --dry-run) train.py runs the layers eagerly
        label += " compiled" if not dynamo_disabled() else " compile (TorchDynamo off: eager)"
    if graphs:
        label += ", CUDA graphs"
    return {"kind": kind, "label": label, "tp": tp, "recompute": recompute, "compile": compiled, "kernels": kernels,
            "cuda_graphs_on": graphs, "run_dir": run_dir, **result}


def report_name(args) -> str:
    """train_throughput_<model>, with what sets the run apart from the default (kinds other than DIFF and the
    Transformer, auto's backends, micro-batches of 4, compile off), so that two runs of one model into one directory
    (a GPU run's $OUT) keep both reports."""
    kinds = sorted({spec.split(":", 1)[0] for spec in args.kinds} - {"diff", "vanilla"})
    backends = sorted({spec.split(":", 1)[1] for spec in args.kinds if ":" in spec})
    micro_batch = [] if args.micro_batch_size == 4 else [f"mb{args.micro_batch_size}"]
    compile_modes = [] if args.compile == ["off"] else ["compile-" + "-".join(args.compile)]
    graphs = ["cuda-graphs"] if compose([f"model={args.model}", *args.overrides]).trainer.cuda_graphs != "off" else []
    return "_".join(["train_throughput", args.model, *(["-".join(kinds)] if kinds else []), *backends, *micro_batch,
                     *compile_modes, *graphs])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step and data-parallel rank")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=None)
    parser.add_argument("--tp", type=int, nargs="+", default=[1])
    parser.add_argument("--kinds", nargs="+", default=["diff", "vanilla"], metavar="KIND[:BACKEND]",
                        help="attention kinds, each optionally with its backend (default auto: diff:triton, "
                             "diff:sdpa); v2_baseline: DIFF V2's mirrored Transformer")
    parser.add_argument("--fit-gib", type=fit_budget, default=None, metavar="GIB|auto",
                        help="pick the least recomputation whose memory plan fits this many GiB per GPU (auto: the "
                             "card's memory), 90%% of it usable")
    parser.add_argument("--compile", nargs="+", choices=("off", "on"), default=["off"],
                        help="trainer.compile for each configuration: off, on, or both (off on) to compare them")
    parser.add_argument("--profile-step", type=int, default=None, help="step to profile (default: the last but one)")
    parser.add_argument("--ab-rounds", type=int, default=None,
                        help="rounds of the interleaved DIFF/Transformer A/B at TP=1 (default: 10 on a CPU, 0 on a "
                             "GPU, where both models would share its memory; 0 skips it)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_intermixed_args()  # overrides may follow options (gpu_run.sh appends toy sizes)
    if args.micro_batches * args.micro_batch_size < 32:
        print(f"note: {args.micro_batches} micro-batches of {args.micro_batch_size}: fewer than the paper's 32 "
              "sequences a step, per-step fixed costs weigh more than in training")

    profile_step = args.profile_step or max(1, args.steps - 1)
    name = report_name(args)
    # every configuration's overrides and recomputation before any run: a bad kind or a card too small costs nothing
    configs = [(tp, spec, mode) for tp in args.tp for spec in args.kinds for mode in args.compile]
    try:
        planned = {c: run_overrides(args, *c, profile_step) for c in configs}
        fits = {c: None for c in configs}
        if args.fit_gib is not None:
            args.budget_gib, args.budget_what = fit_budget_gib(args, planned[configs[0]])
            fits = {c: fitting_recompute(planned[c], c[0], args.budget_gib) for c in configs}
    except ValueError as err:
        print(f"error: train_throughput.py: {err}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tp, spec, compile_mode in configs:
            rows.append(measure(args, tp, spec, compile_mode, planned[tp, spec, compile_mode],
                                fits[tp, spec, compile_mode], Path(tmp)))
            r = rows[-1]
            write_report(report(args, rows), args.out, name, quiet=True)  # so far
            where = f"{r['label']} tp={tp} micro-batch {args.micro_batch_size} ({args.micro_batches} a step)"
            if r["recompute"]:
                where += f" recompute {r['recompute']}"
            if "failed" in r:
                print(f"{where}: FAILED ({r['failed']})", flush=True)
                continue
            mfu = f"  MFU {_percent(r['mfu'])}" if r["mfu"] is not None else ""
            print(f"{where}: {r['step_time_s'] * 1e3:8.1f} ms/step  {r['tokens_per_s']:10,.0f} tok/s{mfu}  "
                  f"first step {_seconds(r['first_step_s'])} s  peak {r['memory_gib']:.2f} GiB "
                  f"(plan {r['estimate_gib']:.2f})  loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}",
                  flush=True)
            if r.get("cuda_graphs_on"):
                print(f"{where}: CUDA graphs: {r.get('cuda_graphs') or 'no report in the log'}", flush=True)
        args.paired = paired_ratios(rows, args.ab_rounds)
    write_report(report(args, rows), args.out, name)
    return 1 if any("failed" in r for r in rows) else 0


def paired_ratios(rows, rounds) -> dict:
    """{(tp, compiled): the interleaved A/B of the first DIFF and Transformer rows} at TP=1, while their run
    directories exist."""
    from diff_transformer.training.paired_throughput import paired_run_throughput

    rounds = rounds if rounds is not None else (0 if torch.cuda.is_available() else 10)
    paired = {}
    for compiled in sorted({r["compile"] for r in rows}) if rounds else []:
        first = {}
        for r in rows:
            if "failed" not in r and r["tp"] == 1 and r["compile"] == compiled:
                first.setdefault(r["kind"], r)
        if "diff" in first and "vanilla" in first:
            paired[(1, compiled)] = paired_run_throughput(str(first["diff"]["run_dir"] / "config.yaml"),
                                                          str(first["vanilla"]["run_dir"] / "config.yaml"), rounds)
            print(f"interleaved, TP=1{' compiled' if compiled else ''}: "
                  f"{paired[(1, compiled)].describe('DIFF', 'Transformer')}", flush=True)
    return paired



if __name__ == "__main__":
    sys.exit(main())
