"""The training loop: set-up from the recipe, steps, validation, checkpoints, metrics.

What a run trains, on what and what comes out of it is its `TrainingTask`, which the loop asks
through public hooks: the model chunks with their starting weights, the data streams, each
micro-batch's forward step and loss, what validation measures beyond the loss, what is saved
beside each checkpoint, and the outputs once the run is done. Pretraining is
`PretrainingTask`; the tuning stages' are in jobs/fine_tuning/. The loop itself (optimizer,
schedule, checkpoints, resume, signals, metrics) is the same for all of them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.num_microbatches_calculator import (
    destroy_num_microbatches_calculator,
    get_current_global_batch_size,
    get_num_microbatches,
    init_num_microbatches_calculator,
    update_num_microbatches,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_batch_on_this_cp_rank
from omegaconf import OmegaConf

from launcher_scripts.costmodel.plan import Costs
from launcher_scripts.families import family_of
from launcher_scripts.files import write_atomic
from launcher_scripts.formats.portable import EMBEDDINGS
from launcher_scripts.formats.progress import (
    EXIT_PREEMPTED,
    Checkpoint,
    damaged_checkpoints,
)
from launcher_scripts.jobs.models import runtime_of
from launcher_scripts.jobs.models.transformer import (
    separate_expert_parameters,
    transformer_engine_available,
)
from launcher_scripts.jobs.training import checkpointing, data, init_weights, metrics, wandb_logger
from launcher_scripts.jobs.training.checkpointing import TrainState
from launcher_scripts.jobs.training.expert_load import ExpertLoad, expert_stacks
from launcher_scripts.jobs.training.nsys_capture import NsysCapture
from launcher_scripts.jobs.training.runtime import (
    JobError,
    init_model_parallel,
    seed_everything,
)
from launcher_scripts.recipes import training as recipe
from launcher_scripts.recipes.early_stopping import read_early_stopping
from launcher_scripts.recipes.layout import read_layout
from launcher_scripts.recipes.profiling import read_nsys_profile

if TYPE_CHECKING:
    from launcher_scripts.formats.portable import Portable


class ResumeError(JobError):
    pass


class Streams:
    """A run's data: training and validation micro-batch streams, and how many global
    batches one validation reads."""

    def __init__(self, train: Any, valid: Any | None, val_batches: int) -> None:
        self.train, self.valid, self.val_batches = train, valid, val_batches


@dataclass
class TrainedBeside:
    """A model a task trains beside the main one (PPO's critic): its wrapped chunks, optimizer
    and schedule, built as the main model's are (Trainer.train_beside). Checkpoints hold it
    under its name; resume restores it."""

    model: list[Any]
    optimizer: Any
    scheduler: OptimizerParamScheduler
    config: Any  # its TransformerConfig


class TrainingTask:
    """What one kind of run trains: the hooks the loop asks, each given the trainer (its
    recipe, layout, model and state). The defaults are what every kind shares."""

    stage = "training"  # the recipe's stage, for the keys its errors name

    def make_chunks(self, trainer: Trainer) -> list[Any]:
        """This rank's model chunks with their starting weights, before any wrapping."""
        raise NotImplementedError

    def build_data(self, trainer: Trainer) -> Streams:
        raise NotImplementedError

    def forward_step(self, trainer: Trainer, batch: dict[str, Any], model: Any) -> tuple[Any, Any]:
        """One micro-batch through the model: (its output, the loss function of the output),
        as megatron-core's schedules take them."""
        return trainer.runtime.forward_step(batch, model)

    def before_training(self, trainer: Trainer) -> None:
        """Once the data, the resumed state and the metrics log are ready."""

    def before_step(self, trainer: Trainer) -> None:
        """Before each optimizer step (timed with it): an online task makes the step's data
        (rollouts) here."""

    def after_step(self, trainer: Trainer, outputs: list[Any], seconds: float) -> None:
        """After each optimizer step, with this rank's loss-function reports of its
        micro-batches and the step's time (before_step's included)."""

    def after_validation(self, trainer: Trainer, loss: float, outputs: list[Any]) -> None:
        """What validation measures beyond the loss (into `trainer.state.metrics`); `outputs`
        are this rank's loss functions' reports (none before the last pipeline stage)."""

    def on_checkpoint(self, trainer: Trainer) -> None:
        """Files written beside each checkpoint, on rank 0, beyond hparams.yaml."""

    def trained_beside(self) -> dict[str, TrainedBeside]:
        """The models the task trains beside the main one, by name (saved and resumed with
        it); the task keeps its other state in `trainer.state.task`."""
        return {}

    def write_outputs(self, trainer: Trainer) -> None:
        """The run's outputs, once it has done every step (fit() calls it on every rank)."""


class PretrainingTask(TrainingTask):
    """Pretraining from random weights, or continued from a portable file's (`restored`)."""

    def __init__(self, restored: Portable | None = None) -> None:
        self.restored = restored

    def make_chunks(self, trainer: Trainer) -> list[Any]:
        """The restored file's weights (unless a checkpoint of this run will replace them),
        else random ones."""
        weights = self.restored.tensors if self.restored is not None else None
        rows = weights.shape(EMBEDDINGS)[0] if weights is not None else trainer.vocab.vocab_size
        chunks = trainer.runtime.build_chunks(trainer.cfg, trainer.config, rows, trainer.use_te)
        if trainer.on_gpu:
            chunks = [chunk.cuda(torch.cuda.current_device()) for chunk in chunks]
        if weights is not None and not trainer.resumes():
            init_weights.load_full_tensors(chunks, weights)
            trainer.say(f"starting from the weights of {weights.path}")
        else:
            init_weights.initialize(chunks, trainer.config, trainer.seed)
        return chunks

    def build_data(self, trainer: Trainer) -> Streams:
        cfg = trainer.cfg
        limit = cfg.trainer.get("limit_val_batches", 1)
        gbs = int(cfg.model.global_batch_size)
        val_batches = limit if isinstance(limit, int) and not isinstance(limit, bool) else 0
        index_dir = cfg.model.data.get("index_mapping_dir") or trainer.log_dir / "index_cache"
        data.check_vocabulary(cfg, trainer.vocab)
        train, valid, _test = trainer.runtime.build_datasets(
            cfg,
            trainer.vocab,
            # No test split: pretraining never evaluates on it (the evaluation stage does).
            (int(cfg.trainer.max_steps) * gbs, max(val_batches * gbs, 1), 0),
            Path(str(index_dir)),
        )
        mbs, keys = int(cfg.model.micro_batch_size), trainer.runtime.batch_keys
        valid_stream = data.SampleStream(valid, mbs, keys) if valid else None
        if valid_stream is not None and not val_batches:
            fraction = float(limit or 0)
            val_batches = max(1, int(fraction * len(valid) // gbs)) if fraction else 0
        return Streams(data.SampleStream(train, mbs, keys), valid_stream, val_batches)


class Trainer:
    def __init__(self, cfg: Any, on_gpu: bool, stop_signals: Any, task: TrainingTask) -> None:
        self.cfg, self.on_gpu, self.stop_signals = cfg, on_gpu, stop_signals
        self.task = task
        self.started = time.monotonic()
        self.rank = dist.get_rank()
        self.layout = read_layout(cfg)
        self.seed = int(cfg.model.get("seed", 1234))
        seed_everything(self.seed)
        init_model_parallel(self.layout, self.seed, on_gpu)
        print(f"rank {self.rank}: joined;{self._layout()}", flush=True)

        self.log_dir = Path(str(cfg.exp_manager.explicit_log_dir))
        self.checkpoint_dir = self.log_dir / "checkpoints"
        if self.rank == 0:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            checkpointing.clean_temporary(self.checkpoint_dir)
        dist.barrier()

        self.family = family_of(cfg, "training")
        self.runtime = runtime_of(self.family)
        self.vocab = self.runtime.data_tokenizer(cfg)
        self.use_te = (
            on_gpu
            and bool(cfg.model.get("transformer_engine", False))
            and transformer_engine_available()
        )
        if self.layout.context > 1 and not self.use_te:
            raise JobError(
                "training.model.context_parallel_size > 1 needs Transformer Engine on GPUs "
                "(and transformer_engine=True): set it to 1 here"
            )
        self.config = self.runtime.transformer_config(cfg, self.use_te, on_gpu)
        self.model = self._build_model()
        stacks = expert_stacks(self.config)
        self.expert_load = ExpertLoad(self.model, stacks) if stacks else None
        self.optimizer = self._build_optimizer()
        self.scheduler = self._build_scheduler()
        self._configure_schedule_hooks()
        self._init_batch_calculator()
        self.state = TrainState()
        self.metrics_log: metrics.MetricsLog | None = None
        profile = read_nsys_profile(cfg.model, "training.model", self.layout.world_size, on_gpu)
        self.nsys = NsysCapture(profile, self.rank)
        self.early_stopping = read_early_stopping(cfg.exp_manager, task.stage)

    # ----- set-up -----------------------------------------------------------------------

    def _layout(self) -> str:
        return (
            f" tp {parallel_state.get_tensor_model_parallel_rank()}/{self.layout.tensor}"
            f" pp {parallel_state.get_pipeline_model_parallel_rank()}/{self.layout.pipeline}"
            f" dp {parallel_state.get_data_parallel_rank()}/{self.layout.data}"
            f" cp {parallel_state.get_context_parallel_rank()}/{self.layout.context}"
        )

    def _write_hparams(self) -> None:
        """hparams.yaml beside the checkpoints, as the conversion stage expects. Written with
        each checkpoint, not at start-up: a run refused before its first checkpoint (a
        setting this machine cannot run) leaves the file of the run that wrote them."""
        model = OmegaConf.to_container(self.cfg.model, resolve=True)
        assert isinstance(model, dict)
        model["precision"] = self.cfg.trainer.precision
        model["model_family"] = self.family.name  # the model conversion and loading build
        write_atomic(self.log_dir / "hparams.yaml", OmegaConf.to_yaml({"cfg": model}))
        self.task.on_checkpoint(self)

    def _build_model(self) -> list[Any]:
        return self._wrap(self.task.make_chunks(self), self.config)

    def _wrap(self, chunks: list[Any], config: Any) -> list[Any]:
        """Chunks in the mixed-precision and data-parallel wrappers training needs."""
        separate_expert_parameters(chunks)
        if config.fp16 or config.bf16:
            chunks = [Float16Module(config, chunk) for chunk in chunks]
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=config.fp16 or config.bf16,
            overlap_grad_reduce=self.on_gpu and self.layout.data > 1,
            use_distributed_optimizer=self._distributed_optimizer(),
            check_for_nan_in_grad=True,
        )
        return [
            DistributedDataParallel(
                config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0
            )
            for i, chunk in enumerate(chunks)
        ]

    def _distributed_optimizer(self) -> bool:
        return str(self.cfg.model.optim.name) == "distributed_fused_adam"

    def _build_optimizer(self) -> Any:
        return self._optimizer_of(self.model, self.config, self.cfg.model.optim)

    def _optimizer_of(self, model: list[Any], model_config: Any, optim: Any) -> Any:
        betas = list(optim.get("betas") or (0.9, 0.999))
        clip = self.cfg.trainer.get("gradient_clip_val")
        config = OptimizerConfig(
            optimizer="sgd" if optim.name == "sgd" else "adam",
            lr=float(optim.lr),
            min_lr=self._schedule_of(optim).min_lr,
            weight_decay=float(optim.get("weight_decay", 0.0)),
            adam_beta1=float(betas[0]),
            adam_beta2=float(betas[1]),
            adam_eps=float(optim.get("eps", 1e-8)),
            clip_grad=float(clip) if clip else 0.0,
            fp16=model_config.fp16,
            bf16=model_config.bf16,
            params_dtype=model_config.params_dtype,
            use_distributed_optimizer=self._distributed_optimizer(),
            initial_loss_scale=float(self.cfg.model.get("native_amp_init_scale", 2**32)),
            loss_scale_window=float(self.cfg.model.get("native_amp_growth_interval", 1000)),
        )
        return get_megatron_optimizer(config, model)

    def _build_scheduler(self) -> OptimizerParamScheduler:
        return self._scheduler_of(self.optimizer, self.cfg.model.optim)

    def _schedule_of(self, optim: Any) -> recipe.Schedule:
        """An optimizer section's schedule (recipes.training.schedule) over this run's steps."""
        max_steps = int(self.cfg.trainer.max_steps)
        shape = {"model": {"optim": optim}, "trainer": {"max_steps": max_steps}}
        return recipe.schedule(OmegaConf.create(shape))

    def _scheduler_of(self, optimizer: Any, optim: Any) -> OptimizerParamScheduler:
        max_steps = int(self.cfg.trainer.max_steps)
        sched = self._schedule_of(optim)
        weight_decay = float(optim.get("weight_decay", 0.0))
        return OptimizerParamScheduler(
            optimizer,
            init_lr=0.0,
            max_lr=float(optim.lr),
            min_lr=sched.min_lr,
            lr_warmup_steps=sched.warmup_steps,
            # NeMo's CosineAnnealing holds min_lr for the last constant_steps.
            lr_decay_steps=max(max_steps - sched.constant_steps, sched.warmup_steps + 1),
            lr_decay_style=sched.decay_style,
            start_wd=weight_decay,
            end_wd=weight_decay,
            wd_incr_steps=max_steps,
            wd_incr_style="constant",
        )

    def _configure_schedule_hooks(self) -> None:
        self._hook_schedule(self.config, self.model, self.optimizer)

    def _hook_schedule(self, config: Any, model: list[Any], optimizer: Any) -> None:
        """What megatron-core's schedules ask a model's config: loss scaling, the gradients'
        reduction, and (overlapped on GPUs) no-sync contexts."""
        config.grad_scale_func = optimizer.scale_loss
        config.finalize_model_grads_func = self.runtime.finalize_grads or finalize_model_grads
        if self.on_gpu and self.layout.data > 1:
            no_sync = [chunk.no_sync for chunk in model]
            config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync

    def train_beside(self, chunks: list[Any], config: Any, optim: Any) -> TrainedBeside:
        """A model the task trains beside the main one (its chunks built in this layout with
        their starting weights, and their TransformerConfig), wrapped, with its own optimizer
        and schedule as `optim` (a model.optim-shaped section) sets them."""
        model = self._wrap(chunks, config)
        optimizer = self._optimizer_of(model, config, optim)
        self._hook_schedule(config, model, optimizer)
        return TrainedBeside(model, optimizer, self._scheduler_of(optimizer, optim), config)

    def step_beside(
        self, trained: TrainedBeside, start: int, stream: Any, forward: Callable[..., Any]
    ) -> list[Any]:
        """One optimizer step of a model trained beside the main one on the global batch of
        `stream` from sample `start`: this rank's loss-function reports."""
        for chunk in trained.model:
            chunk.zero_grad_buffer()
        trained.optimizer.zero_grad()
        micro = get_num_microbatches()
        outputs = self._run_schedule(start, micro, False, stream, trained.model, forward)
        success, _grad_norm, _zeros = trained.optimizer.step()
        if success:
            trained.scheduler.step(increment=1)
        return outputs

    def _init_batch_calculator(self) -> None:
        model = self.cfg.model
        ramp = recipe.rampup(model)
        destroy_num_microbatches_calculator()
        init_num_microbatches_calculator(
            self.rank,
            [str(v) for v in ramp] if ramp else None,
            int(model.global_batch_size),
            int(model.micro_batch_size),
            self.layout.data,
        )

    # ----- steps ------------------------------------------------------------------------

    def prepare_data(self) -> None:
        """The task's data streams (fit() asks for them before it resumes)."""
        streams = self.task.build_data(self)
        self.train_stream, self.valid_stream = streams.train, streams.valid
        self.val_batches = streams.val_batches

    def _forward_step(
        self, forward: Callable[..., Any] | None, data_iterator: Any, model: Any
    ) -> tuple[Any, Any]:
        batch = next(data_iterator)
        if self.layout.context > 1:
            batch = get_batch_on_this_cp_rank(batch)
        if self.on_gpu:
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        if forward is not None:
            return forward(batch, model)
        return self.task.forward_step(self, batch, model)

    def _run_schedule(
        self,
        start: int,
        micro_batches: int,
        forward_only: bool,
        stream: Any,
        model: list[Any] | None = None,
        forward: Callable[..., Any] | None = None,
    ):
        """megatron-core's schedule over `micro_batches` of `stream` from sample `start`: the
        main model and the task's forward step, or another model and forward(batch, model)."""
        model = model or self.model
        iterators = [stream.micro_batches(start, micro_batches) for _ in range(len(model))]
        seq_length, decoder_seq_length = self.runtime.sequence_lengths(self.cfg)
        return get_forward_backward_func()(
            forward_step_func=functools.partial(self._forward_step, forward),
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=model,
            num_microbatches=micro_batches,
            seq_length=seq_length,
            decoder_seq_length=decoder_seq_length,
            micro_batch_size=int(self.cfg.model.micro_batch_size),
            forward_only=forward_only,
        )

    @property
    def device(self) -> str:
        """Where this rank's tensors and collectives live."""
        return "cuda" if self.on_gpu else "cpu"

    def _local_loss(self, outputs: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """[summed token loss, token count] of this rank's micro-batches, left on the device."""
        if not outputs:  # not the last pipeline stage
            return torch.zeros(2, dtype=torch.float64, device=self.device)
        return torch.stack([o["lm loss"].detach() for o in outputs]).sum(0).double()

    def _reduce_loss(self, local: torch.Tensor) -> float:
        """Mean loss per token over every rank's share, the same on every rank.

        Only the last pipeline stage has losses; the others add zeros. Tensor-parallel ranks
        repeat both the sum and the count, so their ratio is unchanged.
        """
        total = local.clone()
        dist.all_reduce(total)
        return float(total[0] / total[1].clamp(min=1))

    def train_step(self) -> tuple[torch.Tensor, dict[str, float]]:
        """One optimizer step: this rank's [loss sum, token count], and the step's scalars.

        The loss is reduced across ranks only when it is logged, not every step.
        """
        tick = time.perf_counter()
        self.task.before_step(self)
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        batch_size = get_current_global_batch_size()
        outputs = self._run_schedule(
            self.state.consumed_samples, get_num_microbatches(), False, self.train_stream
        )
        success, grad_norm, _zeros = self.optimizer.step()
        if success:
            self.scheduler.step(increment=1)
        self.state.step += 1
        self.state.consumed_samples += batch_size
        update_num_microbatches(self.state.consumed_samples, consistency_check=True)
        self.task.after_step(self, outputs, time.perf_counter() - tick)
        return self._local_loss(outputs), {
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "global_batch_size": float(batch_size),
        }

    def validate(self) -> float:
        """The validation loss (NaN without validation data), then what the task measures."""
        outputs = self.validation_outputs()
        loss = self._reduce_loss(self._local_loss(outputs)) if outputs is not None else math.nan
        self.task.after_validation(self, loss, outputs or [])
        return loss

    def validation_outputs(self) -> list[dict[str, torch.Tensor]] | None:
        """This rank's reports of each validation micro-batch; None without validation."""
        if self.valid_stream is None or not self.val_batches:
            return None
        return self.evaluate(self.valid_stream, self.val_batches)

    @torch.no_grad()
    def evaluate(
        self,
        stream: Any,
        batches: int,
        model: list[Any] | None = None,
        forward: Callable[..., Any] | None = None,
    ) -> list[dict[str, torch.Tensor]]:
        """The model (or another, with forward(batch, model)), forward only, over `batches`
        global batches of `stream` (from its start): this rank's loss-function reports, one
        per micro-batch (none before the last pipeline stage)."""
        micro = int(self.cfg.model.global_batch_size) // (
            int(self.cfg.model.micro_batch_size) * self.layout.data
        )
        outputs = []
        gbs = int(self.cfg.model.global_batch_size)
        with self.eval_mode(model):
            for batch in range(batches):
                outputs += self._run_schedule(batch * gbs, micro, True, stream, model, forward)
        return outputs

    @contextlib.contextmanager
    def eval_mode(self, model: list[Any] | None = None) -> Iterator[None]:
        """The model (or another) in eval mode (no dropout) inside, in training mode after."""
        chunks = model or self.model
        for chunk in chunks:
            chunk.eval()
        try:
            yield
        finally:
            for chunk in chunks:
                chunk.train()

    # ----- checkpoints ------------------------------------------------------------------

    def _checkpoint_params(self) -> Any:
        return self.cfg.exp_manager.get("checkpoint_callback_params") or {}

    def save_checkpoint(self) -> Path:
        params = self._checkpoint_params()
        template = str(params.get("filename") or "megatron_gpt--{step}-{consumed_samples}")
        values = {
            "step": self.state.step,
            "consumed_samples": float(self.state.consumed_samples),
            **self.state.metrics,
        }
        name = checkpointing.checkpoint_name(template, values)
        self.state.scheduler = self.scheduler.state_dict()
        beside = self.task.trained_beside()
        for other, trained in beside.items():
            self.state.task[f"{other}.scheduler"] = trained.scheduler.state_dict()
        path = checkpointing.save(
            self.checkpoint_dir, name, self.model, self.optimizer, self.state, _pairs(beside)
        )
        if self.rank == 0:
            self._write_hparams()
            checkpointing.apply_retention(
                self.checkpoint_dir,
                int(params.get("save_top_k", 1)),
                str(params.get("monitor", "val_loss")),
                str(params.get("mode", "min")),
            )
            print(f"saved checkpoint {path}", flush=True)
        return path

    @functools.cached_property
    def _resume_choice(self) -> tuple[Checkpoint | None, str | None]:
        """The checkpoint to resume from and what to say about damaged newer ones, decided by
        rank 0 (on a network file system nodes may briefly see different file sizes) and
        shared, so that every rank loads the same one. Decided once (a scan and a broadcast):
        the model's construction asks it, then resume()."""
        decision: list[Any] = [None, None]
        if self.rank == 0:
            found = checkpointing.complete_checkpoints(self.checkpoint_dir)
            newest = found[-1] if found else None
            damaged = [
                (checkpoint, problem)
                for checkpoint, problem in damaged_checkpoints(self.checkpoint_dir)
                if newest is None or checkpoint.state.step > newest.state.step
            ]
            note = None
            if damaged:
                bad, problem = damaged[-1]
                note = f"checkpoint {bad.path} is damaged ({problem})"
            decision = [newest, note]
        dist.broadcast_object_list(decision, src=0)
        return decision[0], decision[1]

    def resumes(self) -> bool:
        """Whether resume() will load a checkpoint of this run."""
        exp = self.cfg.exp_manager
        return bool(exp.get("resume_if_exists", False)) and self._resume_choice[0] is not None

    def resume(self) -> None:
        exp = self.cfg.exp_manager
        if not exp.get("resume_if_exists", False):
            return
        newest, damaged = self._resume_choice
        if damaged and newest is None:
            # Starting from scratch would silently throw the run away.
            raise ResumeError(
                f"{damaged} and {self.checkpoint_dir} holds no complete checkpoint before it: "
                "restore its files from a copy, or delete it to start training from scratch"
            )
        if damaged and newest is not None:
            self.say(
                f"{damaged}: resuming from the previous complete checkpoint {newest.path} "
                "instead (delete the damaged one once you no longer need it)"
            )
        if newest is None:
            if not exp.get("resume_ignore_no_checkpoint", True):
                raise ResumeError(
                    f"resume_if_exists is set but {self.checkpoint_dir} holds no complete "
                    "checkpoint: set exp_manager.resume_ignore_no_checkpoint=True to start fresh"
                )
            return
        beside = self.task.trained_beside()
        self.state = checkpointing.load(newest, self.model, self.optimizer, _pairs(beside))
        self.scheduler.load_state_dict(self.state.scheduler)
        for other, trained in beside.items():
            trained.scheduler.load_state_dict(self.state.task[f"{other}.scheduler"])
        update_num_microbatches(self.state.consumed_samples, consistency_check=False)
        if self.rank == 0:
            print(
                f"resumed from {newest.path} at step {self.state.step} "
                f"({self.state.consumed_samples} samples consumed)",
                flush=True,
            )

    # ----- the loop ---------------------------------------------------------------------

    def _stop_requested(self, max_seconds: float | None) -> tuple[bool, bool]:
        """(signal received, max_time reached), agreed by all ranks."""
        flags = torch.tensor(
            [
                float(self.stop_signals.received is not None),
                float(max_seconds is not None and time.monotonic() - self.started >= max_seconds),
            ]
        )
        if self.on_gpu:
            flags = flags.cuda()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1])

    def _val_interval(self) -> int:
        interval = self.cfg.trainer.get("val_check_interval")
        max_steps = int(self.cfg.trainer.max_steps)
        if interval is None:
            return max_steps
        if isinstance(interval, float) and interval <= 1.0:
            return max(1, int(interval * max_steps))
        return int(interval)

    def fit(self) -> int:
        trainer = self.cfg.trainer
        max_steps = int(trainer.max_steps)
        log_every = int(trainer.log_every_n_steps)
        save_every = int(self._checkpoint_params().get("every_n_train_steps") or max_steps)
        max_seconds = recipe.parse_max_time(trainer.max_time) if trainer.get("max_time") else None
        self.prepare_data()
        self.resume()
        if self.rank == 0:
            wandb_run = wandb_logger.open_run(
                self.cfg.exp_manager,
                str(self.cfg.run.name),
                self.log_dir,
                resumed=self.state.step > 0,
            )
            self.metrics_log = metrics.MetricsLog(self.log_dir, wandb_run)
            self.metrics_log.truncate_after(self.state.step)
        if self.state.step >= max_steps:
            self.say(f"training already finished: step {self.state.step} of {max_steps}")
            return self._complete()
        if self.state.early_stopping.get("stopped"):
            self.say(
                f"training already finished: stopped early at step {self.state.step} "
                f"({self.state.early_stopping['stopped']})"
            )
            return self._complete()
        self.task.before_training(self)
        shape = self.family.shape(self.cfg.model, self.vocab.vocab_size, "training")
        costs = self.family.costs(shape, self.layout)
        window: list[float] = []  # step times since the last log line
        window_loss: torch.Tensor | None = None
        saved_step = self.state.step
        while self.state.step < max_steps:
            self.nsys.before_step(self.state.step + 1)
            tick = time.perf_counter()
            local_loss, record = self.train_step()
            if self.on_gpu:
                torch.cuda.synchronize()
            window.append(time.perf_counter() - tick)
            self.nsys.after_step(self.state.step)
            window_loss = local_loss if window_loss is None else window_loss + local_loss
            step = self.state.step
            if step % log_every == 0 or step == max_steps:
                # The mean over the steps since the last log line, as Megatron reports it.
                record["reduced_train_loss"] = self._reduce_loss(window_loss)
                if self.expert_load is not None:
                    record.update(self.expert_load.window_metrics())
                self._log_train(step, record, window, costs)
                window, window_loss = [], None
            if step % self._val_interval() == 0:
                val_loss = self.validate()
                if not math.isnan(val_loss):
                    self.state.metrics["val_loss"] = val_loss
                    self.record({"step": step, "val_loss": val_loss})
                    self.say(f"validation at step {step}: val_loss {val_loss:.4f}")
                reason = self._early_stop(step)
                if reason is not None:
                    self.save_checkpoint()  # it records the stop: a rerun finds the run done
                    self.say(f"early stopping at step {step}: {reason}")
                    break
            if step % save_every == 0 or step == max_steps:
                self.save_checkpoint()
                saved_step = step
            stop_signal, out_of_time = self._stop_requested(max_seconds)
            if stop_signal or out_of_time:
                if saved_step != step:
                    self.save_checkpoint()
                if stop_signal:
                    self.say(
                        f"stopped by a signal at step {step}; checkpoint saved; exit code "
                        f"{EXIT_PREEMPTED} (resume with the same command)"
                    )
                    self._finish()
                    return EXIT_PREEMPTED
                self.say(f"trainer.max_time reached at step {step}; checkpoint saved")
                break
        return self._complete()

    def _log_train(
        self, step: int, record: dict[str, float], window: list[float], costs: Costs
    ) -> None:
        step_time = sum(window) / len(window)
        tokens = record["global_batch_size"] * costs.seq
        record = {
            "step": step,
            "wall_time": time.time(),
            "consumed_samples": self.state.consumed_samples,
            **record,
            "train_step_timing": step_time,
            "tokens_per_sec": tokens / step_time,
            "model_tflops_per_gpu": costs.flops_per_sample
            * record["global_batch_size"]
            / step_time
            / self.layout.world_size
            / 1e12,
            "peak_memory_gb": metrics.peak_memory_gb(self.on_gpu),
        }
        self.record(record)
        self.say(metrics.progress_line(step, int(self.cfg.trainer.max_steps), record))

    @property
    def finished(self) -> bool:
        """Whether the run has done every step, or early stopping ended it (not a signal or
        max_time, after which it resumes)."""
        done = self.state.step >= int(self.cfg.trainer.max_steps)
        return done or bool(self.state.early_stopping.get("stopped"))

    def _early_stop(self, step: int) -> str | None:
        """Count this validation for early stopping; the reason to stop, or None."""
        stopping = self.early_stopping
        if stopping is None:
            return None
        value = self.state.metrics.get(stopping.monitor)
        if value is None:
            logged = ", ".join(sorted(self.state.metrics)) or "none"
            raise JobError(
                f"{self.task.stage}.exp_manager.early_stopping_callback_params.monitor: "
                f"{stopping.monitor} is not a validation metric of this run (it logs: {logged})"
            )
        record = self.state.early_stopping
        record["step"] = step
        reason = stopping.update(record, float(value))
        if reason is not None:
            record["stopped"] = reason
        return reason

    def record(self, record: dict[str, Any]) -> None:
        """A line of metrics.jsonl (and W&B), on rank 0."""
        if self.metrics_log is not None:
            self.metrics_log.write(record)

    def say(self, message: str) -> None:
        if self.rank == 0:
            print(message, flush=True)

    def _complete(self) -> int:
        """The end of a run no signal stopped: its log closed, then, when every step is done,
        the task's outputs."""
        code = self._finish()
        if self.finished:
            self.task.write_outputs(self)
        return code

    def _finish(self) -> int:
        self.nsys.close()  # a run stopped inside the profiled steps
        if self.metrics_log is not None:
            self.metrics_log.close()
            curve = self.log_dir / "loss_curve.png"
            if metrics.plot_loss_curve(self.metrics_log.path, curve, str(self.cfg.run.name)):
                print(f"loss curve: {curve}", flush=True)
            load = self.log_dir / "expert_load.png"
            if self.expert_load is not None and self.expert_load.plot(load, str(self.cfg.run.name)):
                print(f"expert load: {load}", flush=True)
        dist.barrier()
        return 0


def _pairs(beside: dict[str, TrainedBeside]) -> checkpointing.Beside:
    return {name: (trained.model, trained.optimizer) for name, trained in beside.items()}
