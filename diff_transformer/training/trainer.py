"""The training loop on megatron-core: model, DDP, optimizer, schedules, validation, metrics, checkpoints.

The same code runs single-process on a CPU, on several CPU processes over gloo, and on GPU clusters over NCCL.
Process groups and every small collective go through ``distributed``; checkpoints through ``checkpoint``; signals
and bad steps through ``failures``; logging through ``metrics``; FLOPs and memory through ``accounting``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import time
from functools import partial
from typing import Any, Dict, Iterator, List, Optional

import torch
from omegaconf import OmegaConf

from diff_transformer import compat
from diff_transformer.config import cooldown_steps, padded_vocab_size, validate
from diff_transformer.fileio import atomic_write_json, atomic_write_text
from diff_transformer.models.gpt import (
    FUSED_ATTENTION_BACKENDS,
    attention_parameters_per_layer,
    build_model_chunk,
    compile_layers,
    core_attention_in_graph,
    count_parameters,
    dex_parameters,
    epilogue_impl,
    freeze_all_but_dex,
    fusions_summary,
    gradient_accumulation_fusion_enabled,
    lambda_values,
    parameter_numel,
    resolve_precision,
    set_dex_anneal,
    v2_baseline,
)
from diff_transformer.models.weight_gradient import fuse_weight_gradients_in_graphs, unfuse_weight_gradients
from diff_transformer.models.attention.diff_v2 import record_lambda, recorded_lambda_sums
from diff_transformer.figure_style import variant_name
from diff_transformer.models.layer_specs import variant_label
from diff_transformer import distributed
from diff_transformer.training.accounting import (
    attention_keys_per_token,
    check_memory_plan,
    choose_context_parallel,
    embedding_share_warning,
    estimate_memory_per_gpu,
    memory_gib,
    model_flops_per_token,
    peak_flops_per_device,
)
from diff_transformer.training.checkpoint import (
    DAMAGED_SUFFIX,
    LATEST_FILE,
    CheckpointManager,
    check_model_compatible,
    check_resumable,
    check_tokenizer_unchanged,
    check_weights_compatible,
    check_weights_loadable,
    checkpoint_bytes,
    checkpoints_dir,
    config_changes,
    ensure_free_space,
    estimate_checkpoint_bytes,
    move_aside,
    read_trainer_state,
    remove_partial_saves,
    require_verified,
    rerun_advice,
    resolve_checkpoint_path,
    select_resume_checkpoint,
)
from diff_transformer.distributed import world_size_from_env
from diff_transformer.training import cuda_graphs
from diff_transformer.training.branching import BranchSource, resolve_branch
from diff_transformer.training.diagnostics import AttentionDiagnostics, diagnostics_enabled, estimated_cost_fraction
from diff_transformer.training.failures import (
    BadStepGuard,
    PreemptionSignals,
    TrainingDiverged,
    grace_period_seconds,
    poison_gradients,
    requeue_current_job,
)
from diff_transformer.training.metrics import (
    PROGRESS_WINDOW_STEPS, MetricsWriter, RunLogFailed, init_wandb, setup_console_logging, start_run_log,
)
from diff_transformer.training.profiling import StepProfiler
from diff_transformer.training.run_directory import (
    check_resume_is_this_runs, check_start, move_old_run_aside, write_launch_record,
)
from diff_transformer.training.steps import forward_step

logger = logging.getLogger("diff_transformer")
MOST_DATA_LINES = 3  # blend entries the start-up summary names one by one


# ------------------------------------------------------------------------------------------------------------------
# Trainer
# ------------------------------------------------------------------------------------------------------------------
class Trainer:
    """Holds everything a run needs; ``fit`` trains to ``trainer.max_steps``."""

    def __init__(self, cfg: Any, run_dir: str):
        self.cfg = cfg
        self.run_dir = run_dir
        self.step = 0
        self.consumed_samples = 0
        self.skipped_steps = 0
        self.wandb_run_id: Optional[str] = None
        self.resumed_from: Optional[str] = None
        self.bad_steps = BadStepGuard(cfg.failures)
        self.stopped_by_signal = False  # fit returned early after saving on a signal: the run is resumable
        self.requeued = False  # ... and under SLURM the job requeued itself
        self._old_run = None  # a run this fresh start moves aside (overwrite_run=true)
        self._damaged_checkpoints: List[Any] = []  # (path, why) skipped by checkpoint.resume=auto
        self._backend_decision: Optional[Dict[str, Any]] = None  # model.attention_backend=auto's, to record
        self.launch_record: Dict[str, str] = {}  # Hydra's record of this launch (.hydra/), written at the commit
        self.sweep: Optional[Dict[str, str]] = None  # {"id", "dir"} of the sweep this run belongs to (train.py sets it)
        self.branch: Optional[BranchSource] = None  # checkpoint.branch_from's source, read only
        self.tokenizer = None  # the run's tokenizer, once setup has prepared the data
        self.compiled_layers = 0  # trainer.compile: this rank's layers under torch.compile
        self.attention_in_graph = 0  # of them, those whose core attention is in the layer's graph
        self._first_step_done = False  # the first step of this process (which compiles them) has been logged
        self._metrics: Optional[MetricsWriter] = None  # fit's metrics.jsonl writer
        # (record, wall time) of the steps since the last logging step: written, their device values read in one go,
        # at the next logging step, before a checkpoint, and at the end (_write_records)
        self._unwritten: List[Any] = []
        self.cuda_graphs = cuda_graphs.cuda_graphs_on(cfg)  # trainer.cuda_graphs: the compiled layers as CUDA graphs
        self.graph_fused_linears = 0  # ... whose linear layers accumulate into main_grad inside the graph
        self.unfused_linears = 0  # ... whose linear layers then leave the weight-gradient accumulation to DDP's hook
        self._graph_skips: Optional[cuda_graphs.SkipReasons] = None  # inductor's skip warnings, collected
        self._graph_reported: Optional[int] = None  # ... of which the log has told this many (None: not reported yet)
        self._graphs_at_report: Optional[int] = None  # CUDA graphs recorded when the log last said

    # -- setup -------------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        from data.datasets import build_datasets, check_vocab, load_tokenizer, prepare

        cfg = self.cfg
        world = world_size_from_env()
        validate(cfg, world)
        cfg.data.validate()
        prepared = prepare(cfg.data)  # before any process group: a clear error costs nothing
        self.tokenizer = load_tokenizer(prepared.tokenizer_dir)
        vocab = cfg.model.vocab_size or self.tokenizer.vocab_size
        check_vocab(vocab, self.tokenizer)
        self.dtype = resolve_precision(cfg.trainer.precision)
        if self.dtype == torch.bfloat16 and not torch.cuda.is_available():
            raise ValueError("trainer.precision=bf16 needs a GPU; use fp32 (or auto) on CPU")
        self.padded_vocab = padded_vocab_size(vocab, cfg.model.make_vocab_size_divisible_by, cfg.parallel.tp)
        if cfg.parallel.cp is None:  # parallel.cp=null: the smallest context parallelism whose estimate fits
            cfg.parallel.cp = choose_context_parallel(cfg, self.dtype, world, self.padded_vocab)
            validate(cfg, world)
        check_memory_plan(cfg, self.dtype, world, self.padded_vocab)  # refuses a launch that cannot fit
        self._check_engine_support()

        distributed.init_distributed(cfg.parallel.backend, cfg.parallel.tp, cfg.parallel.pp, cfg.seed, cfg.parallel.cp)
        from megatron.core import parallel_state

        self.rank = torch.distributed.get_rank()
        self._agree_on_run_dir()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.is_last_stage = parallel_state.is_pipeline_last_stage()
        # the log reaches train.log only once every start-up check has passed (nothing in the run directory
        # changes before): _commit_start
        setup_console_logging(self.run_dir, self.rank, cfg.logging.level, hold_file=True)

        gbs, mbs = cfg.trainer.global_batch_size, cfg.trainer.micro_batch_size
        self.num_microbatches = gbs // (mbs * self.dp_size)
        self.tokens_per_step = gbs * cfg.model.seq_length
        t = cfg.trainer
        self.branch = resolve_branch(cfg, self.run_dir)
        # a branch sizes its data like its source, whose sample order (and validation samples) it then shares
        data_steps = max(t.max_steps, self.branch.max_steps) if self.branch else t.max_steps
        eval_runs = (data_steps // t.eval_interval + 1) if t.eval_interval > 0 else 0
        self.train_ds, self.valid_ds, _ = build_datasets(
            prepared,
            self.tokenizer,
            seq_length=cfg.model.seq_length,
            seed=cfg.seed,
            train_samples=data_steps * gbs,
            valid_samples=max(eval_runs * t.eval_iters * gbs, 1),
            split=cfg.data.split,
            index_cache_dir=cfg.data.index_cache_dir,
            eod_mask_loss=cfg.data.eod_mask_loss,
            document_mask=cfg.data.document_mask,
            reset_position_ids=cfg.data.reset_position_ids,
        )
        self.prepared = prepared
        if cfg.model.attention == "dex":
            self._resolve_dex_heads()
        self._resolve_attention_backend()
        self.model = [self._build_model()]
        self.optimizer, self.scheduler = self._build_optimizer()
        self._log_setup()
        self._setup_checkpoints()

    def _check_engine_support(self) -> None:
        """Refuse (ValueError) what the installed engine cannot run here, before any process group starts; megatron-core
        itself is checked by ``compat``."""

    def _agree_on_run_dir(self) -> None:
        """Every rank uses rank 0's run directory (time-stamped default directories can differ by a second). Rank 0
        writes nothing there before every start-up check has passed (:meth:`_commit_start`)."""
        own = self.run_dir
        self.run_dir = distributed.broadcast_object(own, src=0)
        if self.rank != 0 and os.path.realpath(own) != os.path.realpath(self.run_dir):
            shutil.rmtree(own, ignore_errors=True)  # holds only Hydra's copy of the same config

    def _save_resolved_config(self) -> None:
        OmegaConf.save(OmegaConf.structured(self.cfg), os.path.join(self.run_dir, "config.yaml"))

    def _resolve_dex_heads(self) -> None:
        """DEX: choose the heads that get W_D (calibration, all, none, or the checkpoint a resumed run continues)
        before the model is built, and record the choice in config.yaml."""
        from diff_transformer.training.dex import resolve_dex_heads

        how = resolve_dex_heads(self, self._agreed_resume_candidate())
        if self.rank == 0:  # recorded in config.yaml by _commit_start
            logger.info("DEX heads per layer (from %s): %s", how, self.cfg.model.dex.heads)

    def _resolve_attention_backend(self) -> None:
        """model.attention_backend=auto: rank 0 decides (the resumed checkpoint's, the run directory's record, the
        kind's only candidate, or the fastest for this shape on this GPU or CPU: ``training.backend_choice``), every rank builds with it, and the
        config says the concrete backend from here on (the checkpoints record it)."""
        from diff_transformer.training.backend_choice import decide_attention_backend, describe

        if self.cfg.model.attention_backend != "auto":
            return
        resume = self._agreed_resume_candidate()
        decision = None
        if self.rank == 0:  # recorded in the run directory by _commit_start
            saved = read_trainer_state(resume)["config"] if resume else None
            decision = decide_attention_backend(
                self.cfg, self.run_dir, self.dtype, epilogue_impl(self.cfg), saved, record=False,
                document_ids=self._first_document_ids(),
            )
            self._backend_decision = decision
        decision = distributed.broadcast_object(decision, src=0)
        self.cfg.model.attention_backend = decision["backend"]
        if self.rank == 0:
            logger.info("model.attention_backend=auto: %s", describe(decision))

    def _first_document_ids(self) -> Optional[torch.Tensor]:
        """The document ids of the first training micro-batch (data.document_mask), None without the mask."""
        if not self.cfg.data.document_mask:
            return None
        count = min(self.cfg.trainer.micro_batch_size, len(self.train_ds))
        return torch.stack([self.train_ds[i]["document_ids"] for i in range(count)])

    def _agreed_resume_candidate(self) -> Optional[str]:
        """:meth:`_resume_candidate` of the run's checkpoint directory (else a branch's source checkpoint), decided by
        rank 0 for every rank (collective); a refusal (a damaged checkpoint named by checkpoint.resume) raises on
        every rank."""
        resume, error = None, None
        if self.rank == 0:
            try:
                resume = self._resume_candidate(checkpoints_dir(self.cfg, self.run_dir))
            except ValueError as err:
                error = str(err)
        resume, error = distributed.broadcast_object((resume, error), src=0)
        if error:
            raise ValueError(error)
        return resume or (self.branch.checkpoint if self.branch else None)

    def _build_model(self):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        p = self.cfg.parallel
        fused = gradient_accumulation_fusion_enabled(self.cfg)
        chunk = build_model_chunk(self.cfg, self.padded_vocab, self.dtype, grad_accumulation_fusion=fused)
        if self.cfg.model.attention == "dex" and not self.cfg.model.dex.train_base:
            freeze_all_but_dex(chunk)  # before DDP and the optimizer, which then hold only the trainable ones
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        # megatron's fused accumulation writes main_grad from Python, which would break a compiled layer's graph at
        # each linear layer: at TP=1 it goes through a torch operator that declares the write, else it is left to
        # DDP's hook (decided by the config, so a run without TorchDynamo computes as one with it)
        if fused and self.cfg.trainer.compile:
            if self.cuda_graphs or p.tp > 1:
                self.unfused_linears = unfuse_weight_gradients(chunk)
            else:
                self.graph_fused_linears = fuse_weight_gradients_in_graphs(chunk)
        if self.cfg.trainer.compile:  # before DDP, whose hooks then see the compiled layers as any module
            self.compiled_layers = compile_layers(chunk, document_mask=self.cfg.data.document_mask,
                                                  mode=cuda_graphs.CUDA_GRAPH_MODE if self.cuda_graphs else None)
            self.attention_in_graph = core_attention_in_graph(chunk)
            if self.cuda_graphs and self.attention_in_graph != self.compiled_layers:
                raise ValueError(
                    f"trainer.cuda_graphs={self.cfg.trainer.cuda_graphs} needs each compiled layer's core attention "
                    f"in its graph, but model.attention_backend={self.cfg.model.attention_backend} runs it eagerly in "
                    f"{self.compiled_layers - self.attention_in_graph} of {self.compiled_layers} layers; use "
                    "model.attention_backend=sdpa or set trainer.cuda_graphs=off")
        if self.cuda_graphs:
            self._graph_skips = cuda_graphs.SkipReasons().attach()
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=p.overlap_grad_reduce,
            overlap_param_gather=p.overlap_param_gather,
            use_distributed_optimizer=p.distributed_optimizer,
            bucket_size=p.ddp_bucket_size,
        )
        model = DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk)
        # megatron-core's schedules call these (its training loop's conventions): with overlapped reduction,
        # gradients of all but the last micro-batch accumulate without communication, and the last micro-batch's
        # backward hooks start each bucket's reduction as soon as its gradients are ready (the pipeline schedules
        # start any remaining ones through grad_sync_func); finalize_model_grads waits for them. The parameter
        # all-gather of overlap_param_gather is started by forward pre-hooks that DDP registers itself.
        if p.overlap_grad_reduce:
            chunk.config.no_sync_func = model.no_sync
            chunk.config.grad_sync_func = model.start_grad_sync
        return model

    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o = self.cfg.optim
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.beta1,
            adam_beta2=o.beta2,
            adam_eps=o.eps,
            clip_grad=o.clip_grad,
            bf16=self.dtype == torch.bfloat16,
            params_dtype=self.dtype,
            use_distributed_optimizer=self.cfg.parallel.distributed_optimizer,
            overlap_param_gather=self.cfg.parallel.overlap_param_gather,
        )
        optimizer = get_megatron_optimizer(opt_config, self.model)
        if torch.cuda.is_available():
            compat.fuse_torch_adamw(optimizer)  # torch's fused AdamW: one kernel per group, not foreach's several
        return optimizer, self._lr_scheduler(optimizer)

    def _lr_scheduler(self, optimizer):
        """megatron-core's LR and weight-decay schedule over ``optimizer`` (both engines step the same one)."""
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o, t = self.cfg.optim, self.cfg.trainer
        # wsd: megatron-core's WSD with the (1 - sqrt) cooldown of Hägele et al. 2024 over the last cooldown steps
        wsd = {"lr_decay_style": "WSD", "wsd_decay_steps": cooldown_steps(o, t.max_steps),
               "lr_wsd_decay_style": "minus_sqrt"} if o.decay == "wsd" else {"lr_decay_style": o.decay}
        # a resumed run's schedule is the config's, continued at the checkpoint's step (megatron's
        # --override-opt_param-scheduler): extending trainer.max_steps or changing optim.lr takes effect
        return OptimizerParamScheduler(
            optimizer,
            init_lr=0.0,
            max_lr=o.lr,
            min_lr=o.min_lr,
            lr_warmup_steps=o.warmup_steps,
            lr_decay_steps=t.max_steps,
            **wsd,  # linear | cosine | constant (validated) are megatron-core's names
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=t.max_steps,
            wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=False,
            override_opt_param_scheduler=True,
        )

    def _count_parameters(self, chunks) -> None:
        """``num_parameters`` and ``num_non_embedding_parameters`` of the whole model, from this rank's ``chunks``
        (collective over the model-parallel group)."""
        from megatron.core import parallel_state

        cfg = self.cfg
        params_rank = count_parameters(chunks)
        totals = [params_rank, count_parameters(chunks, exclude_embeddings=True)]
        if self.is_last_stage and cfg.model.share_embeddings and not parallel_state.is_pipeline_first_stage():
            # the last stage's copy of the tied embedding is the same parameter as the first stage's
            totals[0] -= self.padded_vocab // cfg.parallel.tp * cfg.model.hidden_size
        # sum over the model-parallel group (TP shards and PP stages) of data-parallel rank 0
        totals = distributed.all_reduce_values(totals, group=parallel_state.get_model_parallel_group())
        # parameters that are not split over TP ranks (norm weights, λ, the other kinds' small parameters) are
        # replicated on every rank: count them once
        replicated = sum(
            parameter_numel(p) for p in chunks[0].parameters() if not getattr(p, "tensor_model_parallel", False)
        )
        (replicated,) = distributed.all_reduce_values(
            [replicated], group=parallel_state.get_pipeline_model_parallel_group()
        )
        self.num_parameters = int(totals[0] - replicated * (cfg.parallel.tp - 1))
        self.num_non_embedding_parameters = int(totals[1] - replicated * (cfg.parallel.tp - 1))

    def _log_setup(self) -> None:
        cfg = self.cfg
        if not hasattr(self, "num_parameters"):
            self._count_parameters(self.model)
        mem = estimate_memory_per_gpu(cfg, self.dtype, torch.distributed.get_world_size(), self.padded_vocab)
        if self.rank != 0:
            return
        # the console gets a summary; the whole resolved config is the run directory's config.yaml
        logger.info("config: %s (resolved)", os.path.join(self.run_dir, "config.yaml"))
        logger.info(
            "model %s %s (attention backend %s, fusions %s): %s parameters (%s without embeddings), vocab %d "
            "(padded %d)",
            cfg.model.name, variant_name(variant_label(cfg.model)), cfg.model.attention_backend,
            fusions_summary(cfg),
            f"{self.num_parameters:,}", f"{self.num_non_embedding_parameters:,}",
            self.tokenizer.vocab_size, self.padded_vocab,
        )
        embeddings = embedding_share_warning(self.num_parameters, self.num_non_embedding_parameters,
                                             self.tokenizer.vocab_size, cfg.model.hidden_size)
        if embeddings:
            logger.warning("warning: %s", embeddings)
        self._log_epochs()
        if cfg.model.attention == "diff_v2":
            self._log_v2_baseline()
        if cfg.model.attention == "dex":
            logger.info(
                "DEX: %s W_D parameters on %d heads, λ annealed over %s steps (%s); %s",
                f"{dex_parameters(cfg.model):,}", sum(len(h) for h in cfg.model.dex.heads),
                cfg.model.dex.lambda_anneal_steps if cfg.model.dex.lambda_anneal_steps is not None else cfg.trainer.max_steps,
                cfg.model.dex.lambda_anneal,
                "the whole model trains" if cfg.model.dex.train_base else "only W_D and λ train (model.dex.train_base=false)",
            )
        logger.info(
            "layout: tp=%d pp=%d dp=%d%s, %d micro-batches of %d per step, %s tokens per step, dtype %s",
            cfg.parallel.tp, cfg.parallel.pp, self.dp_size, f" cp={cfg.parallel.cp}" if cfg.parallel.cp > 1 else "",
            self.num_microbatches, cfg.trainer.micro_batch_size,
            f"{self.tokens_per_step:,}", str(self.dtype).replace("torch.", ""),
        )
        logger.info(
            "estimated memory per GPU: %.2f GiB (weights %.2f, grads %.2f, optimizer %.2f, activations %.2f, "
            "logits %.2f)%s; %s",
            mem["total"], mem["weights"], mem["grads"], mem["optimizer"], mem["activations"], mem["logits"],
            f"; on the host {mem['host']:.2f} GiB (offloaded)" if mem.get("host") else "",
            self._memory_switches_line(),
        )
        if cfg.trainer.compile:
            self._log_compile()
        if cfg.trainer.recompute == "selective" and cfg.model.attention_backend in FUSED_ATTENTION_BACKENDS:
            logger.info(
                "trainer.recompute=selective: nothing to recompute with model.attention_backend=%s, whose kernel "
                "keeps no attention map and recomputes it in its own backward", cfg.model.attention_backend,
            )

    def _log_compile(self) -> None:
        if not self.compiled_layers:
            logger.warning("warning: trainer.compile=true, but TorchDynamo is off in this process "
                           "(TORCHDYNAMO_DISABLE=1 or TORCH_COMPILE_DISABLE=1): the layers run eagerly")
            return
        layers = f"{self.compiled_layers} layer{'s' if self.compiled_layers != 1 else ''}"
        if self.cuda_graphs:
            logger.info("trainer.cuda_graphs=%s: the compiled layers as CUDA graphs (torch.compile mode %s), "
                        "recorded at the second micro-batch", self.cfg.trainer.cuda_graphs, cuda_graphs.CUDA_GRAPH_MODE)
        if self.graph_fused_linears:
            logger.info("trainer.compile: the compiled layers' %d linear layers accumulate their weight gradients into "
                        "main_grad inside the graph (trainer.grad_accumulation_fusion)", self.graph_fused_linears)
        if self.unfused_linears:
            logger.info("trainer.compile: the compiled layers' %d linear layers leave their weight gradients to DDP's "
                        "hook (the fused accumulation's main_grad write would break each graph at them); the output "
                        "layer keeps the fusion", self.unfused_linears)
        if self.attention_in_graph == self.compiled_layers:
            where = "the core attention in the graph"
        elif self.attention_in_graph == 0:
            where = "the core attention eager"
        else:
            where = f"the core attention in the graph in {self.attention_in_graph} of them, eager in the others"
        logger.info("trainer.compile: %s of this rank under torch.compile (%s; evaluation eager); the first step "
                    "compiles them", layers, where)

    def _report_cuda_graphs(self) -> None:
        """trainer.cuda_graphs: once they are recorded (step 1 with two micro-batches or more, else step 2, or the last
        step), one line of what torch recorded and skipped, with inductor's warnings; later, any new warning (a layer
        re-recorded too often) in a line of its own, and at the last step the line again if the count changed."""
        skips = self._graph_skips
        if skips is None or self.rank != 0:
            return
        last = self.step == self.cfg.trainer.max_steps
        first = self._graph_reported is None
        new = skips.messages[self._graph_reported or 0:] if not first else []
        for message in new:
            logger.warning("warning: trainer.cuda_graphs: at step %d inductor said: %s", self.step, message)
        if first and not (self.step >= (1 if self.num_microbatches >= 2 else 2) or last):
            return
        self._graph_reported = len(skips.messages)
        recorded = cuda_graphs.recorded_graphs()
        if not first and not (last and recorded != self._graphs_at_report):
            return
        self._graphs_at_report = recorded
        logger.info("trainer.cuda_graphs=%s: %s", self.cfg.trainer.cuda_graphs,
                    cuda_graphs.report(self.compiled_layers, self.step, skips.reasons, cuda_graphs.skipped_graphs(),
                                       recorded, on_cuda=torch.cuda.is_available()))
        for message in skips.messages[:cuda_graphs.MOST_REASONS] if first else []:  # whole, with torch's stack trace
            logger.info("trainer.cuda_graphs: inductor said: %s", message)

    def _log_epochs(self) -> None:
        """How many passes over each blend entry's train split the planned steps make; a warning above a few."""
        from data.inspect import epochs_lines, summarise_blend

        t = self.cfg.trainer
        summaries = summarise_blend(self.prepared.prefixes, self.prepared.weights, self.cfg.data.split)
        lines, warnings = epochs_lines(summaries, t.max_steps * self.tokens_per_step)
        shown = lines if len(lines) <= MOST_DATA_LINES else lines[:MOST_DATA_LINES - 1]
        for line in shown:
            logger.info("data: %s", line)
        if len(shown) < len(lines):  # a long blend: the start-up summary stays short
            logger.info("data: and %d more blend entries (python -m data.inspect --config %s)", len(lines) - len(shown),
                        os.path.join(self.run_dir, "config.yaml"))
        for warning in warnings:
            logger.warning("warning: %s", warning)

    def _memory_switches_line(self) -> str:
        p, t = self.cfg.parallel, self.cfg.trainer
        recompute = t.recompute
        if recompute == "full":
            recompute += f" ({t.recompute_method}, {t.recompute_layers or 'default'} layers)"
        return (
            f"recompute {recompute}, sequence parallel {'on' if p.sequence_parallel else 'off'}, distributed "
            f"optimizer {'on' if p.distributed_optimizer else 'off'}, overlapped grad reduce "
            f"{'on' if p.overlap_grad_reduce else 'off'}, param gather {'on' if p.overlap_param_gather else 'off'}"
        )

    def _log_v2_baseline(self) -> None:
        """DIFF V2's parameter count next to the Transformer it is compared with (same hidden size and KV heads)."""
        model = self.cfg.model
        baseline, overrides = v2_baseline(model)
        if baseline is None:
            logger.info("DIFF V2 baseline: %s", overrides)
            return
        delta = model.num_layers * (attention_parameters_per_layer(baseline) - attention_parameters_per_layer(model))
        logger.info(
            "DIFF V2 baseline (%s): %s parameters (%s without embeddings); DIFF V2: %s",
            overrides, f"{self.num_parameters + delta:,}", f"{self.num_non_embedding_parameters + delta:,}",
            f"{self.num_parameters:,}",
        )

    # -- checkpoints -------------------------------------------------------------------------------------------------
    def _setup_checkpoints(self) -> None:
        """Find what to resume (rank 0 decides, every rank follows), check the disk, and load."""
        self.checkpoints = self._checkpoint_manager(checkpoints_dir(self.cfg, self.run_dir))
        resume, weights = self._decide_checkpoint()
        if resume:
            saved = self._restore_training_state(resume)
            self.bad_steps.consecutive = saved.get("bad_steps_in_a_row", 0)
            self.wandb_run_id = saved.get("wandb_run_id")
            self.resumed_from = resume
            if self.rank == 0:
                logger.info("resumed from %s at step %d (%d samples consumed)", resume, self.step, self.consumed_samples)
                self._log_config_changes(saved)
        elif weights:
            self.checkpoints.load(weights, weights_only=True)
            if self.rank == 0:
                logger.info("started from the weights of %s", weights)
        elif self.branch is not None:
            self._start_branch()

    def _start_branch(self) -> None:
        """Model, optimizer, schedule position, data position and RNG from the source's checkpoint (only read); the
        W&B run, metrics and checkpoints are this run's own."""
        self._restore_training_state(self.branch.checkpoint)
        if self.rank == 0:
            logger.info("cooldown branch from %s at step %d (%d samples consumed): cools down over the last %d of "
                        "trainer.max_steps=%d", self.branch.checkpoint, self.step, self.consumed_samples,
                        cooldown_steps(self.cfg.optim, self.cfg.trainer.max_steps), self.cfg.trainer.max_steps)

    def _restore_training_state(self, path: str) -> Dict[str, Any]:
        """Load checkpoint ``path`` and continue from it: step, samples consumed, skipped steps, the recent losses the
        bad-step guard compares with, then the config's optimizer settings. Returns the saved trainer state."""
        saved = self.checkpoints.load(path)
        self.step, self.consumed_samples = saved["step"], saved["consumed_samples"]
        self.skipped_steps = saved.get("skipped_steps", 0)
        self.bad_steps.recent.extend(saved.get("recent_losses", []))
        self._apply_optimizer_settings()
        return saved

    def _apply_optimizer_settings(self) -> None:
        """The config's learning rates, Adam betas and eps over the ones a loaded optimizer state carries, then the
        schedule's rate for the checkpoint's step (weight decay comes from the schedule, clipping from the config)."""
        o = self.cfg.optim
        for group in self.optimizer.param_groups:
            settings = {"max_lr": o.lr, "min_lr": o.min_lr, "betas": (o.beta1, o.beta2), "eps": o.eps}
            group.update({key: value for key, value in settings.items() if key in group})
        self.scheduler.step(increment=0)

    def _log_config_changes(self, saved: Dict[str, Any]) -> None:
        current = OmegaConf.to_container(OmegaConf.structured(self.cfg))
        changes = config_changes(saved["config"], current)
        if changes:
            logger.warning(
                "resuming with settings changed since the checkpoint (they apply from step %d; the LR schedule is "
                "rebuilt from the config and continues at that step, now lr %.3e): %s", self.step,
                self.optimizer.param_groups[0]["lr"], "; ".join(changes),
            )

    def _checkpoint_manager(self, root: str) -> CheckpointManager:
        return CheckpointManager(self, root)

    def _decide_checkpoint(self):
        """(checkpoint to resume, checkpoint to take weights from), at most one set: rank 0 verifies, decides and
        checks the run directory and the disk, every rank follows; then the run directory is written for the first
        time (collective the first time; the answer is kept)."""
        if hasattr(self, "_checkpoint_decision"):
            return self._checkpoint_decision
        c = self.cfg.checkpoint
        self.checkpoint_root = checkpoints_dir(self.cfg, self.run_dir)
        decision: List[Any] = [None, None, None]  # resume path, weights-only path, error message
        if self.rank == 0:
            try:
                resume, weights = self._checkpoint_to_load()
                # one run per directory: a fresh start where a run is is refused (or, overwrite_run, moves it aside)
                self._old_run = check_start(self.cfg, self.run_dir, will_resume=resume is not None)
                if c.check_free_space:
                    source = resume or weights
                    needed = checkpoint_bytes(source) if source else estimate_checkpoint_bytes(
                        self.num_parameters, self.dtype
                    )
                    ensure_free_space(self.checkpoint_root, needed, c.keep_last)
                decision[:2] = resume, weights
            except (ValueError, OSError) as err:  # every rank must hear of it, or the others wait forever
                decision[2] = str(err)
        resume, weights, error = distributed.broadcast_object(decision, src=0)
        if error:
            raise ValueError(error)
        self._commit_start(resume)
        self._checkpoint_decision = (resume, weights)
        return self._checkpoint_decision

    def _commit_start(self, resume: Optional[str]) -> None:
        """Every start-up check has passed: rank 0 writes the run directory for the first time (the old run moved
        aside under overwrite_run, config.yaml, the log held back so far, damaged checkpoints moved aside and
        ``latest`` on the one resumed); every rank waits for it."""
        failure = None
        if self.rank == 0:
            try:
                moved = move_old_run_aside(self._old_run) if self._old_run else []
                os.makedirs(self.run_dir, exist_ok=True)
                start_run_log(self.run_dir)
                for old, new in moved:
                    logger.warning("overwrite_run=true: moved the old run %s aside to %s", old, new)
                self._save_resolved_config()
                write_launch_record(self.run_dir, self.launch_record)
                if self._backend_decision is not None:
                    from diff_transformer.training.backend_choice import write_record

                    write_record(self.run_dir, self._backend_decision)
                for path, _ in self._damaged_checkpoints:
                    logger.warning("moved the damaged checkpoint %s aside to %s (kept for inspection)", path,
                                   move_aside(path, DAMAGED_SUFFIX))
                if self._damaged_checkpoints and resume:
                    atomic_write_text(os.path.join(self.checkpoint_root, LATEST_FILE), os.path.basename(resume) + "\n")
                remove_partial_saves(self.checkpoint_root)
            except OSError as err:
                failure = f"cannot write the run directory {self.run_dir}: {err}"
        failure = distributed.broadcast_object(failure, src=0)
        if failure:
            raise ValueError(failure)

    def _resume_candidate(self, root: str) -> Optional[str]:
        """The checkpoint to resume, verified, or None. ``checkpoint.resume=auto``: the newest under ``root`` that
        verifies (each damaged one skipped is logged and, once the start is committed, moved aside); a path: that
        checkpoint, refused when damaged. Rank 0 only; kept once found."""
        c = self.cfg.checkpoint
        cached = getattr(self, "_resume_selection", None)
        if cached is not None and cached[0] == root:
            return cached[1]
        self._damaged_checkpoints = []
        path = None
        if c.resume == "auto":
            path, self._damaged_checkpoints = select_resume_checkpoint(root, c.verify)
        elif c.resume != "none":
            path = resolve_checkpoint_path(c.resume)
            require_verified(path, c.verify)
        self._resume_selection = (root, path)
        return path

    def _checkpoint_to_load(self):
        """(checkpoint to resume, checkpoint to take weights from); at most one is set, verified. Rank 0 only."""
        c = self.cfg.checkpoint
        current_model = OmegaConf.to_container(OmegaConf.structured(self.cfg.model))
        resume = self._resume_candidate(self.checkpoint_root)
        if resume:
            saved = read_trainer_state(resume)
            if c.resume == "auto":
                check_resume_is_this_runs(self.run_dir, resume, saved["step"])
            self._check_continuable(resume, saved, current_model)
            return resume, None
        if c.load_weights_only:
            weights = resolve_checkpoint_path(c.load_weights_only)
            require_verified(weights, c.verify)
            saved = read_trainer_state(weights)
            check_weights_compatible(weights, saved["config"]["model"], current_model)
            check_weights_loadable(weights, saved, self.cfg)
            return None, weights
        if self.branch is not None:  # checked like a resume; loaded by _start_branch
            source = self.branch.checkpoint
            require_verified(source, c.verify)
            self._check_continuable(source, read_trainer_state(source), current_model)
        return None, None

    def _check_continuable(self, path: str, saved: Dict[str, Any], current_model: Dict[str, Any]) -> None:
        """What a resume and a branch's start both check of the checkpoint they continue: the same model, tokenizer
        and layout it can be loaded into."""
        check_model_compatible(path, saved["config"]["model"], current_model)
        if self.tokenizer is not None:
            check_tokenizer_unchanged(path, saved, self.tokenizer.model_sha256, self.tokenizer.path)
        check_resumable(path, saved, self.cfg)

    # -- data --------------------------------------------------------------------------------------------------------
    def _loader(self, dataset, consumed_samples: int) -> Iterator:
        from data.datasets import build_dataloader

        return iter(
            build_dataloader(
                dataset,
                consumed_samples=consumed_samples,
                micro_batch_size=self.cfg.trainer.micro_batch_size,
                data_parallel_rank=self.dp_rank,
                data_parallel_size=self.dp_size,
                num_workers=self._data_workers(),
            )
        )

    def _data_workers(self) -> int:
        """data.num_workers, or by default 2 worker processes on a GPU (batches are built and pinned while the GPU
        computes) and none on a CPU (where the workers would take cores from the step itself)."""
        workers = getattr(self.cfg.data, "num_workers", None)
        if workers is None:
            return 2 if torch.cuda.is_available() else 0
        return workers

    # -- steps -------------------------------------------------------------------------------------------------------
    def _forward_backward(self, data_iter: Iterator, forward_only: bool) -> torch.Tensor:
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        losses = get_forward_backward_func()(
            forward_step_func=partial(forward_step, reset_position_ids=self.cfg.data.reset_position_ids,
                                      new_graph_generation=self.cuda_graphs and not forward_only),
            data_iterator=data_iter,
            model=self.model,
            num_microbatches=self.num_microbatches,
            seq_length=self.cfg.model.seq_length,
            micro_batch_size=self.cfg.trainer.micro_batch_size,
            forward_only=forward_only,
        )
        # mean over micro-batches, then over data-parallel ranks (float64, on the device: no host read); computed on
        # the last pipeline stage
        dp_group = parallel_state.get_data_parallel_group()
        if self.is_last_stage:
            local = torch.stack([x["lm loss"].detach().double() for x in losses]).mean()
            where = distributed.collective_device(dp_group)
            loss = distributed.all_reduce_tensor(local if local.device == where else local.to(where), dp_group)
            loss = loss / self.dp_size
        else:
            loss = torch.zeros((), dtype=torch.float64, device=distributed.collective_device(dp_group))
        return self._from_last_stage(loss)

    def _from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        """A tensor computed on the last pipeline stage, on every rank of the pipeline group."""
        from megatron.core import parallel_state

        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return value
        return distributed.broadcast_tensor(value, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                            group=parallel_state.get_pipeline_model_parallel_group())

    def train_step(self, data_iter: Iterator) -> Dict[str, Any]:
        """One optimizer step; a bad loss (NaN/Inf, or a spike) skips the update but consumes the batch. Its one host
        read is the loss, which the bad-step guard needs before the optimizer and the LR schedule run; the gradient
        norm stays on the device until the step's record is written (``_write_records``)."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._set_dex_anneal()
        loss = float(self._forward_backward(data_iter, forward_only=False))
        if self.step + 1 in self.cfg.failures.inject_nan_at_steps:
            loss = float("nan")
            poison_gradients(self.model)
        bad_reason = self.bad_steps.check(loss)
        grad_norm = None
        if bad_reason is None:
            update_successful, grad_norm, _ = self.optimizer.step()
            if update_successful:
                self.scheduler.step(increment=1)
        else:
            self.skipped_steps += 1
        self.step += 1
        self.consumed_samples += self.cfg.trainer.global_batch_size
        return {
            "loss": loss,
            "grad_norm": grad_norm,  # a device tensor (or None, or megatron-core's 0.0 without clipping)
            "skipped": bad_reason,
        }

    def _set_dex_anneal(self) -> None:
        """DEX: λ's annealing fraction for the state after ``self.step`` optimizer steps (a no-op for other kinds)."""
        if self.cfg.model.attention == "dex":
            set_dex_anneal(self.model, self.cfg.model.dex, self.step, self.cfg.trainer.max_steps)

    @torch.no_grad()
    def evaluate(self) -> float:
        self._set_dex_anneal()
        for chunk in self.model:
            chunk.eval()
        it = self._loader(self.valid_ds, consumed_samples=0)
        losses = [self._forward_backward(it, forward_only=True) for _ in range(self.cfg.trainer.eval_iters)]
        for chunk in self.model:
            chunk.train()
        return float(sum(losses) / len(losses))  # one host read for the evaluation

    def finish_param_sync(self) -> None:
        """With parallel.overlap_param_gather the distributed optimizer's updated parameters reach the other
        data-parallel ranks during the next forward pass (its pre-hooks), so between a step and that forward a rank
        holds stale copies of the shards it does not own; gather them now, before anything reads the weights
        (a checkpoint, logged λ). A no-op otherwise."""
        if not self.cfg.parallel.overlap_param_gather:
            return
        for chunk in self.model:
            chunk.start_param_sync(force_sync=True)

    def lambdas(self) -> List[float]:
        """Per-layer λ of the whole model, gathered over pipeline stages."""
        from megatron.core import parallel_state

        local = lambda_values(self.model)
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return local
        gathered = distributed.all_gather_objects(local, group=parallel_state.get_pipeline_model_parallel_group())
        return [x for stage in gathered for x in stage]

    def v2_lambda_stats(self) -> Dict[str, List[float]]:
        """DIFF V2's per-token λ over the step just recorded (see ``_train_and_measure``), per layer: ``lambda_mean``
        and ``lambda_std`` over every token and head of the global batch (summed over TP and data-parallel ranks,
        gathered over pipeline stages). One host sync."""
        from megatron.core import parallel_state

        sums = recorded_lambda_sums(self.model)
        record_lambda(self.model, False)
        distributed.all_reduce_tensor(sums, group=parallel_state.get_tensor_and_data_parallel_group())
        means, stds = [], []
        for count, total, squares in sums.tolist():
            means.append(total / count)
            stds.append(math.sqrt(max(squares / count - (total / count) ** 2, 0.0)))
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            stages = distributed.all_gather_objects((means, stds), group=parallel_state.get_pipeline_model_parallel_group())
            means, stds = [x for stage in stages for x in stage[0]], [x for stage in stages for x in stage[1]]
        return {"lambda_mean": means, "lambda_std": stds}

    # -- loop --------------------------------------------------------------------------------------------------------
    def write_run_info(self) -> None:
        if self.rank != 0:
            return
        info = {
            "name": self.cfg.name,
            "model": self.cfg.model.name,
            "attention": self.cfg.model.attention,
            "variant": variant_label(self.cfg.model),  # the kind and its ablation keys: compare --table groups by it
            "seed": self.cfg.seed,
            "lr": self.cfg.optim.lr,
            "lr_schedule": {
                "decay": self.cfg.optim.decay, "warmup_steps": self.cfg.optim.warmup_steps,
                "cooldown_steps": (cooldown_steps(self.cfg.optim, self.cfg.trainer.max_steps)
                                   if self.cfg.optim.decay == "wsd" else None),
            },
            "branch": self.branch.record() if self.branch else None,
            "flops_per_token": self._flops_per_token,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "sweep": self.sweep,
            "num_parameters": self.num_parameters,
            "num_non_embedding_parameters": self.num_non_embedding_parameters,
            "tokens_per_step": self.tokens_per_step,
            "seq_length": self.cfg.model.seq_length,
            "global_batch_size": self.cfg.trainer.global_batch_size,
            "max_steps": self.cfg.trainer.max_steps,
            "data": self._data_description(),
            "data_source": self.cfg.data.describe(),
            "layout": {"tp": self.cfg.parallel.tp, "pp": self.cfg.parallel.pp, "cp": self.cfg.parallel.cp,
                       "dp": self.dp_size},
            "engine": self.cfg.engine.name,
            "attention_backend": self.cfg.model.attention_backend,
            # the memory plan's estimate of this rank's peak (GiB), next to which benchmarks put the measured one
            "memory_estimate_gib": estimate_memory_per_gpu(
                self.cfg, self.dtype, torch.distributed.get_world_size(), self.padded_vocab
            )["total"],
        }
        if self.cfg.model.attention == "diff_v2" and v2_baseline(self.cfg.model)[0] is not None:
            info["baseline_variant"] = variant_label(v2_baseline(self.cfg.model)[0])  # compare pairs V2 with it
        atomic_write_json(os.path.join(self.run_dir, "run.json"), info)

    def _data_description(self) -> Dict[str, Any]:
        """What was trained on, by content (tokenizer hash, shard names and sizes, weights, split), not by path, so
        that the same data prepared in two places compares equal."""
        from data.datasets import tokenizer_hash

        shards = [
            {"name": os.path.basename(p), "bytes": os.path.getsize(p + ".bin")} for p in self.prepared.prefixes
        ]
        description = {
            "tokenizer_sha256": tokenizer_hash(self.prepared.tokenizer_dir),
            "shards": shards,
            "weights": self.prepared.weights,
            "split": self.cfg.data.split,
        }
        for switch in ("document_mask", "reset_position_ids"):  # recorded when on: earlier runs compare unchanged
            if getattr(self.cfg.data, switch, False):
                description[switch] = True
        return description

    def _masked_attention_keys(self, samples: int = 64) -> Optional[float]:
        """Under document masking, the keys a token attends to on average over the first ``samples`` training
        samples (accounting.attention_keys_per_token), which MFU counts instead of the causal s/2; None without."""
        if not self.cfg.data.document_mask:
            return None
        n = min(samples, len(self.train_ds))
        keys = attention_keys_per_token(torch.stack([self.train_ds[i]["document_ids"] for i in range(n)]))
        logger.info("document masking: attention over %.1f keys a token on average (%.1f%% of the causal map's "
                    "work, the first %d training samples); MFU counts only that", keys,
                    100 * keys / (self.cfg.model.seq_length / 2), n)
        return keys

    def fit(self) -> List[Dict[str, Any]]:
        """Train to ``trainer.max_steps``; returns early (after a checkpoint) when a preemption signal arrives, and
        raises TrainingDiverged (after a checkpoint) after too many bad steps in a row. A run resumed at max_steps
        trains nothing and opens no W&B segment."""
        if self.step >= self.cfg.trainer.max_steps:
            if self.rank == 0:
                logger.info("already at max_steps=%d (resumed from %s): nothing to train; raise trainer.max_steps to "
                            "train on", self.cfg.trainer.max_steps, self.resumed_from)
            return []
        self._flops_per_token = model_flops_per_token(self.cfg, self.num_non_embedding_parameters, self.padded_vocab,
                                                      self._masked_attention_keys())
        self.write_run_info()
        self._metrics = self._open_metrics()
        signals = PreemptionSignals(self.cfg.failures.signals, grace_period_seconds(self.cfg.failures),
                                    self.checkpoint_root).install()
        train_iter = self._loader(self.train_ds, self.consumed_samples)
        self._peak_flops = peak_flops_per_device(self.cfg)
        self.diagnostics = self._attention_diagnostics()
        history = []
        try:
            while self.step < self.cfg.trainer.max_steps:
                record = self._train_and_measure(train_iter)
                self._log_step(record)
                history.append(record)
                self._stop_if_diverged()
                if signals.agreed():
                    self._save_and_exit_on_signal(signals)
                    break
                self._save_on_interval()
            else:
                self._write_records()  # every record, whether or not the end is saved
                if self.cfg.checkpoint.save_at_end:
                    self._save("end")
            self.checkpoints.wait()
        except RunLogFailed as err:
            raise RunLogFailed(f"{err}: the run stops at step {self.step}; free space there and "
                               f"{rerun_advice(self.checkpoint_root)}") from None
        finally:
            signals.uninstall()
            self._metrics.close()
        return history

    # -- the steps of fit --------------------------------------------------------------------------------------------
    def _open_metrics(self) -> MetricsWriter:
        """metrics.jsonl (truncated to the resumed step) and, on rank 0, the W&B run (continued on resume)."""
        wandb_run = None
        if self.rank == 0:
            resolved = OmegaConf.to_container(OmegaConf.structured(self.cfg))
            wandb_run = init_wandb(self.cfg, self.run_dir, resolved, run_id=self.wandb_run_id, sweep=self.sweep)
            self.wandb_run_id = getattr(wandb_run, "id", None)
            if wandb_run is not None:  # compare --wandb reads the run description from here
                with open(os.path.join(self.run_dir, "run.json")) as f:
                    wandb_run.config.update({"run": json.load(f)}, allow_val_change=True)
        t = self.cfg.trainer
        return MetricsWriter(
            self.run_dir, t.max_steps, enabled=self.rank == 0, wandb_run=wandb_run,
            resume_step=self.step if self.resumed_from else None,
            window_steps=max(t.log_interval, t.eval_interval, PROGRESS_WINDOW_STEPS),
        )

    def _train_and_measure(self, train_iter: Iterator) -> Dict[str, Any]:
        """One optimizer step and its metrics record (validation loss on evaluation steps)."""
        t = self.cfg.trainer
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
        # DIFF V2's per-token λ is summed in the forward passes of logging steps only
        # (the step about to run is self.step + 1: _logs_this_step judges it once train_step has counted it)
        v2_lambda = self.cfg.model.attention == "diff_v2" and (
            (self.step + 1) % t.log_interval == 0 or self.step + 1 == t.max_steps)
        if v2_lambda:
            record_lambda(self.model, True)
        profiled = t.profile_step is not None and self.step + 1 == t.profile_step
        # a range per module call in the profile, unless the layers are compiled (new module hooks would recompile them)
        with StepProfiler(module_ranges=not self.compiled_layers) if profiled else contextlib.nullcontext() as profiler:
            start = time.perf_counter()
            out = self.train_step(train_iter)
            if profiled:
                profiler.synchronize()
            step_time = time.perf_counter() - start
        if self.compiled_layers and not self._first_step_done and self.rank == 0:
            recorded = " and recorded their CUDA graphs" if self.cuda_graphs and torch.cuda.is_available() else ""
            logger.info("trainer.compile: the first step of this process (step %d), which compiled the layers%s, took "
                        "%.1f s", self.step, recorded, step_time)
        self._first_step_done = True
        self._report_cuda_graphs()
        if profiled and self.rank == 0:
            path = profiler.write(self.run_dir, self.step, step_time)
            logger.info("step %d profiled: %s", self.step, path)
        tokens_per_s = self.tokens_per_step / step_time
        record = {
            "step": self.step,
            "loss": out["loss"],
            "lr": lr,
            "grad_norm": out["grad_norm"],
            "tokens_per_s": tokens_per_s,
            "tokens": self.consumed_samples * self.cfg.model.seq_length,
            "step_time": step_time,
            "skipped": out["skipped"] is not None,
            "skipped_steps": self.skipped_steps,
            "memory_gib": memory_gib(),
        }
        if self._peak_flops:
            world = torch.distributed.get_world_size()
            record["mfu"] = self._flops_per_token * tokens_per_s / (world * self._peak_flops)
        if self.cfg.model.attention in ("diff", "dex") and self._logs_this_step():
            self.finish_param_sync()
            record["lambda"] = self.lambdas()
        if v2_lambda:
            record.update(self.v2_lambda_stats())
        if t.eval_interval > 0 and (self.step % t.eval_interval == 0 or self.step == t.max_steps):
            record["val_loss"] = self.evaluate()
            if self.diagnostics is not None:
                record.update(self.diagnostics.measure())
        if out["skipped"] is not None:
            logger.warning(
                "step %d skipped (%s); %d in a row, %d in all",
                self.step, out["skipped"], self.bad_steps.consecutive, self.skipped_steps,
            )
        return record

    def _attention_diagnostics(self) -> Optional[AttentionDiagnostics]:
        """The probe of trainer.attention_diagnostics, or None when it is off (auto: off above 1% estimated cost)."""
        fraction = estimated_cost_fraction(self.cfg, self._flops_per_token) if self.cfg.trainer.eval_interval else 0.0
        enabled = diagnostics_enabled(self.cfg, self._flops_per_token)
        if self.rank == 0:
            logger.info("attention diagnostics %s (trainer.attention_diagnostics=%s; estimated cost %.3f%% of the "
                        "training between evaluations%s)", "on" if enabled else "off",
                        self.cfg.trainer.attention_diagnostics, 100 * fraction,
                        "; off under context parallelism, where no rank holds a whole map" if self.cfg.parallel.cp > 1
                        else "")
        return AttentionDiagnostics(self) if enabled else None

    def _logs_this_step(self) -> bool:
        """Logging steps (every ``trainer.log_interval``-th and the last): per-layer λ is read from the weights only on
        them, so other steps make no host sync for it, and with parallel.overlap_param_gather the parameter all-gather
        (which reading them forces early) stays overlapped with the next forward."""
        t = self.cfg.trainer
        return self.step % t.log_interval == 0 or self.step == t.max_steps

    def _log_step(self, record: Dict[str, Any]) -> None:
        """Keep the step's record; on logging steps write the records kept and the progress line."""
        self._unwritten.append((record, time.time()))
        if self._logs_this_step():
            self._write_records()
            if self.rank == 0:
                logger.info(self._metrics.progress_line(record))

    def _write_records(self) -> None:
        """Write the records kept since the last logging step to metrics.jsonl (and W&B), their gradient norms read
        from the device in one go: the only host read of them, so steps that do not log wait for nothing."""
        kept, self._unwritten = self._unwritten, []
        on_device = [record for record, _ in kept if torch.is_tensor(record["grad_norm"])]
        if on_device:
            for record, norm in zip(on_device, torch.stack([r["grad_norm"] for r in on_device]).tolist()):
                record["grad_norm"] = norm
        for record, wall_time in kept:
            self._metrics.log(record, wall_time=wall_time)

    def _save(self, reason: str) -> None:
        """Save a checkpoint of this step, the records up to it written first: metrics.jsonl always reaches a
        checkpoint's step (``checkpoint.resume=auto`` checks it)."""
        self._write_records()
        self.checkpoints.save(reason=reason)

    def _stop_if_diverged(self) -> None:
        if not self.bad_steps.exhausted:
            return
        self._save("diverged")
        self.checkpoints.wait()
        raise TrainingDiverged(
            f"{self.bad_steps.consecutive} bad steps in a row up to step {self.step} "
            f"(failures.max_consecutive_bad_steps={self.cfg.failures.max_consecutive_bad_steps}); "
            f"checkpoint saved in {self.checkpoint_root}"
        )

    def _save_on_interval(self) -> None:
        interval = self.cfg.checkpoint.interval
        if interval and self.step % interval == 0:
            self._save("interval")
        self.checkpoints.poll()

    def _save_and_exit_on_signal(self, signals: PreemptionSignals) -> None:
        """Save the current step; under SLURM, rank 0 requeues the job. The caller then leaves the loop."""
        received = signals.received or "a signal on another rank"
        if self.rank == 0:
            logger.warning("%s: saving step %d before exiting", received, self.step)
        self._save(received)
        self.checkpoints.wait()
        signals.saved()
        self.stopped_by_signal = True
        requeued = self.rank == 0 and bool(os.environ.get("SLURM_JOB_ID")) and requeue_current_job()
        self.requeued = bool(distributed.broadcast_object(requeued, src=0))
