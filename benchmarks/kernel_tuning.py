"""The fused kernel's GPU sweep: every design, then block configs kernel by kernel, correctness before any timing.

    python benchmarks/kernel_tuning.py                       # GPU: about 3.5 minutes from a cold Triton cache
    python benchmarks/kernel_tuning.py --smoke               # CPU: the same steps at toy sizes in the interpreter

Problems: V1 and V2 (bf16, causal, B·N = --tokens, H = --heads differential heads) at each --head-dims. For each:
  1. correctness: every design (and the earlier kernels' design with their configs, the reference) at N = 512
     against the fp32 reference (kernels/diff_attn/naive.py), output and gradients; a design that fails is not timed;
  2. designs: forward and forward+backward time of each design with the table's configs, and of the earlier kernels
     (one-pass forward, fused dK/dV, their configs, V1's norm and scale in PyTorch as the model ran them);
  3. configs: for each kernel of the fastest design, its table config against a few candidates (the others fixed).
Order: V1 at the first head dim (128: the larger sizes) steps 1-3, then steps 1-2 of every other problem (d = 96 is
the 830m size), then their step 3. A design is a tuning.Design: forward onepass/twopass, backward fused/split/atomic
(atomic is opt-in and not deterministic: timed, never proposed), tensor descriptors, split head dims (d = 96).
Each result is one JSON line appended to --out as soon as it is measured, so a run cut off by its time limit keeps
what it measured; no measurement starts after --budget-s. At the end it writes
benchmarks/results/kernel_tuning_<gpu>_<date>.md: the timings, and the table entries (DEFAULT_DESIGNS and
DEFAULT_CONFIGS of kernels/diff_attn/tuning.py for this GPU's capability) that the measurements propose.

Times: triton.testing.do_bench, median. The first call of each design or config compiles its kernels (about 2 s of
CPU each, measured on a 2-core machine for sm_90), which the budget includes: V1 d = 128's designs compile about 20
kernels and its config step about 24, each other problem's designs 17 to 28.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import triton  # noqa: E402

from kernels.diff_attn import diff_flash_attn, diff_flash_attn_v2, launch, tuning  # noqa: E402
from kernels.diff_attn.naive import diff_attn_naive, diff_attn_v2_naive  # noqa: E402
from kernels.diff_attn.tuning import BlockConfig, Design, Plan  # noqa: E402

D = Design
# Designs timed per problem, besides the table's (the first that applies is compared with the table's).
V1_DESIGNS = [D("twopass", "split"), D("twopass", "split", descriptors=True), D("onepass", "split"),
              D("twopass", "fused"), D("twopass", "atomic"), D("onepass", "split", descriptors=True)]
V2_DESIGNS = [D("onepass", "split"), D("twopass", "split"), D("onepass", "split", descriptors=True),
              D("onepass", "atomic")]
# Candidates per kernel (BLOCK_M, BLOCK_N, warps, stages); the table's entry is timed first. Those whose shared
# memory (tuning.shared_memory_bytes) exceeds the device's are skipped before compiling.
CANDIDATES = {
    "forward": [(128, 64, 8, 3), (128, 32, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3)],
    "forward_lse": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3)],
    "forward_out": [(128, 32, 8, 3), (128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 3), (64, 32, 4, 3)],
    "preprocess": [(128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
    "dk": [(32, 128, 8, 2), (16, 128, 8, 3), (32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3)],
    "dv": [(32, 128, 8, 2), (64, 128, 8, 2), (32, 128, 8, 3), (16, 128, 8, 3)],
    "dkdv": [(32, 64, 8, 3), (16, 128, 8, 3), (32, 128, 8, 2)],
    "dkdq": [(32, 128, 8, 2), (16, 128, 8, 2)],
    "dq": [(128, 32, 8, 3), (128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 3)],
}
CORRECTNESS_TOLERANCE = 2e-2  # bf16 against the fp32 reference, relative RMS (the kernel tests' bf16 bound)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384, help="B·N of the timed problems")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8, help="differential heads H")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 96],
                        help="the first is swept config by config first (d = 96 is the 830m size)")
    parser.add_argument("--versions", nargs="+", choices=["v1", "v2"], default=["v1", "v2"])
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no measurement after this many seconds (default 210; with --smoke 900)")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results"),
                        help="directory of the JSON lines and the report, kernel_tuning_<gpu>_<date>.{jsonl,md} "
                             "(on a lent GPU machine: $OUT, the folder that comes back)")
    parser.add_argument("--smoke", action="store_true", help="toy sizes in the Triton interpreter; writes nothing "
                                                             "to benchmarks/results")
    return parser.parse_args()


class Sweep:
    def __init__(self, args):
        self.args = args
        self.start = time.perf_counter()
        self.on_gpu = torch.cuda.is_available()
        self.device = "cuda" if self.on_gpu else "cpu"
        if self.on_gpu:
            self.device_info = tuning.device_info(torch.device("cuda"))
            self.name = torch.cuda.get_device_name()
        else:
            self.device_info = tuning.DeviceInfo("interpreter", (9, 0), tuning.SHARED_MEMORY_BY_CAPABILITY[(9, 0)])
            self.name = "cpu-interpreter"
        self.out = None  # the JSON lines, set by main
        self.records = []

    def time_left(self):
        return self.args.budget_s - (time.perf_counter() - self.start)

    def emit(self, **record):
        record = dict(record, device=self.name, triton=triton.__version__, torch=torch.__version__,
                      elapsed_s=round(time.perf_counter() - self.start, 1))
        self.records.append(record)
        print(json.dumps(record), flush=True)
        if self.out:
            with open(self.out, "a") as f:
                f.write(json.dumps(record) + "\n")

    # --- problems and plans ------------------------------------------------------------------------------------

    def inputs(self, version, batch, n, head_dim, dtype=torch.bfloat16):
        h = self.args.heads if not self.args.smoke else 2
        g = torch.Generator(device=self.device).manual_seed(0)
        q = torch.randn(batch, n, 2 * h, head_dim, device=self.device, generator=g).to(dtype)
        if version == "v1":
            k = torch.randn(batch, n, 2 * h, head_dim, device=self.device, generator=g).to(dtype)
            v = torch.randn(batch, n, h, 2 * head_dim, device=self.device, generator=g).to(dtype)
            lam = torch.tensor(0.6, device=self.device)
            weight = (1 + 0.1 * torch.randn(2 * head_dim, device=self.device, generator=g)).to(dtype)
            tensors = [q, k, v, lam, weight]
        else:
            k = torch.randn(batch, n, h, head_dim, device=self.device, generator=g).to(dtype)
            v = torch.randn(batch, n, h, head_dim, device=self.device, generator=g).to(dtype)
            lam = torch.sigmoid(torch.randn(batch, n, h, device=self.device, generator=g)).to(dtype)
            tensors = [q, k, v, lam]
        return [t.requires_grad_() for t in tensors]

    def table_plan(self, version, head_dim):
        value_dim = 2 * head_dim if version == "v1" else head_dim
        key = tuning.table_key(self.device_info.capability[0], head_dim, value_dim)
        return Plan(tuning.DEFAULT_DESIGNS[key], self.configs(key))

    def configs(self, key):
        if not self.on_gpu:  # the interpreter: small blocks whatever the table says
            return dict(launch._INTERPRET_CONFIGS)
        return dict(tuning.DEFAULT_CONFIGS[key])

    def previous_plan(self, version, head_dim):
        value_dim = 2 * head_dim if version == "v1" else head_dim
        key = tuning.table_key(9, head_dim, value_dim)
        configs = self.configs(key)
        if self.on_gpu:
            configs.update(tuning.PREVIOUS_HOPPER_CONFIGS[key])
        return Plan(tuning.PREVIOUS_DESIGN, configs)

    def run(self, version, plan, tensors, previous=False):
        """The model's call: V1 with its sub-layer norm and output scale (in PyTorch after the earlier kernels)."""
        if version == "v2":
            return diff_flash_attn_v2(*tensors, plan=plan)
        q, k, v, lam, weight = tensors
        if previous:
            y = diff_flash_attn(q, k, v, lam, plan=plan)
            return torch.nn.functional.rms_norm(y, (y.shape[-1],), weight, 1e-5) * 0.7
        return diff_flash_attn(q, k, v, lam, plan=plan, norm_weight=weight, output_scale=0.7)

    def reference(self, version, tensors):
        ref = [t.detach().float().requires_grad_() for t in tensors]
        if version == "v2":
            return ref, diff_attn_v2_naive(*ref)
        q, k, v, lam, weight = ref
        return ref, diff_attn_naive(q, k, v, lam, norm_weight=weight, output_scale=0.7)

    # --- measurements ------------------------------------------------------------------------------------------

    def check(self, version, head_dim, label, plan, previous=False):
        n = 512 if self.on_gpu else 40
        tensors = self.inputs(version, 1, n, head_dim)
        try:
            out = self.run(version, plan, tensors, previous)
            upstream = torch.randn(out.shape, device=self.device, generator=torch.Generator(
                device=self.device).manual_seed(1))
            grads = torch.autograd.grad(out, tensors, upstream.to(out.dtype))
            ref_inputs, ref_out = self.reference(version, tensors)
            ref_grads = torch.autograd.grad(ref_out, ref_inputs, upstream)
            errors = {"out": rel_rms(out, ref_out)}
            names = ("dq", "dk", "dv", "dlam", "dw")
            errors |= {name: rel_rms(g, r) for name, g, r in zip(names, grads, ref_grads) if name != "dlam"}
            ok = all(e < CORRECTNESS_TOLERANCE for e in errors.values())
            self.emit(step="correctness", version=version, head_dim=head_dim, design=label, n=n, ok=ok,
                      errors={k: float(f"{e:.3g}") for k, e in errors.items()})
        except Exception as err:  # noqa: BLE001 - a design that fails to compile or run is reported and skipped
            ok = False
            self.emit(step="correctness", version=version, head_dim=head_dim, design=label, ok=False,
                      error=f"{type(err).__name__}: {err}"[:500])
        return ok

    def time_plan(self, version, head_dim, plan, previous=False):
        n = self.args.seq_len if self.on_gpu else 64
        batch = max(1, self.args.tokens // n) if self.on_gpu else 1
        tensors = self.inputs(version, batch, n, head_dim)
        upstream = torch.randn(self.run(version, plan, tensors, previous).shape, device=self.device).bfloat16()

        def forward():
            with torch.no_grad():
                self.run(version, plan, tensors, previous)

        def forward_backward():
            torch.autograd.grad(self.run(version, plan, tensors, previous), tensors, upstream)

        forward_backward()  # compiles
        if self.on_gpu:
            fwd = triton.testing.do_bench(forward, return_mode="median")
            both = triton.testing.do_bench(forward_backward, return_mode="median")
        else:
            fwd, both = _cpu_ms(forward), _cpu_ms(forward_backward)
        return dict(n=n, batch=batch, fwd_ms=round(fwd, 4), bwd_ms=round(both - fwd, 4), total_ms=round(both, 4))

    def designs(self, version, head_dim):
        """Steps 1 and 2 for one problem; returns the fastest correct non-atomic plan (label, plan, total_ms)."""
        table = self.table_plan(version, head_dim)
        candidates = [("previous kernels", self.previous_plan(version, head_dim), True), ("table", table, False)]
        for design in V1_DESIGNS if version == "v1" else V2_DESIGNS:
            design = replace(design, split_dims=table.design.split_dims)  # split or padded: d = 96's own question
            if design != table.design:
                candidates.append((str(design), Plan(design, table.configs), False))
        if head_dim == 96:
            candidates.append((str(replace(table.design, split_dims=not table.design.split_dims)),
                               Plan(replace(table.design, split_dims=not table.design.split_dims), table.configs),
                               False))
        best = None
        for label, plan, previous in candidates:
            if self.time_left() <= 0:
                return best
            if not self.check(version, head_dim, label, plan, previous):
                continue
            if self.time_left() <= 0:
                return best
            try:
                timing = self.time_plan(version, head_dim, plan, previous)
            except Exception as err:  # noqa: BLE001
                self.emit(step="design", version=version, head_dim=head_dim, design=label,
                          error=f"{type(err).__name__}: {err}"[:500])
                continue
            self.emit(step="design", version=version, head_dim=head_dim, design=label,
                      design_fields=asdict(plan.design), configs={k: c.as_list() for k, c in plan.configs.items()
                                                                   if k in plan.design.kernels}, **timing)
            if not previous and plan.design.backward != "atomic" and (best is None or timing["total_ms"] < best[2]):
                best = (label, plan, timing["total_ms"])
        return best

    def configs_sweep(self, version, head_dim, best):
        """Step 3: each kernel of the best design, its candidates with the other kernels fixed."""
        label, plan, _ = best
        chosen = dict(plan.configs)
        value_dim = 2 * head_dim if version == "v1" else head_dim
        for kernel in plan.design.kernels:
            problem = tuning.KernelProblem.of(kernel, "bf16", head_dim, value_dim, version == "v2", True, 4096, 4096,
                                              plan.design.split_dims, plan.design.descriptors)
            candidates = [chosen[kernel]] + [BlockConfig(*c) for c in CANDIDATES[kernel]
                                             if BlockConfig(*c) != chosen[kernel]]
            if not self.on_gpu:  # the dry run: one alternative for the first two kernels
                candidates = candidates[:2] if kernel in plan.design.kernels[:2] else candidates[:1]
            timings = []
            for config in candidates:
                if self.time_left() <= 0:
                    return chosen
                if self.on_gpu and tuning.problem_shared_memory(problem, config) > self.device_info.shared_memory:
                    continue
                trial = Plan(plan.design, dict(chosen, **{kernel: config}))
                if config != chosen[kernel] and not self.check(version, head_dim, f"{label} {kernel} {config}", trial):
                    continue
                try:
                    timing = self.time_plan(version, head_dim, trial)
                except Exception as err:  # noqa: BLE001
                    self.emit(step="config", version=version, head_dim=head_dim, design=label, kernel=kernel,
                              config=config.as_list(), error=f"{type(err).__name__}: {err}"[:500])
                    continue
                self.emit(step="config", version=version, head_dim=head_dim, design=label, kernel=kernel,
                          config=config.as_list(), **timing)
                timings.append((timing["total_ms"], len(timings), config))
            if timings:
                chosen[kernel] = min(timings)[2]
        return chosen


def rel_rms(actual, expected):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def _cpu_ms(fn):
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def write_report(sweep, proposals, path):
    lines = [f"# Fused kernel sweep: {sweep.name}, {datetime.date.today().isoformat()}", "",
             f"Command: `python benchmarks/kernel_tuning.py {' '.join(sys.argv[1:])}`; triton {triton.__version__}, "
             f"torch {torch.__version__}; bf16, causal, B·N = {sweep.args.tokens}, H = {sweep.args.heads}. Times are "
             "medians of triton.testing.do_bench; every timed design passed the correctness step first.", "",
             "| step | problem | design | kernel | config | fwd ms | bwd ms | fwd+bwd ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sweep.records:
        if r["step"] == "correctness" or "total_ms" not in r:
            continue
        problem = f"{r['version'].upper()} d={r['head_dim']}"
        lines.append(f"| {r['step']} | {problem} | {r['design']} | {r.get('kernel', '')} | {r.get('config', '')} | "
                     f"{r['fwd_ms']} | {r['bwd_ms']} | {r['total_ms']} |")
    failed = [r for r in sweep.records if r["step"] == "correctness" and not r["ok"]]
    lines += ["", f"Correctness failures: {len(failed)}"] + [f"- {json.dumps(r)}" for r in failed]
    lines += ["", "## Proposed table entries", "", "```python"]
    for (version, head_dim), (design, configs) in proposals.items():
        lines.append(f"# {version.upper()} d={head_dim}: Design{tuple(asdict(design).values())}")
        lines.append("    " + ", ".join(f"{k}={tuple(c.as_list())}" for k, c in configs.items()
                                        if k in design.kernels))
    lines.append("```")
    Path(path).write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


def phases(args):
    """(step, version, head dim) in the order the table needs them: the designs of every problem before the configs
    of any but the first (V1 at the first head dim: the largest model sizes' kernel)."""
    problems = [(version, d) for d in args.head_dims for version in args.versions]
    order = [("designs", *problems[0]), ("configs", *problems[0])]
    order += [("designs", *p) for p in problems[1:]] + [("configs", *p) for p in problems[1:]]
    return order


def main() -> int:
    args = parse_args()
    if args.budget_s is None:
        args.budget_s = 900.0 if args.smoke else 210.0
    sweep = Sweep(args)
    if args.smoke:
        args.head_dims = [16]
    elif not sweep.on_gpu:
        raise SystemExit("error: benchmarks/kernel_tuning.py times GPU kernels and no CUDA device is visible; "
                         "use --smoke for the CPU dry run")
    stamp = f"{sweep.name.replace(' ', '-')}_{datetime.date.today().isoformat()}"
    if not args.smoke:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        sweep.out = str(Path(args.out) / f"kernel_tuning_{stamp}.jsonl")
    proposals, best = {}, {}
    for step, version, head_dim in phases(args):
        if sweep.time_left() <= 0:
            break
        if step == "designs":
            best[(version, head_dim)] = sweep.designs(version, head_dim)
            configs = None
        elif best.get((version, head_dim)) is not None:
            configs = sweep.configs_sweep(version, head_dim, best[(version, head_dim)])
        found = best.get((version, head_dim))
        if found is not None:
            design = found[1].design
            chosen = configs or proposals.get((version, head_dim), (None, found[1].configs))[1]
            proposals[(version, head_dim)] = (design, {k: chosen[k] for k in design.kernels})
    if not args.smoke:
        write_report(sweep, proposals, Path(args.out) / f"kernel_tuning_{stamp}.md")
    print(f"done in {time.perf_counter() - sweep.start:.0f} s ({len(sweep.records)} records)")
    failures = [r for r in sweep.records if r["step"] == "correctness" and not r["ok"] and r["design"] == "table"]
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
