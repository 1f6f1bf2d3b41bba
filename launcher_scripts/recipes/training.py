"""The training recipe as typed values, and the checks that keep a run from failing late.

Pure Python (no torch): the launcher's preflight and the job program both read recipes
through this module, so a recipe the launcher accepts is one the job understands.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher_scripts.config.checks import (
    require_heads_split,
    require_int,
    require_position_embedding,
)
from launcher_scripts.errors import ConfigError
from launcher_scripts.formats.portable import EMBEDDINGS
from launcher_scripts.formats.portable_check import PortableFileError, inspect_portable
from launcher_scripts.recipes import restore
from launcher_scripts.recipes.early_stopping import OPTIONAL_KEYS as EARLY_STOPPING_KEYS
from launcher_scripts.recipes.early_stopping import read_early_stopping
from launcher_scripts.recipes.layout import (
    Layout,
    check_experts,
    check_world,
    read_layout,
    read_recompute,
)
from launcher_scripts.recipes.model_shape import read_experts
from launcher_scripts.recipes.optimizer import OPTIMIZERS, check_optimizer
from launcher_scripts.recipes.precision import dtype_of

ACTIVATIONS = ("gelu", "gelu-tanh", "fast-swiglu", "swiglu", "squared-relu")
NORMALIZATIONS = ("layernorm", "layernorm1p", "rmsnorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
# NeMo's schedule names and megatron-core's decay styles for them. WarmupAnnealing: linear
# warm-up, then linear decay to min_lr; InverseSquareRootAnnealing: lr ~ 1 / sqrt(step).
DECAY_STYLES = {
    "CosineAnnealing": "cosine",
    "constant": "constant",
    "WarmupAnnealing": "linear",
    "InverseSquareRootAnnealing": "inverse-square-root",
}
SCHEDULERS = tuple(DECAY_STYLES)

# Keys the training loop (trainer.py, metrics.py, pretrain.py) reads with a default, which a
# recipe may leave out; the tuning stages run the same loop on their recipe's run, trainer,
# exp_manager and optim sections. The preflight's key check knows them from here.
LOOP_OPTIONAL_KEYS = (
    "run.rendezvous_timeout_seconds",
    "trainer.accelerator",
    "trainer.max_time",
    "trainer.limit_val_batches",
    "trainer.gradient_clip_val",
    "trainer.val_check_interval",
    "exp_manager.create_wandb_logger",
    "exp_manager.resume_if_exists",
    "exp_manager.resume_ignore_no_checkpoint",
    "exp_manager.checkpoint_callback_params.every_n_train_steps",
    "model.optim.betas",
    "model.optim.eps",
    "model.optim.weight_decay",
    "model.optim.sched.warmup_steps",
    "model.optim.sched.constant_steps",
    "model.optim.sched.min_lr",
    *EARLY_STOPPING_KEYS,
)
# Maps the loop passes on as they are: wandb.init's keyword arguments.
LOOP_FREE_FORM = ("exp_manager.wandb_logger_kwargs",)
# Continued pretraining's keys (recipes/restore.py), for the families that run it.
RESTORE_OPTIONAL_KEYS = ("model.restore_from_path", "model.padded_vocab_size")


@dataclass(frozen=True)
class DataBlend:
    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None  # None: one prefix, or sizes decide


@dataclass(frozen=True)
class Schedule:
    warmup_steps: int
    constant_steps: int
    decay_style: str  # megatron-core's: cosine | constant | linear | inverse-square-root
    min_lr: float


def key(stage: str, *parts: str) -> str:
    return ".".join((stage, *parts))


def section(cfg: Any, name: str) -> Any:
    value = cfg.get(name) if hasattr(cfg, "get") else None
    return value if value is not None else {}


def data_blend(cfg: Any, stage: str = "training") -> DataBlend:
    """`data_prefix` as NeMo writes it: [path], or [weight, path, weight, path, ...]."""
    name = key(stage, "model.data.data_prefix")
    prefix = cfg.model.data.data_prefix
    if isinstance(prefix, str):
        prefix = [prefix]
    items = list(prefix or [])
    if not items:
        raise ConfigError(name, "is empty", f"Set {name}=[1.0,/data/my_text_document]")
    if all(isinstance(item, str) for item in items):
        return DataBlend(tuple(items), None)
    if len(items) % 2 or not all(
        isinstance(w, int | float) and not isinstance(w, bool) and isinstance(p, str)
        for w, p in zip(items[::2], items[1::2], strict=True)
    ):
        raise ConfigError(
            name,
            "must be a list of paths or of weight, path pairs",
            f"Write {name}=[0.5,/data/a_text_document,0.5,/data/b_text_document]",
        )
    weights = tuple(float(w) for w in items[::2])
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(name, "has a negative or all-zero weight", "Use positive weights")
    return DataBlend(tuple(items[1::2]), weights)


def sampling_weights(token_counts: list[int], alpha: float) -> tuple[float, ...]:
    """NeMo's (and XLM's) language sampling: dataset i is drawn with probability
    n_i^alpha / sum_j n_j^alpha, n_i its tokens; alpha 1 samples by size, 0 uniformly."""
    scaled = [count**alpha if count else 0.0 for count in token_counts]
    total = sum(scaled)
    return tuple(value / total for value in scaled)


def blending_alpha(cfg: Any, stage: str = "training") -> float | None:
    """`run.blending_alpha`: the exponent that weights a blend given as paths alone."""
    alpha = cfg.run.get("blending_alpha")
    if alpha is None:
        return None
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha <= 1:
        raise ConfigError(
            key(stage, "run.blending_alpha"), f"{alpha!r} is not a number from 0 to 1", "Fix it"
        )
    return float(alpha)


def precision(cfg: Any, stage: str = "training") -> str:
    """The dtype the recipe trains in: "bf16", "fp16" or "fp32" (recipes.precision)."""
    return dtype_of(cfg.trainer.precision, key(stage, "trainer.precision"))


def schedule(cfg: Any, stage: str = "training") -> Schedule:
    sched = section(cfg.model.optim, "sched")
    name = sched.get("name", "constant") if sched else "constant"
    if name not in SCHEDULERS:
        raise ConfigError(
            key(stage, "model.optim.sched.name"),
            f"{name!r} is not supported",
            f"Use one of: {', '.join(SCHEDULERS)}",
        )
    warmup = int(sched.get("warmup_steps") or 0)
    if sched.get("warmup_ratio") is not None:  # NeMo: a share of max_steps instead
        warmup = int(float(sched.warmup_ratio) * int(cfg.trainer.max_steps))
    return Schedule(
        warmup_steps=warmup,
        constant_steps=int(sched.get("constant_steps") or 0),
        decay_style=DECAY_STYLES[name],
        min_lr=float(sched.get("min_lr") or 0.0),
    )


def rampup(model: Any, stage: str = "training") -> tuple[int, int, int] | None:
    """model.rampup_batch_size: [start global batch, increment, samples to ramp up over]."""
    value = model.get("rampup_batch_size")
    if value in (None, "null"):
        return None
    name = key(stage, "model.rampup_batch_size")
    if isinstance(value, str):
        value = [v.strip() for v in value.strip("[]").split(",")]
    try:
        start, increment, samples = (int(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(
            name, f"{value!r} is not [start, increment, samples]", f"Write {name}=[16,16,100000]"
        ) from None
    return start, increment, samples


def validate(cfg: Any, stage: str = "training", will_exist: Any = None) -> None:
    """Every check of a GPT recipe that can be made before a job starts; the first failure is
    raised.

    `will_exist(path)` tells whether an earlier stage of the same run writes a file.
    """
    model = cfg.model
    check_optimizer(model, stage)
    layout = read_layout(cfg, stage)
    check_world(layout, stage)
    chunks = layout.pipeline * (layout.virtual_pipeline or 1)
    check_layer_split(model.num_layers, chunks, layout, stage)
    check_attention(model, layout, key(stage, "model"))
    experts = read_experts(model, key(stage, "model"), model.num_layers, model.ffn_hidden_size)
    check_experts(experts, layout, stage, bool(model.get("bias", True)))
    check_sequence(model.data.seq_length, layout, stage)
    check_batch(model, layout, stage)
    _check_architecture(model, stage)
    precision(cfg, stage)
    schedule(cfg, stage)
    check_trainer(cfg, stage)
    _check_warmup(cfg, stage)
    rendezvous_timeout(cfg, stage)
    check_inputs(cfg, stage, will_exist or (lambda _path: False))


DEFAULT_RENDEZVOUS_TIMEOUT = 600.0


def rendezvous_timeout(cfg: Any, stage: str = "training") -> float:
    """Seconds every process may take to join the process group before the job fails."""
    value = (cfg.get("run") or {}).get("rendezvous_timeout_seconds", DEFAULT_RENDEZVOUS_TIMEOUT)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(
            key(stage, "run.rendezvous_timeout_seconds"),
            f"{value!r} is not a positive number of seconds",
            "Set it to e.g. 600; a job whose processes cannot all meet then fails instead of "
            "hanging",
        )
    return float(value)


def check_layer_split(
    value: Any, chunks: int, layout: Layout, stage: str, name: str = "model.num_layers"
) -> int:
    """`value` layers split into `chunks` equal pipeline chunks."""
    layers = require_int(key(stage, name), value)
    if layers % chunks:
        raise ConfigError(
            key(stage, name),
            f"{layers} layers do not split into {chunks} equal pipeline chunks (PP "
            f"{layout.pipeline}, VP {layout.virtual_pipeline or 1})",
            "Choose num_layers divisible by PP x VP (T5: by each side's pipeline stages)",
        )
    return layers


def check_attention(block: Any, layout: Layout, prefix: str) -> None:
    """Heads (and query groups) divide over tensor parallelism; a head has whole channels."""
    heads = require_int(f"{prefix}.num_attention_heads", block.num_attention_heads)
    groups = block.get("num_query_groups")
    if groups is not None:
        groups = require_int(f"{prefix}.num_query_groups", groups)
    require_heads_split(
        f"{prefix}.num_attention_heads",
        layout.tensor,
        heads,
        groups,
        groups_key=f"{prefix}.num_query_groups",
    )
    if groups is not None and heads % groups:
        raise ConfigError(
            f"{prefix}.num_query_groups",
            f"{groups} query groups do not divide the {heads} heads",
            "Choose num_query_groups accordingly",
        )
    hidden = require_int(f"{prefix}.hidden_size", block.hidden_size)
    if block.get("kv_channels") is None and hidden % heads:
        raise ConfigError(
            f"{prefix}.hidden_size",
            f"{hidden} is not divisible by the {heads} attention heads",
            "Change hidden_size or num_attention_heads, or set kv_channels",
        )
    require_int(f"{prefix}.ffn_hidden_size", block.ffn_hidden_size)


def check_sequence(value: Any, layout: Layout, stage: str) -> int:
    seq = require_int(key(stage, "model.data.seq_length"), value)
    if seq % (2 * layout.context if layout.context > 1 else 1) or (
        layout.sequence_parallel and seq % layout.tensor
    ):
        raise ConfigError(
            key(stage, "model.data.seq_length"),
            f"{seq} does not divide by 2 x CP ({layout.context}) or by TP for sequence parallelism",
            "Choose a sequence length divisible by them",
        )
    return seq


def check_batch(model: Any, layout: Layout, stage: str) -> None:
    mbs = require_int(key(stage, "model.micro_batch_size"), model.micro_batch_size)
    gbs = require_int(key(stage, "model.global_batch_size"), model.global_batch_size)
    per_step = mbs * layout.data
    if gbs % per_step:
        raise ConfigError(
            key(stage, "model.global_batch_size"),
            f"{gbs} is not a multiple of micro_batch_size {mbs} x data-parallel size {layout.data}",
            f"Use a multiple of {per_step}",
        )
    ramp = rampup(model, stage)
    if ramp:
        start, increment, _samples = ramp
        if start % per_step or increment % per_step or (gbs - start) % increment:
            raise ConfigError(
                key(stage, "model.rampup_batch_size"),
                f"start {start} and increment {increment} must be multiples of {per_step} "
                f"and reach global_batch_size {gbs}",
                "Adjust the ramp-up",
            )
    if layout.pipeline > 1 and layout.virtual_pipeline and (gbs // per_step) % layout.pipeline:
        raise ConfigError(
            key(stage, "model.global_batch_size"),
            f"gives {gbs // per_step} micro-batches per step, not a multiple of PP "
            f"{layout.pipeline} as the interleaved schedule needs",
            f"Use a multiple of {per_step * layout.pipeline}",
        )


def _check_architecture(model: Any, stage: str) -> None:
    require_position_embedding(
        key(stage, "model.position_embedding_type"),
        model.get("position_embedding_type"),
        POSITION_EMBEDDINGS,
    )
    for name, allowed in (("activation", ACTIVATIONS), ("normalization", NORMALIZATIONS)):
        value = model.get(name)
        if value not in allowed:
            raise ConfigError(
                key(stage, f"model.{name}"),
                f"{value!r} is not supported",
                f"Use one of: {', '.join(allowed)}",
            )
    if model.position_embedding_type == "learned_absolute":
        check_positions(model, model.data.seq_length, "model.data.seq_length", stage)
    check_recompute(model, stage)
    optimizer = model.optim.name
    if optimizer not in OPTIMIZERS:
        raise ConfigError(
            key(stage, "model.optim.name"),
            f"{optimizer!r} is not supported",
            f"Use one of: {', '.join(OPTIMIZERS)}",
        )


def check_positions(model: Any, seq: int, name: str, stage: str) -> None:
    """A sequence of `seq` tokens (the key `name`) fits the learned position table."""
    if seq > model.max_position_embeddings:
        raise ConfigError(
            key(stage, name),
            f"{seq} is longer than max_position_embeddings {model.max_position_embeddings}",
            f"Lower {name.rsplit('.', 1)[-1]} or raise max_position_embeddings",
        )


def check_recompute(block: Any, stage: str, prefix: str = "model") -> None:
    read_recompute(block, stage, prefix)


def _check_warmup(cfg: Any, stage: str) -> None:
    schedule_ = schedule(cfg, stage)
    if schedule_.warmup_steps + schedule_.constant_steps > cfg.trainer.max_steps:
        raise ConfigError(
            key(stage, "model.optim.sched.warmup_steps"),
            f"warmup {schedule_.warmup_steps} + constant {schedule_.constant_steps} steps "
            f"exceed max_steps {cfg.trainer.max_steps}",
            "Lower the warm-up or raise trainer.max_steps",
        )


def check_context_parallel(cfg: Any, stage: str, jobs_find_gpus: Callable[[], bool | None]) -> None:
    """Context parallelism runs on Transformer Engine's attention, on GPUs: the job refuses it
    otherwise when it starts (jobs/training/trainer.py), so preflight does first.
    `jobs_find_gpus`: whether the jobs' processes will find a GPU (None: not known here); a
    recipe asking for GPUs runs on the CPU without one."""
    name = key(stage, "model.context_parallel_size")
    context = require_int(name, cfg.model.get("context_parallel_size", 1))
    if context <= 1:
        return
    needs = "context parallelism needs Transformer Engine on GPUs"
    if str(cfg.trainer.get("accelerator", "gpu")) == "cpu":
        raise ConfigError(
            name,
            f"is {context} but this run is on CPU ({key(stage, 'trainer.accelerator')}=cpu) and "
            f"{needs}",
            f"Set {name}=1 for CPU runs",
        )
    if jobs_find_gpus() is False:
        raise ConfigError(
            name,
            f"is {context} but the jobs run on this machine, where torch finds no GPU (they "
            f"would run on CPU), and {needs}",
            f"Set {name}=1 here, or run on a machine or cluster with GPUs",
        )
    if not cfg.model.get("transformer_engine", False):
        raise ConfigError(
            name,
            f"is {context} but {key(stage, 'model.transformer_engine')} is not true, and {needs}",
            f"Set {key(stage, 'model.transformer_engine')}=true (Transformer Engine installed "
            f"where the jobs run), or {name}=1",
        )


def check_trainer(cfg: Any, stage: str) -> None:
    trainer = cfg.trainer
    granularity = cfg.model.get("activations_checkpoint_granularity")
    if str(trainer.get("accelerator", "gpu")) == "cpu" and granularity is not None:
        # megatron-core's recomputation saves and restores the CUDA RNG state.
        raise ConfigError(
            key(stage, "model.activations_checkpoint_granularity"),
            f"{granularity} recomputation needs CUDA and this run is on CPU",
            "Set it to null for CPU runs",
        )
    max_steps = require_int(key(stage, "trainer.max_steps"), trainer.max_steps)
    require_int(key(stage, "trainer.log_every_n_steps"), trainer.log_every_n_steps)
    interval = trainer.get("val_check_interval")
    if isinstance(interval, float) and not interval.is_integer():
        if not 0 < interval <= 1:
            raise ConfigError(
                key(stage, "trainer.val_check_interval"),
                f"{interval} is neither a step count nor a fraction of max_steps",
                "Use an integer number of steps or a fraction in (0, 1]",
            )
    elif interval is not None:
        require_int(key(stage, "trainer.val_check_interval"), int(interval))
    if trainer.get("max_time"):
        parse_max_time(trainer.max_time, key(stage, "trainer.max_time"))
    read_early_stopping(cfg.exp_manager, stage)
    params = section(cfg.exp_manager, "checkpoint_callback_params")
    if params:
        require_int(
            key(stage, "exp_manager.checkpoint_callback_params.every_n_train_steps"),
            params.get("every_n_train_steps") or max_steps,
        )
        top_k = params.get("save_top_k", 1)
        if not isinstance(top_k, int) or top_k < -1:
            raise ConfigError(
                key(stage, "exp_manager.checkpoint_callback_params.save_top_k"),
                f"{top_k!r} is not valid",
                "Use -1 (keep all), 0 (keep only the last) or a positive count",
            )


def parse_max_time(value: Any, name: str = "training.trainer.max_time") -> float:
    """Lightning's "DD:HH:MM:SS" (or fewer fields) in seconds."""
    parts = str(value).split(":")
    try:
        numbers = [float(p) for p in parts]
    except ValueError:
        numbers = []
    if not 1 <= len(numbers) <= 4 or any(n < 0 or math.isnan(n) for n in numbers):
        raise ConfigError(name, f"{value!r} is not DD:HH:MM:SS", f'Write {name}="00:04:00:00"')
    seconds = 0.0
    for number, scale in zip(reversed(numbers), (1, 60, 3600, 86400), strict=False):
        seconds += number * scale
    return seconds


def tokenizer_file(cfg: Any) -> str | None:
    """The file the job reads its tokenizer from: the recipe's, or the restored model's."""
    restored = restore.restore_path(cfg.model)
    if restored:
        return restored
    tokenizer = cfg.model.tokenizer
    return tokenizer.get("model") or tokenizer.get("vocab_file")


def check_inputs(cfg: Any, stage: str, will_exist: Any) -> None:
    for prefix in data_blend(cfg, stage).prefixes:
        for suffix in (".bin", ".idx"):
            path = Path(prefix + suffix)
            if not path.is_file() and not will_exist(prefix) and not will_exist(str(path)):
                raise ConfigError(
                    key(stage, "model.data.data_prefix"),
                    f"{path} does not exist and no earlier stage of this run writes it",
                    "Run the data_preparation recipe that writes it first (or in the same run), "
                    "or fix the prefix",
                )
    if restore.restore_path(cfg.model):
        check_restore(cfg, stage, will_exist)
        return  # the tokenizer is the file's
    tokenizer = cfg.model.tokenizer
    library = tokenizer.get("library")
    check_tokenizer_library(tokenizer, stage)
    files = [("model", tokenizer.get("model"))]
    if library == "megatron" or tokenizer.get("vocab_file"):
        files = [("vocab_file", tokenizer.get("vocab_file"))]
        if tokenizer.get("type", "GPT2BPETokenizer") == "GPT2BPETokenizer":
            files.append(("merge_file", tokenizer.get("merge_file")))
    for name, path in files:
        if not path:
            raise ConfigError(
                key(stage, f"model.tokenizer.{name}"), "is not set", "Give the tokenizer's file"
            )
        if not Path(str(path)).is_file() and not will_exist(str(path)):
            raise ConfigError(
                key(stage, f"model.tokenizer.{name}"),
                f"{path} does not exist and no earlier stage of this run writes it",
                "Run the data_preparation recipe that writes it first (or in the same run), "
                "or fix the path",
            )


def check_tokenizer_library(tokenizer: Any, stage: str) -> None:
    """The job reads the files the tokenizer section names (a `model` first), the export and
    the serving read `library`: both must mean one tokenizer. A SentencePiece library with a
    WordPiece vocab_file trains on WordPiece ids, then cannot export its tokenizer."""
    library, model = tokenizer.get("library"), tokenizer.get("model")
    if library == "sentencepiece" and not model:
        given = tokenizer.get("vocab_file")
        raise ConfigError(
            key(stage, "model.tokenizer.model"),
            "is not set, but tokenizer.library is sentencepiece, which reads a SentencePiece "
            f".model{f', not the vocab_file {given} it names' if given else ''}",
            "Set model to the .model file, or for a WordPiece vocab.txt set "
            "tokenizer.library=megatron and tokenizer.type=BertWordPieceLowerCase (or "
            "BertWordPieceCase)",
        )
    if library == "megatron" and model:
        raise ConfigError(
            key(stage, "model.tokenizer.model"),
            f"is {model}, but tokenizer.library is megatron, which reads vocab_file (and "
            "merge_file)",
            "Set model=null, or for a SentencePiece model set tokenizer.library=sentencepiece",
        )


def check_restore(cfg: Any, stage: str, will_exist: Any) -> None:
    """model.restore_from_path: a portable file of this recipe's architecture, or one an
    earlier stage of the run writes (the job checks that one when it starts). Its family the
    training stage checks first (families/file_family.py)."""
    name = key(stage, restore.RESTORE_KEY)
    path = Path(str(restore.restore_path(cfg.model)))
    if not path.is_file():
        if will_exist(str(path)):
            return
        raise ConfigError(
            name,
            f"{path} does not exist and no earlier stage of this run writes it",
            "Import the model first (conversion=hf_import), or give the .nemo file the "
            "conversion or fine_tuning stage wrote",
        )
    try:
        summary = inspect_portable(path)
    except PortableFileError as error:
        raise ConfigError(name, str(error), "Give a whole portable .nemo model file") from None
    rows = summary.shapes[EMBEDDINGS][0]
    restore.restored_model(cfg.model, summary.config, rows, stage)


def encoder_decoder_split(model: Any, pipeline: int, stage: str) -> tuple[int, int]:
    """(encoder stages, decoder stages): the encoder runs on the pipeline stages before
    `pipeline_model_parallel_split_rank`, the decoder on the rest. megatron-core's schedule hands
    one tensor from stage to stage, and a decoder stage after another would need two (its
    input and the encoder's output): the decoder is the last stage alone."""
    if pipeline == 1:
        return 1, 1
    name = key(stage, "model.pipeline_model_parallel_split_rank")
    split = model.get("pipeline_model_parallel_split_rank")
    if isinstance(split, bool) or not isinstance(split, int) or split != pipeline - 1:
        raise ConfigError(
            name,
            f"{split!r} must be PP - 1 = {pipeline - 1}: megatron-core hands one tensor between "
            "pipeline stages, so the encoder runs on the stages before the split rank and the "
            "whole decoder on the last stage",
            f"Set it to {pipeline - 1}",
        )
    return split, pipeline - split
