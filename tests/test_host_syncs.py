"""Host reads of device values in a training step: the detector (training.host_reads) finds each kind on the CPU, a
step that does not log reads only its loss (which the bad-step guard needs), and the gradient norm kept on the device
and clipped there trains bit for bit as megatron-core's own, which reads it to the host."""

import inspect
import logging
import math
import os

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from diff_transformer.config import register_configs, to_object
from diff_transformer.training.host_reads import HOST_SIDE, HostReads
from tests.train_runs import REPO

register_configs()


def test_the_detector_finds_each_kind_of_host_read_at_its_line():
    x = torch.arange(4.0)
    total = x.sum()
    first = inspect.currentframe().f_lineno + 2
    with HostReads() as reads:
        total.item(); x.tolist(); bool(total); float(total); int(total)  # noqa: E702
        x.numpy(); np.asarray(x); x.cpu(); x.to("cpu"); f"{total:.1f}"  # noqa: E702
        torch.nonzero(x); x[x > 1]; torch.tensor([1.0, 2.0], device="cpu")  # noqa: E702
        if total:
            pass
    here = "test_host_syncs.py:"
    assert [(what, os.path.basename(where)) for what, where in reads.reads] == [
        ("item", f"{here}{first}"), ("tolist", f"{here}{first}"), ("__bool__", f"{here}{first}"),
        ("__float__", f"{here}{first}"), ("__int__", f"{here}{first}"),
        ("numpy", f"{here}{first + 1}"), ("__array__", f"{here}{first + 1}"), ("cpu", f"{here}{first + 1}"),
        ("to", f"{here}{first + 1}"), ("__format__", f"{here}{first + 1}"),
        ("aten::nonzero", f"{here}{first + 2}"), ("aten::index", f"{here}{first + 2}"),
        ("tensor(device=)", f"{here}{first + 2}"), ("__bool__", f"{here}{first + 3}"),
    ], str(reads)


def test_the_detector_finds_nothing_in_code_that_keeps_values_on_the_device():
    weight = torch.randn(8, 8, requires_grad=True)
    with HostReads() as reads:
        x = torch.randn(4, 8)
        loss = torch.nn.functional.cross_entropy(x @ weight, torch.arange(4))
        loss.backward()
        norm = torch.linalg.vector_norm(weight.grad)
        coeff = torch.where(norm < 1.0, norm, torch.ones_like(norm))
        torch._foreach_mul_([weight.grad], coeff)
        x.to(torch.float64)
        x.to("cpu", non_blocking=True)  # a copy into pinned memory does not wait
        torch.zeros(3, device="cpu")
        torch.tensor(0, dtype=torch.int)  # a host scalar: no copy
        x.to(x.device)
    assert reads.reads == [], str(reads)


# ------------------------------------------------------------------------------------------------------------------
# A training step (in process, a world of one)
# ------------------------------------------------------------------------------------------------------------------
STEPS, LOG_INTERVAL, CLIP, NAN_STEP = 6, 3, 2.0, 4
RUN = ["experiment=smoke", "trainer.fusions=on", f"trainer.max_steps={STEPS}", f"trainer.log_interval={LOG_INTERVAL}",
       "trainer.eval_interval=0", "trainer.micro_batch_size=2", "trainer.global_batch_size=4", "optim.lr=3e-2",
       "optim.warmup_steps=1", f"optim.clip_grad={CLIP}", "checkpoint.interval=0", "checkpoint.save_at_end=false",
       "checkpoint.check_free_space=false", f"failures.inject_nan_at_steps=[{NAN_STEP}]", "logging.wandb.mode=disabled",
       "logging.level=WARNING"]
# torch's foreach Adam, which a CPU runs, reads its step counts (host tensors); the fused AdamW of a GPU reads none
CPU_ADAM = "torch/optim/"
PER_STEP = ("_train_and_measure", "_log_step", "_stop_if_diverged", "_save_on_interval")


def train_watched(run_dir):
    """Train RUN in this process; returns (the trainer, its records, {step: the host reads of its loop iteration})."""
    from diff_transformer.training.failures import PreemptionSignals
    from diff_transformer.training.trainer import Trainer

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = to_object(compose("config", overrides=RUN))
    trainer = Trainer(cfg, str(run_dir))
    trainer.setup()
    reads = {}

    def watched(name, method):
        def run(*args, **kwargs):
            step = trainer.step + (name == "_train_and_measure")  # the step this iteration trains
            with HostReads(host_side=HOST_SIDE + (CPU_ADAM,)) as found:
                result = method(*args, **kwargs)
            reads.setdefault(step, []).extend(found.reads)
            return result
        return run

    for name in PER_STEP:
        setattr(trainer, name, watched(name, getattr(trainer, name)))
    agreed = PreemptionSignals.agreed
    PreemptionSignals.agreed = watched("agreed", agreed)
    try:
        records = trainer.fit()
    finally:
        PreemptionSignals.agreed = agreed
        for handler in list(logging.getLogger().handlers):  # the run's console and train.log, which setup added
            logging.getLogger().removeHandler(handler)
            handler.close()
    return trainer, records, reads


def trained_state(trainer):
    """Every parameter and optimizer-state tensor, by name."""
    state = {f"param {name}": p.detach().clone() for name, p in trainer.model[0].named_parameters()}
    for i, inner in enumerate(trainer.optimizer.chained_optimizers):
        for j, (param, values) in enumerate(inner.optimizer.state.items()):
            state.update({f"optimizer {i} {j} {key}": v.clone() for key, v in values.items() if torch.is_tensor(v)})
    return state


@pytest.fixture(scope="module")
def runs(tmp_path_factory, megatron_single_process):
    """RUN trained twice from the same seed: the gradient norm on the device (what training does), and megatron-core's
    own norm and clipping, which read it on the host."""
    from diff_transformer import compat

    device = train_watched(tmp_path_factory.mktemp("device") / "run")
    device = device[1], device[2], trained_state(device[0])
    with compat.grad_norm_read_on_the_host():
        host = train_watched(tmp_path_factory.mktemp("host") / "run")
    host = host[1], host[2], trained_state(host[0])
    return device, host


def test_a_step_that_does_not_log_reads_only_its_loss(runs):
    """Each step's one host read is its loss, read by train_step for the bad-step guard; on logging steps the records
    kept since the last are written with the gradient norms read in one go."""
    from diff_transformer.training.trainer import Trainer

    (records, reads, _), _ = runs
    assert sorted(reads) == list(range(1, STEPS + 1))
    lines, first = inspect.getsourcelines(Trainer.train_step)
    in_train_step = [os.path.join("diff_transformer", "training", f"trainer.py:{first + i}") for i in range(len(lines))]
    for step in (2, 4, 5):  # not logging steps (the first moves RoPE's frequencies to the device once)
        assert len(reads[step]) == 1, (step, reads[step])
        assert reads[step][0][0] == "__float__" and reads[step][0][1].endswith(tuple(in_train_step)), reads[step]
    assert all(reads[2][0] in reads[step] for step in reads), reads
    for step in (3, 6):  # the gradient norms of the steps since the last logging step: one read
        norm_reads = [r for r in reads[step] if r[0] == "tolist" and "trainer.py" in r[1]]
        assert len(norm_reads) == 1, reads[step]
    assert all(isinstance(r["grad_norm"], float) or r["grad_norm"] is None for r in records)


def test_the_gradient_norm_on_the_device_trains_bit_for_bit_as_megatron_core(runs):
    (device, _, device_state), (host, host_reads, host_state) = runs
    assert [r["step"] for r in device] == list(range(1, STEPS + 1))
    for key in ("loss", "skipped", "skipped_steps", "lr"):
        got, want = [r[key] for r in device], [r[key] for r in host]
        assert repr(got) == repr(want), key  # repr: NaN equal to NaN, None to None, floats bit for bit
    # the norm's square root: correctly rounded on the device; the host's pow(x, 0.5) is an ulp off for ~0.07% of x
    assert [r["grad_norm"] is None for r in device] == [r["grad_norm"] is None for r in host]
    assert all(abs(d["grad_norm"] - h["grad_norm"]) <= math.ulp(h["grad_norm"])
               for d, h in zip(device, host) if h["grad_norm"] is not None), (device, host)
    assert [r["skipped"] for r in device] == [s == NAN_STEP for s in range(1, STEPS + 1)]
    norms = [r["grad_norm"] for r in device if r["grad_norm"] is not None]
    assert min(norms) < CLIP < max(norms), norms  # steps clipped and steps not: both paths compared
    assert math.isnan(device[NAN_STEP - 1]["loss"]) and device[NAN_STEP - 1]["grad_norm"] is None
    assert device_state.keys() == host_state.keys() and len(device_state) > 10
    assert [k for k in device_state if not torch.equal(device_state[k], host_state[k])] == []
    # the reference read the norm on the host, in megatron-core: it is the old path
    assert any(what == "item" and "clip_grads.py:133" in where for what, where in host_reads[2]), host_reads[2]

